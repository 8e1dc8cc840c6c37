// Step budgets on the CUDA emulator (issue 30 section 1; README.md here, "Budgets"): one training
// step of a fixed small GPT-2-shaped config (LEARNED positions, GELU, LayerNorm, head-shared RMS
// QK-norm, tied embeddings, biases; the default precision) through the emulated CUDA Trainer,
// after two warm-up steps, with every launch, host synchronisation and allocation counted
// (counters.h). A GPU cannot be timed here; these can be counted exactly, so each is held to the
// figure measured when this test was written, and a change that adds launches, a mid-step sync or
// an allocation in the step fails on every machine. A change that lowers a figure should lower the
// budget with it (docs/gpu.md, "Budgets the emulator counts", lists the figures).
//
// Measured steps are logged steps (train.log_every=1), so what a logged step reads back counts.
// Attention is keel's own kernel (the emulator's default, as on a GPU without cuDNN).
//
// Grid coverage. A kernel that reduces over all of a step's token rows (a parameter gradient that
// sums B*T rows) covers B*T * width elements: at the 124M shapes (16 x 1024 tokens, widths >= 64)
// at least 10^6, so it must spread over at least as many blocks as an H200 has SMs (132) or most
// of the GPU idles while it runs. Its grid does not depend on this small config's token count if
// it is sized by the width alone, which is the defect: such a launch is held to 132 blocks here
// too. A kernel that breaks the rule is listed as a known defect, with the issue that fixes it,
// and the test checks the list is exact, so fixing one forces its removal; the list is empty
// since the norms' gain gradients and column_sum_add sum over row chunks (Note
// [fused-bias-grad] in framework/kernels/cuda/internal.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/exec_context.h"
#include "launch/train/trainer.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"
#include "tests/cuda_emu/counters.h"

namespace keel::kernels::cuda::cudnn {
// tests/cuda_emu/sdpa.cc: the emulated cuDNN's backward calls per algorithm asked for.
uint64_t emu_backward_calls(SdpaBackward algo);
}  // namespace keel::kernels::cuda::cudnn

namespace keel {
namespace {

namespace counters = keel_emu::counters;

constexpr uint64_t kH200Sms = 132;  // SMs of an H200 SXM (NVIDIA H200 datasheet)

struct Measured {
  counters::Snapshot first;     // the first step (its allocations are the step's working set)
  counters::Snapshot measured;  // the third step, after two warm-up steps
};

// d_model 128 in 2 heads of 64 (the head-shared QK-norm gain is 64 wide, as at the 124M shapes),
// T 64, B 16 (1024 tokens: kernels whose grid grows with the rows, such as the GELU bias
// gradient's row chunks, reach 132 blocks), byte vocabulary, `layers` blocks.
Measured measure_steps(int layers) {
  kernels::cuda::register_cuda_exec_factory();
  const config::KeelConfig cfg = load_config("", {"model.vocab_size=256",
                                                  "model.seq_len=64",
                                                  "model.d_model=128",
                                                  "model.n_heads=2",
                                                  "model.n_layers=" + std::to_string(layers),
                                                  "model.position=LEARNED",
                                                  "model.mlp=GELU",
                                                  "model.qk_norm=RMS",
                                                  "model.qk_norm_scope=HEAD_SHARED",
                                                  "model.norm=LAYERNORM",
                                                  "model.tie_embeddings=true",
                                                  "model.bias=true",
                                                  "train.global_batch=16",
                                                  "train.steps=10",
                                                  "train.log_every=1",
                                                  "train.eval_every=0",
                                                  "train.sample_chars=0",
                                                  "train.plot=false",
                                                  "train.tensorboard=false",
                                                  "data.builtin_bytes=60000",
                                                  "train.device=CUDA"});
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  TrainerOptions opts;
  opts.progress = false;
  Trainer trainer(cfg, topo, opts);
  Measured m;
  counters::reset();
  trainer.step();
  m.first = counters::snapshot();
  trainer.step();  // the second warm-up step
  counters::reset();
  trainer.step();
  m.measured = counters::snapshot();
  return m;
}

// Trains once per layer count per process; both tests read the same steps.
const Measured& measured(int layers) {
  static std::map<int, Measured> cache;
  auto it = cache.find(layers);
  if (it == cache.end()) it = cache.emplace(layers, measure_steps(layers)).first;
  return it->second;
}

void print(const char* what, const counters::Snapshot& s) {
  std::printf("%s: %llu launches, %llu syncs, %llu device allocations (%llu bytes), %llu pinned\n",
              what, static_cast<unsigned long long>(s.launches),
              static_cast<unsigned long long>(s.syncs),
              static_cast<unsigned long long>(s.device_allocations),
              static_cast<unsigned long long>(s.device_bytes),
              static_cast<unsigned long long>(s.pinned_allocations));
  for (const auto& [call, n] : s.syncs_by_call) {
    std::printf("  sync %-28s %llu\n", call.c_str(), static_cast<unsigned long long>(n));
  }
  for (const auto& [kernel, n] : s.launches_by_kernel) {
    std::printf("  launch %-32s %llu\n", kernel.c_str(), static_cast<unsigned long long>(n));
  }
}

class StepBudget : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(kernels::cuda::device_count(), 0) << "the emulator always has a device";
  }
};

TEST_F(StepBudget, NoDeviceAllocationAfterTheFirstStep) {
  const Measured& m = measured(2);
  print("first step", m.first);
  // Measured: 6 cudaMalloc in the first step (the caching allocator's working set) and 3
  // cudaMallocHost (two pinned upload slots, tokens and targets, and the pinned readback
  // buffer), none after.
  EXPECT_GT(m.first.device_allocations, 0u) << "the counter sees the first step's allocations";
  EXPECT_EQ(m.measured.device_allocations, 0u) << "a device allocation in the steady step";
  EXPECT_EQ(m.measured.pinned_allocations, 0u) << "a pinned allocation in the steady step";
}

TEST_F(StepBudget, LaunchesAndSyncsPerStep) {
  const Measured& one = measured(1);
  const Measured& two = measured(2);
  print("step, 1 layer", one.measured);
  print("step, 2 layers", two.measured);
  const uint64_t per_layer = two.measured.launches - one.measured.launches;
  const uint64_t outside = one.measured.launches - per_layer;
  std::printf("launches: %llu per layer, %llu outside the layers\n",
              static_cast<unsigned long long>(per_layer), static_cast<unsigned long long>(outside));
  // Measured (2026-12-03): 2 layers, 134 launches a step (27 cuBLASLt matmuls, 12 per
  // layer; 1 AdamW launch over the optimizer's 32 segments and 2 for the global gradient norm,
  // adamw_segments_kernel, sum_squares_segments_kernel and sum_partials_kernel; 17 final passes
  // over row-chunk partials, column_sum_partials_kernel, one per bias or norm gradient; the
  // embedding backward's second pass over its long runs' segments, embedding_runs_kernel); 56 per
  // layer, 22 outside (21 before the embedding backward summed runs in segments). 60 per layer
  // before the QKV and MLP activations went bf16 (Note [act-dtype]): attention's dq, dk, dv
  // widened in 3 launches and the QKV gradient staged for its GEMM in 1 (then 57: dv copied in 1);
  // 58 with GELU's pre-activation written by the up projection in bf16 (its bias rounded for the
  // epilogue, a launch of 4C elements); 56 with the QKV projection's output in bf16 (v no longer
  // staged in attention's forward and backward, dv written in place; +1 for the qkv bias).
  // Before the multi-tensor AdamW and norm: 234 a step (32 AdamW and 64 grad-norm launches, one
  // and two per parameter), 102 per layer, 30 outside. A margin of 2 lets a small change through; a
  // launch added per parameter or per layer does not pass.
  EXPECT_LE(two.measured.launches, 134u + 2u);
  EXPECT_LE(per_layer, 56u + 1u);
  // Measured (2026-12-03): 3 host waits a step, all cudaStreamSynchronize, each needed:
  // - the forward's statistics (GPT::forward, Note [forward stats] in layers/gpt.h): the loss's
  //   three sums and the layers' max attention logits in one read after the loss, inputs of the
  //   spike guard and the log; a step of one micro-batch has one forward;
  // - the global gradient norm (Trainer::grad_sum_squares): clipping and the guard's verdict
  //   need it on the host before the update (docs/gpu.md, "Host waits left as they are");
  // - the step's end (Trainer::step), so the step's time includes the update the device runs
  //   after the host moved on.
  // Before: 11 (6 cudaStreamSynchronize, 5 pageable copies): the token and target uploads were
  // synchronous pageable copies, each followed by a stream sync, and the three readbacks
  // pageable; then 4, the uploads through pinned staging without a wait (Note [pinned uploads]
  // in framework/kernels/cuda/device.h) and readbacks of up to 4 KiB through a pinned buffer,
  // the maxima still read mid-forward and the loss's sums after it; now 3, the two in one read.
  EXPECT_LE(two.measured.syncs, 3u);
  EXPECT_EQ(two.measured.syncs_by_call.count("pageable cudaMemcpyAsync"), 0u)
      << "a pageable copy in the step";
  EXPECT_EQ(one.measured.syncs, two.measured.syncs) << "host waits grow with the depth";
}

// Note [forward stats] in layers/gpt.h: a forward reads the device once, with or without targets
// and while recording the blocks' output norms (the spike replay's evidence), and a training
// forward given its loss weight (the fused loss gradient) too.
TEST_F(StepBudget, OneReadPerForward) {
  kernels::cuda::register_cuda_exec_factory();
  const config::KeelConfig cfg =
      load_config("", {"model.vocab_size=256", "model.seq_len=32", "model.d_model=64",
                       "model.n_heads=2", "model.n_layers=3", "train.device=CUDA"});
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  std::unique_ptr<kernels::ExecContext> exec = kernels::make_exec(Device::kCuda);
  const int64_t B = 2, T = 32;
  GPT model(cfg, topo, B, *exec);
  model.init(1234);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    tokens[i] = static_cast<int32_t>((7 * i + 3) % 256);
    targets[i] = static_cast<int32_t>((5 * i + 11) % 256);
  }
  const auto waits = [&](const std::function<LossStats()>& forward, LossStats* out) {
    counters::reset();
    *out = forward();
    return counters::snapshot().syncs;
  };
  LossStats plain, weighted, recorded, logits_only;
  EXPECT_EQ(waits([&] { return model.forward(tokens.data(), targets.data(), B); }, &plain), 1u);
  EXPECT_EQ(waits([&] { return model.forward(tokens.data(), targets.data(), B, 1.0f); }, &weighted),
            1u);
  model.backward(1.0f);
  model.set_record_activation_norms(true);
  EXPECT_EQ(waits([&] { return model.forward(tokens.data(), targets.data(), B); }, &recorded), 1u);
  EXPECT_EQ(waits([&] { return model.forward(tokens.data(), nullptr, B); }, &logits_only), 1u);
  model.set_record_activation_norms(false);
  // The same forward reports the same statistics, whichever parts it reads.
  ASSERT_EQ(plain.max_attn_logit_layers.size(), 3u);
  EXPECT_GT(plain.ce, 0.0);
  EXPECT_GT(plain.max_attn_logit, 0.0f);
  for (const LossStats* s : {&weighted, &recorded, &logits_only}) {
    EXPECT_EQ(s->max_attn_logit_layers, plain.max_attn_logit_layers);
    EXPECT_EQ(s->max_attn_logit, plain.max_attn_logit);
  }
  for (const LossStats* s : {&weighted, &recorded}) {
    EXPECT_EQ(s->ce, plain.ce);
    EXPECT_EQ(s->z_loss, plain.z_loss);
    EXPECT_EQ(s->log_z, plain.log_z);
  }
  EXPECT_TRUE(plain.act_sq_layers.empty());
  ASSERT_EQ(recorded.act_sq_layers.size(), 3u);
  for (double a : recorded.act_sq_layers) EXPECT_GT(a, 0.0);
  EXPECT_EQ(logits_only.act_sq_layers, recorded.act_sq_layers);
  EXPECT_EQ(logits_only.ce, 0.0) << "a forward without targets reports no loss";
}

// The kernels that reduce over all of a step's token rows into a parameter-sized gradient. Not
// column_sum_partials_kernel: the final pass of the row-chunked sums reads at most 512 chunks'
// partials per column, not the rows.
const std::set<std::string>& row_reductions() {
  static const std::set<std::string> names = {
      "norm_param_grads_kernel",    // norm.cu: LayerNorm and QK-norm gains and biases, row chunks
      "column_sum_add_kernel",      // column_sum.cu: linear layers' bias gradients, row chunks
      "gelu_backward_bias_kernel",  // elementwise.cu: partial sums over row chunks
      "glu_backward_bias_kernel",   // glu.cu: partial sums over row chunks
      "embedding_backward_kernel",  // embedding.cu: segments of 8-64 rows a thread
  };
  return names;
}

TEST_F(StepBudget, RowReductionsFillAnH200) {
  const counters::Snapshot& s = measured(2).measured;
  // Known defects: none. Fixed (issue 30 section 2): norm_param_grads_kernel ran on 2 blocks
  // (QK-norm gain, 64 wide) and 4 (LayerNorm, 128 wide), column_sum_add_kernel on 4 to 16
  // (C / 32), sized by the gradient's width. Measured now (2026-12-03): 256 blocks each
  // (norm_param_grads_kernel: 2 strips x 128 chunks, 4 x 64; column_sum_add_kernel: 4 x 64)
  // and 768 (column_sum_add_kernel, the 384-wide qkv bias: 12 x 64).
  const std::set<std::string> known_defects = {};
  std::set<std::string> violators;
  std::map<std::string, std::set<uint64_t>> grids;  // each row reduction's block counts
  int seen = 0;
  for (const counters::Launch& l : s.launch_list) {
    if (!row_reductions().count(l.kernel)) continue;
    ++seen;
    grids[l.kernel].insert(l.blocks);
    if (l.blocks < kH200Sms) {
      violators.insert(l.kernel);
      std::printf("  below %llu blocks: %s on %llu blocks of %llu threads\n",
                  static_cast<unsigned long long>(kH200Sms), l.kernel.c_str(),
                  static_cast<unsigned long long>(l.blocks),
                  static_cast<unsigned long long>(l.threads));
    }
  }
  for (const auto& [kernel, blocks] : grids) {
    std::printf("  %-28s blocks:", kernel.c_str());
    for (uint64_t b : blocks) std::printf(" %llu", static_cast<unsigned long long>(b));
    std::printf("\n");
  }
  EXPECT_GE(seen, 10) << "the step's row reductions were not seen: renamed kernels?";
  EXPECT_EQ(violators, known_defects)
      << "a row reduction now fills an H200 (remove it from known_defects) or a new one does not";
}

// train.deterministic reaches cuDNN's SDPA backward (framework/kernels/cuda/sdpa_cudnn.cc):
// through Trainer, ExecContext::set_determinism and the Context, whose algorithm the emulated
// cuDNN records per backward. BF16 with KEEL_CUDA_EMU_CUDNN=1 takes the cuDNN path.
void train_two_steps(bool deterministic) {
  kernels::cuda::register_cuda_exec_factory();
  const config::KeelConfig cfg = load_config(
      "", {"model.vocab_size=256", "model.seq_len=32", "model.d_model=128", "model.n_heads=2",
           "model.n_layers=1", "train.global_batch=2", "train.steps=2", "train.eval_every=0",
           "train.sample_chars=0", "train.plot=false", "train.tensorboard=false",
           "data.builtin_bytes=20000", "train.device=CUDA", "train.precision=BF16",
           std::string("train.deterministic=") + (deterministic ? "true" : "false"),
           "spike.replay=false", "spike.replay_every=0"});
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  TrainerOptions opts;
  opts.progress = false;
  Trainer trainer(cfg, topo, opts);
  trainer.step();
  trainer.step();
  EXPECT_EQ(trainer.exec().attention_path(), "cuDNN fused SDPA") << "the cuDNN path not taken";
}

TEST(CudnnBackward, TrainDeterministicReachesTheBackward) {
  using kernels::cuda::SdpaBackward;
  namespace cudnn = kernels::cuda::cudnn;
  ASSERT_EQ(setenv("KEEL_CUDA_EMU_CUDNN", "1", 1), 0);
  const uint64_t det0 = cudnn::emu_backward_calls(SdpaBackward::kDeterministic);
  const uint64_t fast0 = cudnn::emu_backward_calls(SdpaBackward::kFast);
  train_two_steps(true);  // the default
  const uint64_t det1 = cudnn::emu_backward_calls(SdpaBackward::kDeterministic);
  const uint64_t fast1 = cudnn::emu_backward_calls(SdpaBackward::kFast);
  EXPECT_EQ(det1 - det0, 2u) << "one layer, two steps: two deterministic backwards";
  EXPECT_EQ(fast1, fast0) << "train.deterministic=true ran cuDNN's fast backward";
  train_two_steps(false);
  EXPECT_EQ(cudnn::emu_backward_calls(SdpaBackward::kFast) - fast1, 2u)
      << "train.deterministic=false did not reach cuDNN's backward";
  EXPECT_EQ(cudnn::emu_backward_calls(SdpaBackward::kDeterministic), det1);
  unsetenv("KEEL_CUDA_EMU_CUDNN");
}

}  // namespace
}  // namespace keel
