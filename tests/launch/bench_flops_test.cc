// keel-bench's FLOPs per token (launch/train/bench_configs.h), which its GFLOP/s and MFU figures
// rest on, against hand counts: GPT-2 small (multi-head) and the Qwen3-0.6B preset, whose
// grouped-query attention (8 k/v heads of 16) and head_dim 128 (2048 wide at d_model 1024) make
// 4 d^2 per layer wrong by a fifth. The Qwen3 figure at 2048 tokens is the one
// launch/tools/plan_step_time.py prints for its Qwen3-0.6B row (docs/distributed.md).
#include <gtest/gtest.h>

#include <string>

#include "framework/config/config.h"
#include "launch/train/bench_configs.h"

namespace keel {
namespace {

config::KeelConfig preset(const std::string& name) {
  return load_config(std::string(KEEL_SOURCE_DIR) + "/launch/configs/published/" + name, {});
}

TEST(BenchFlops, Gpt2SmallIsSixNPlusAttention) {
  const config::KeelConfig c = preset("gpt2_124m.pbtxt");
  // Per layer 4 d^2 + 2 d f = 4 x 768^2 + 2 x 768 x 3072 = 7,077,888 weights in matrices; 12
  // layers and the 50257 x 768 head: 84,934,656 + 38,597,376 = 123,532,032.
  const double n = 123'532'032.0;
  const double attention = 12.0 * 12 * 1024 * 768;  // 12 L T H D = 113,246,208
  EXPECT_DOUBLE_EQ(bench::flops_per_token(c), 6 * n + attention);
}

TEST(BenchFlops, Qwen3CountsGroupedKvAndHeadDim) {
  config::KeelConfig c = preset("qwen3_0.6b.pbtxt");
  c.mutable_model()->set_seq_len(2048);
  // Per layer: q, k, v 1024 x (16 + 2 x 8) x 128 = 4,194,304; out 2048 x 1024 = 2,097,152;
  // SwiGLU 3 x 1024 x 3072 = 9,437,184; x 28 = 440,401,920, plus the 151936 x 1024 head
  // (155,582,464): 595,984,384. 6 N = 3,575,906,304; 12 L T H D = 12 x 28 x 2048 x 16 x 128 =
  // 1,409,286,144.
  EXPECT_DOUBLE_EQ(bench::flops_per_token(c), 4'985'192'448.0);
}

}  // namespace
}  // namespace keel
