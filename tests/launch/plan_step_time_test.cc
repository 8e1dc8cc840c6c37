// The "Sizing a GPU run" tables of docs/distributed.md are what launch/tools/plan_step_time.py
// prints, line for line, the script's arithmetic holds for rows recomputed here (124M at
// TP8 x DP16; the grouped-query Qwen3-0.6B at TP8 x DP16 and Gemma3-1B, whose one k/v head is
// replicated, at TP2 x DP64), and every row is a head layout keel-train accepts.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::read_file;
using testing::run_command;
using testing::TempDir;

const std::string kScript = std::string(KEEL_SOURCE_DIR) + "/launch/tools/plan_step_time.py";

// Line `n` (0-based) of the script's output.
std::string line_of(const std::string& out, int n) {
  std::istringstream lines(out);
  std::string line;
  for (int i = 0; i <= n; ++i) std::getline(lines, line);
  return line;
}

// The number after " key=" in one of the script's "key=value ..." lines.
double value_of(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  EXPECT_NE(at, std::string::npos) << key << " in " << line;
  return at == std::string::npos ? 0.0 : std::stod(line.substr(at + key.size() + 2));
}

// Both tables: the default (bf16 on the TP wire) and --tp-comm-dtype FP32 (whose TP1 row, the
// same as the first table's, the page leaves out).
TEST(PlanStepTime, ReadmeTablesAreTheScriptsOutput) {
  TempDir dir("keel_plan_step_time_test");
  const std::string doc = read_file(std::string(KEEL_SOURCE_DIR) + "/docs/distributed.md");
  for (const std::string flags : {"", " --tp-comm-dtype FP32", " --sequence-parallel"}) {
    const auto r = run_command("python3 " + kScript + " --markdown" + flags, dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::istringstream lines(r.out);
    std::string line;
    int rows = 0;
    while (std::getline(lines, line)) {
      EXPECT_NE(doc.find(line + "\n"), std::string::npos)
          << "not in docs/distributed.md (" << flags << "): " << line;
      ++rows;
    }
    EXPECT_EQ(rows, 9) << flags;  // header, rule, seven layouts
  }
}

// Every row is a layout keel-train accepts: TP splits whole heads (the 124M row at TP8 has 16), the
// k/v heads divide the query heads, and tp divides the k/v heads (sharded) or they divide tp
// (replicated, Note [gqa layouts] in layers/attention.h).
TEST(PlanStepTime, EveryRowSplitsWholeHeads) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    const size_t tp_at = line.find("layout=TP");
    ASSERT_NE(tp_at, std::string::npos) << line;
    const int tp = std::stoi(line.substr(tp_at + 9));
    const int heads = static_cast<int>(value_of(line, "heads"));
    const int kv_heads = static_cast<int>(value_of(line, "kv_heads"));
    EXPECT_EQ(heads % tp, 0) << line;
    EXPECT_EQ(heads % kv_heads, 0) << line;
    EXPECT_TRUE(kv_heads % tp == 0 || tp % kv_heads == 0) << line;
    EXPECT_EQ(value_of(line, "kv_replicated"), kv_heads % tp != 0 ? 1 : 0) << line;
    ++rows;
  }
  EXPECT_EQ(rows, 7);
}

// 124M at TP8 x DP16, micro-batch 16 x 2 accumulation steps of 1024 tokens: the TP formula of
// docs/distributed.md, A[w (2 + 4L) BT C + 4 x 3 BT] + 8 bytes, w = 2 with bf16 on the TP wire
// (the default, whose TP time adds A BT C (12 + 6 (1 + 2L)) bytes of HBM traffic at 3.35 TB/s) or
// 4 (--tp-comm-dtype FP32), and the fp32 arena over TP for DP.
class PlanStepTimeWire : public ::testing::TestWithParam<int> {};

TEST_P(PlanStepTimeWire, ArithmeticOfOneRow) {
  const int w = GetParam();
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command(
      "python3 " + kScript + (w == 4 ? " --tp-comm-dtype FP32" : " --tp-comm-dtype BF16"), dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  auto field = [&](const std::string& key) { return value_of(first, key); };
  const double L = 12, C = 768, T = 1024, V = 50304, BT = 16 * T, A = 2;
  EXPECT_EQ(field("tp_bytes"), A * (w * (2 + 4 * L) * BT * C + 4 * 3 * BT) + 8);
  const double params = L * 12 * C * C + V * C + T * C;
  EXPECT_NEAR(field("params"), params, 1e-6 * params);
  EXPECT_NEAR(field("dp_bytes"), 4 * params / 8, 1e-6 * params);
  const double flops = (6 * (L * 12 * C * C + V * C) + 12 * L * T * C) * 512 * T;
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-8 * std::abs(b); };
  EXPECT_TRUE(near(field("compute_s"), flops / 128 / (0.45 * 989e12)));
  const double cast_s = w == 2 ? A * BT * C * (12 + 6 * (1 + 2 * L)) / 3.35e12 : 0.0;
  EXPECT_TRUE(near(field("tp_s"), 2 * 7.0 / 8 * field("tp_bytes") / 450e9 + cast_s));
  EXPECT_TRUE(near(field("dp_s"), 2 * 15.0 / 16 * field("dp_bytes") / 50e9));
}

INSTANTIATE_TEST_SUITE_P(Wire, PlanStepTimeWire, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return i.param == 2 ? std::string("BF16") : std::string("FP32");
                         });

// --sequence-parallel, 124M at TP8 x DP16 (16 x 2 of 1024 tokens): the formula of
// docs/distributed.md with sequence parallelism, fp32 all-gathers and reduce-scatters of
// (4 + 10L) BT C per micro-batch moving 7/8 of each buffer per rank in a ring, plus all-reduces
// (2 (7/8)) of the loss statistics, the 2L + 1 LayerNorms' weight and bias gradients and the
// 8-byte norm; no bf16 casts.
TEST(PlanStepTime, SequenceParallelArithmeticOfOneRow) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript + " --sequence-parallel", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  auto field = [&](const std::string& key) { return value_of(first, key); };
  const double L = 12, C = 768, BT = 16 * 1024, A = 2;
  const double gather = 4 * A * (4 + 10 * L) * BT * C;
  const double reduce = 4 * A * (3 * BT + (2 * L + 1) * 2 * C) + 8;
  EXPECT_EQ(field("tp_bytes"), gather + reduce);
  const double want_s = (7.0 / 8 * gather + 2 * 7.0 / 8 * reduce) / 450e9;
  EXPECT_LE(std::abs(field("tp_s") - want_s), 1e-8 * want_s);
}

// Grouped-query attention, Qwen3-0.6B's shape at TP8 x DP16 (the fifth row; micro-batch 8 x 4 of
// 2048 tokens): V 151936, C 1024, L 28, H 16 query heads on Hkv 8 k/v heads of D 128, F 3072
// SwiGLU, RoPE, tied. FLOPs per token (PaLM): 6 N + 12 L T H D, with the matmul weights
//   N = L [C (H + 2 Hkv) D  (q, k, v)  +  H D C  (output)  +  3 C F  (gate, up, down)] + V C,
// here 28 (4,194,304 + 2,097,152 + 9,437,184) + 155,582,464 = 595,984,384 (Qwen3-0.6B's published
// 596,049,920 less its 65,536 norm gains), and 12 L T H D = 1,409,286,144. k/v heads shard 8 ways
// (one each), so the TP bytes are the multi-head formula's and the DP arena is params / tp.
TEST(PlanStepTime, GroupedQueryArithmeticOfOneRow) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string row = line_of(r.out, 4);
  ASSERT_NE(row.find("name=Qwen3-0.6B "), std::string::npos) << row;
  ASSERT_NE(row.find("layout=TP8 x DP16"), std::string::npos) << row;
  auto field = [&](const std::string& key) { return value_of(row, key); };
  const double V = 151936, C = 1024, L = 28, H = 16, Hkv = 8, D = 128, F = 3072, T = 2048;
  const double N = L * (C * (H + 2 * Hkv) * D + H * D * C + 3 * C * F) + V * C;
  EXPECT_EQ(N, 595984384.0);
  EXPECT_EQ(field("params"), N);  // RoPE: no position table
  const double flops = 6 * N + 12 * L * T * H * D;
  EXPECT_EQ(flops, 4985192448.0);
  EXPECT_EQ(field("flops_token"), flops);
  // Heads of C / H and H k/v heads (4 C^2 a layer, 12 L T C), what the planner counted before
  // GQA and head_dim, would be 21% fewer: q and the output are H D = 2 C wide.
  const double mha = 6 * (L * (4 * C * C + 3 * C * F) + V * C) + 12 * L * T * C;
  EXPECT_EQ(mha, 3928227840.0);
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-8 * std::abs(b); };
  EXPECT_TRUE(near(field("compute_s"), flops * 512 * T / 128 / (0.45 * 989e12)));
  const double BT = 8 * T, A = 4;
  EXPECT_EQ(field("tp_bytes"), A * (2 * (2 + 4 * L) * BT * C + 4 * 3 * BT) + 8);
  EXPECT_EQ(field("dp_bytes"), 4 * N / 8);
  EXPECT_EQ(field("kv_replicated"), 0);
}

// Replicated k/v heads: Gemma3-1B's shape (V 262144, C 1152, L 26, H 4 on Hkv 1 k/v head of D 256,
// F 6912 GeGLU) at TP2 x DP64 (the seventh row; 4 x 2 of 2048 tokens). Each rank projects the one
// k/v head whole, K = L 2 Hkv D C = 15,335,424 weights: their 6 K FLOPs a token are not split by
// tp, their gradients are whole in each rank's DP arena, and TP all-reduces them (fp32) once a
// step on top of the multi-head formula.
TEST(PlanStepTime, ReplicatedKvArithmeticOfOneRow) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string row = line_of(r.out, 6);
  ASSERT_NE(row.find("name=Gemma3-1B "), std::string::npos) << row;
  ASSERT_NE(row.find("layout=TP2 x DP64"), std::string::npos) << row;
  auto field = [&](const std::string& key) { return value_of(row, key); };
  const double V = 262144, C = 1152, L = 26, H = 4, Hkv = 1, D = 256, F = 6912, T = 2048;
  const double N = L * (C * (H + 2 * Hkv) * D + H * D * C + 3 * C * F) + V * C;
  EXPECT_EQ(field("params"), N);
  EXPECT_EQ(N, 999751680.0);  // Gemma 3 1B's 999,885,952 less its 134,272 norm gains
  const double flops = 6 * N + 12 * L * T * H * D;
  EXPECT_EQ(field("flops_token"), flops);
  const double K = L * 2 * Hkv * D * C;
  EXPECT_EQ(K, 15335424.0);
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-8 * std::abs(b); };
  EXPECT_TRUE(near(field("compute_s"), (flops / 2 + 6 * K / 2) * 512 * T / 64 / (0.45 * 989e12)));
  const double BT = 4 * T, A = 2;
  EXPECT_EQ(field("tp_bytes"), A * (2 * (2 + 4 * L) * BT * C + 4 * 3 * BT) + 4 * K + 8);
  EXPECT_EQ(field("dp_bytes"), 4 * ((N - K) / 2 + K));
  EXPECT_EQ(field("kv_replicated"), 1);
}

// The default is parallel.tp_comm_dtype's under train.precision=BF16 (a GPU's default): BF16.
TEST(PlanStepTime, DefaultIsTheBf16Wire) {
  TempDir dir("keel_plan_step_time_test");
  const auto plain = run_command("python3 " + kScript, dir);
  const auto bf16 = run_command("python3 " + kScript + " --tp-comm-dtype BF16", dir);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.out, bf16.out);
}

}  // namespace
}  // namespace keel
