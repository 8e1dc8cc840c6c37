// Device runs under TP and DP: the same tiny GPT trained for three steps twice in the same ranks,
// once with train.device=CPU and once with train.device=CUDA on the fake protected device of
// tests/fake_device.h (Device::kCuda memory the host cannot touch; its kernels are the CPU's, so
// a correct run equals the CPU run bit for bit). Under mpiexec the device run's tensor
// collectives (the layers' TP all-reduces and norm statistics, the TP-partial gradient
// all-reduce, DP GradSync buckets, ZeRO-1's reduce-scatter and all-gather) go through the
// Trainer's StagingCommunicators (Topology::tp_tensors / dp_tensors); a collective that handed
// MPI a device pointer, or any other host dereference of device memory, dies with SIGSEGV.
// Checked per case, on every rank:
//   - loss, z-loss, gradient norm and max attention logit of every step carry the CPU run's bits,
//     and so do the validation loss after the steps and (tp = 1) a sampled text;
//   - the final parameter and gradient arenas and AdamW's moments (ZeRO-1: this rank's shard of
//     them, and the reduce-scattered gradient shard) carry the CPU run's bits, and the device
//     run's arenas are the same on the DP replicas of one TP rank;
//   - the fake device ran the model (its ExecContext was called, the arenas are Device::kCuda)
//     and the CPU run never touched it;
//   - the device run's tensor communicators are StagingCommunicators that moved bytes over each
//     group of more than one rank, and the MPI groups beneath carried exactly the CPU run's bytes
//     and calls (the staged traffic plus the host scalars): nothing more, nothing bypassed.
// Layouts: TP1xDP1 through Distributed (np 1), TP2, DP2, DP2 with ZeRO-1 (np 2), TP2xDP2,
// TP2xDP2 with ZeRO-1, TP4 (twice), DP4 with ZeRO-1 (np 4); QK-norm modes vary (PROJECTION scope
// all-reduces norm statistics over TP; HEAD_SHARED gains and the shared L2 scale have TP-partial
// gradients), with Qwen3 and OLMo 2 blocks (RoPE, SwiGLU), RoPE + GEGLU with biases, gradient
// accumulation, untied embeddings and a binding clip mixed in; TP2 and TP2xDP2 with ZeRO-1 with
// bf16 on the TP wire (parallel.tp_comm_dtype=BF16: StagingCommunicator::all_reduce_bf16);
// TP2, TP4 (OLMo 2) and TP2xDP2 with ZeRO-1 with sequence parallelism (the staged all-gathers and
// reduce-scatters of token rows).
// Each case runs only where tp x dp equals the world size.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "framework/kernels/exec_context.h"
#include "framework/tensor.h"
#include "launch/train/trainer.h"
#include "layers/params.h"
#include "parallel/communicator.h"
#include "parallel/staging_communicator.h"
#include "parallel/topology.h"
#include "tests/fake_device.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::all_gather_world;
using testing::BlockKind;
using testing::FakeDeviceMemory;
using testing::fingerprint;
using testing::mpi_env;
using testing::QkMode;
using testing::ScopedFakeDevice;
using testing::tiny_config;
using testing::TinyJob;
using testing::world_size;

constexpr int kSteps = 3;
constexpr double kBindingClip = 0.05;

struct Case {
  int tp = 1, dp = 1;
  QkMode qk;
  int zero_stage = 0;
  int micro_batch = 0;  // 0: the whole per-rank batch (no accumulation)
  bool tied = true;
  double grad_clip = 1e9;
  BlockKind block{};       // the GPT-2 block unless set
  bool bf16_wire = false;  // parallel.tp_comm_dtype=BF16 (both runs)
  bool sp = false;         // parallel.sequence_parallel (both runs)

  std::string name() const {
    std::string s = "TP" + std::to_string(tp) + "xDP" + std::to_string(dp);
    if (zero_stage) s += "_ZeRO1";
    s += "_" + qk.name();
    if (micro_batch) s += "_mb" + std::to_string(micro_batch);
    if (!tied) s += "_untied";
    if (grad_clip < 1e8) s += "_clip";
    if (!block.tag.empty()) s += "_" + block.tag;
    if (bf16_wire) s += "_bf16_wire";
    if (sp) s += "_sp";
    return s;
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }  // for gtest's listings

std::vector<Case> cases() {
  std::vector<Case> out;
  // One process through Distributed (groups of one: no tensor communicators), accumulating.
  out.push_back({1, 1, {config::RMS, config::HEAD_SHARED}, 0, 4});
  // TP2: RMS over the whole projection all-reduces the norm statistics over TP.
  out.push_back({2, 1, {config::RMS, config::PROJECTION}});
  // DP2 with accumulation: GradSync's buckets launch during the last micro-batch's backward.
  out.push_back({1, 2, {config::LAYER, config::HEAD}, 0, 2, false});
  // DP2 with ZeRO-1 and L2 QK-norm with a scale per head.
  out.push_back({1, 2, {config::L2, config::HEAD}, 1});
  // TP2xDP2: L2's shared scale has a TP-partial gradient; the clip binds.
  out.push_back({2, 2, {config::L2, config::HEAD_SHARED}, 0, 0, false, kBindingClip});
  // TP2xDP2 with ZeRO-1: a Qwen3 block (RoPE, SwiGLU, no biases) whose shared RMS gains are
  // TP-partial, reduced before the reduce-scatter; accumulating.
  Case qwen{2, 2, {config::RMS, config::HEAD_SHARED}, 1, 2};
  qwen.block = testing::qwen3_block();
  out.push_back(qwen);
  // TP4: LayerNorm with biases over the whole projection (the last rank's vocabulary shard is
  // all padding); then an OLMo 2 block (RMSNorm after each sublayer, RoPE, SwiGLU), accumulating.
  out.push_back({4, 1, {config::LAYER, config::PROJECTION}});
  Case olmo{4, 1, {config::RMS, config::PROJECTION}, 0, 4, false};
  olmo.block = testing::olmo2_block();
  out.push_back(olmo);
  // DP4 with ZeRO-1: RoPE + GEGLU with biases, no QK-norm.
  Case geglu{1, 4, {config::NONE, config::HEAD_SHARED}, 1};
  geglu.block = testing::rope_geglu_bias_block();
  out.push_back(geglu);
  // bf16 on the TP wire (Note [bf16 wire]): the staged all-reduce rounds on the host as the CPU
  // run's does, so the runs still agree bit for bit. TP2, and TP2xDP2 with ZeRO-1.
  Case wire{2, 1, {config::RMS, config::HEAD_SHARED}, 0, 2};
  wire.bf16_wire = true;
  out.push_back(wire);
  Case wire22{2, 2, {config::RMS, config::PROJECTION}, 1};
  wire22.bf16_wire = true;
  out.push_back(wire22);
  // Sequence parallelism (Note [sequence parallel]): the all-gathers and reduce-scatters of token
  // rows and the norms' gradient all-reduces, staged. TP2 with accumulation, the OLMo 2 block at
  // TP4, and TP2xDP2 with ZeRO-1 and LayerNorm biases.
  Case sp2{2, 1, {config::RMS, config::HEAD_SHARED}, 0, 2};
  sp2.sp = true;
  out.push_back(sp2);
  Case sp_olmo{4, 1, {config::RMS, config::PROJECTION}, 0, 0, false};
  sp_olmo.block = testing::olmo2_block();
  sp_olmo.sp = true;
  out.push_back(sp_olmo);
  Case sp22{2, 2, {config::LAYER, config::HEAD_SHARED}, 1, 2};
  sp22.sp = true;
  out.push_back(sp22);
  return out;
}

std::vector<float> host_copy(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.numel() > 0) t.copy_to_host(0, t.numel(), out.data());
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Elements whose bits differ (for messages).
int64_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

struct Counters {
  int64_t bytes = 0, calls = 0;
};

Counters counters(const Communicator* c) {
  return c ? Counters{c->bytes_moved(), c->calls()} : Counters{};
}

// What one run leaves: the step results, host copies of its state, and the traffic it caused.
struct RunResult {
  std::vector<StepResult> steps;
  double val_loss = 0.0;
  std::string sample;  // tp = 1 only (sampling reads whole logit rows)
  std::vector<float> params, grads, m, v, shard_grads;
  Device params_device = Device::kCpu;
  // The Trainer's tensor communicators (null: the MPI groups themselves).
  bool tp_tensor_comm = false, dp_tensor_comm = false;
  bool tp_staging = false, dp_staging = false;
  Counters tp_tensors, dp_tensors;  // what they counted
  // What the MPI groups carried over the Trainer's whole life (construction included).
  Counters tp, dp, world;
  FakeDeviceMemory::Stats fake_before, fake_after;
};

Counters delta(const Counters& after, const Counters& before) {
  return {after.bytes - before.bytes, after.calls - before.calls};
}

// Collective: every rank trains the same case on `device` ("CPU" or "CUDA").
RunResult train(const Case& c, const Topology& topo, const std::string& device) {
  TinyJob job;
  job.tp = c.tp;
  job.zero_stage = c.zero_stage;
  job.micro_batch = c.micro_batch;
  job.qk = c.qk;
  job.tied = c.tied;
  job.grad_clip = c.grad_clip;
  job.block = c.block;
  config::KeelConfig cfg = tiny_config(job);
  cfg.mutable_train()->set_device(device);
  // The fake device runs the CPU's fp32 kernels (AUTO would pick BF16 for a GPU).
  cfg.mutable_train()->set_precision("FP32");
  cfg.mutable_train()->set_eval_batches(1);
  if (c.bf16_wire) cfg.mutable_parallel()->set_tp_comm_dtype("BF16");
  cfg.mutable_parallel()->set_sequence_parallel(c.sp);
  TrainerOptions opts;
  opts.progress = false;

  RunResult run;
  const Counters tp0 = counters(topo.tp_comm), dp0 = counters(topo.dp_comm),
                 world0 = counters(topo.world_comm);
  run.fake_before = FakeDeviceMemory::instance().stats();
  {
    Trainer trainer(cfg, topo, opts);
    for (int s = 0; s < kSteps; ++s) run.steps.push_back(trainer.step());
    run.val_loss = trainer.evaluate();  // collective
    if (c.tp == 1) run.sample = trainer.sample(24, 7);
    ParamStore& ps = trainer.model().params();
    run.params_device = ps.params().device();
    run.params = host_copy(ps.params());
    run.grads = host_copy(ps.grads());
    run.m = host_copy(trainer.optimizer().m());
    run.v = host_copy(trainer.optimizer().v());
    if (trainer.shard_grads().defined()) run.shard_grads = host_copy(trainer.shard_grads());
    const Topology& t = trainer.topology();
    run.tp_tensor_comm = t.tp_tensor_comm != nullptr;
    run.dp_tensor_comm = t.dp_tensor_comm != nullptr;
    run.tp_staging = dynamic_cast<const StagingCommunicator*>(t.tp_tensor_comm) != nullptr;
    run.dp_staging = dynamic_cast<const StagingCommunicator*>(t.dp_tensor_comm) != nullptr;
    run.tp_tensors = counters(t.tp_tensor_comm);
    run.dp_tensors = counters(t.dp_tensor_comm);
  }
  run.fake_after = FakeDeviceMemory::instance().stats();
  run.tp = delta(counters(topo.tp_comm), tp0);
  run.dp = delta(counters(topo.dp_comm), dp0);
  run.world = delta(counters(topo.world_comm), world0);
  return run;
}

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

class DeviceParallel : public ::testing::TestWithParam<Case> {};

TEST_P(DeviceParallel, FakeDeviceMatchesCpuBitwise) {
  const Case& c = GetParam();
  if (c.tp * c.dp != world_size()) {
    GTEST_SKIP() << c.name() << " needs " << c.tp * c.dp << " ranks, the world has "
                 << world_size();
  }
  Distributed dist(mpi_env(), c.tp, 60.0);
  const Topology& topo = dist.topology();
  ASSERT_EQ(topo.dp, c.dp);  // the same on every rank, so no rank is left in a collective

  const RunResult cpu = train(c, topo, "CPU");
  RunResult dev;
  {
    ScopedFakeDevice fake;
    dev = train(c, topo, "CUDA");
  }

  // Per step: the values every rank logs and decides on.
  ASSERT_EQ(cpu.steps.size(), dev.steps.size());
  for (size_t s = 0; s < cpu.steps.size(); ++s) {
    const StepResult& a = cpu.steps[s];
    const StepResult& b = dev.steps[s];
    EXPECT_TRUE(same_bits(b.loss, a.loss))
        << "step " << s + 1 << ": loss " << b.loss << " on the device vs " << a.loss << " on CPU";
    EXPECT_TRUE(same_bits(b.z_loss, a.z_loss))
        << "step " << s + 1 << ": z-loss " << b.z_loss << " vs " << a.z_loss;
    EXPECT_TRUE(same_bits(b.grad_norm, a.grad_norm))
        << "step " << s + 1 << ": gradient norm " << b.grad_norm << " vs " << a.grad_norm;
    EXPECT_TRUE(same_bits(b.max_attn_logit, a.max_attn_logit))
        << "step " << s + 1 << ": max attention logit " << b.max_attn_logit << " vs "
        << a.max_attn_logit;
    EXPECT_TRUE(same_bits(b.lr, a.lr)) << "step " << s + 1;
    if (c.grad_clip < 1e8) {
      EXPECT_GT(a.grad_norm, c.grad_clip) << "the clip must bind in this case";
    }
  }

  // Evaluation (a forward over TP and an all-reduce of the sums) and sampling (logit rows
  // copied to the host).
  EXPECT_TRUE(std::isfinite(cpu.val_loss));
  EXPECT_TRUE(same_bits(dev.val_loss, cpu.val_loss))
      << "validation loss " << dev.val_loss << " on the device vs " << cpu.val_loss;
  EXPECT_EQ(dev.sample, cpu.sample);
  if (c.tp == 1) {
    EXPECT_EQ(cpu.sample.size(), 16u + 24u);  // the 16-character prompt and 24 sampled
  }

  // The state the steps leave.
  EXPECT_FALSE(cpu.params.empty());
  EXPECT_TRUE(same_bits(dev.params, cpu.params))
      << differing(dev.params, cpu.params) << " of " << cpu.params.size()
      << " parameter arena elements differ from the CPU run's";
  EXPECT_TRUE(same_bits(dev.grads, cpu.grads))
      << differing(dev.grads, cpu.grads) << " gradient arena elements differ";
  EXPECT_TRUE(same_bits(dev.m, cpu.m)) << differing(dev.m, cpu.m) << " AdamW m elements differ";
  EXPECT_TRUE(same_bits(dev.v, cpu.v)) << differing(dev.v, cpu.v) << " AdamW v elements differ";
  const bool zero = c.zero_stage == 1 && c.dp > 1;
  if (zero) {
    // This rank's shard of the moments and of the reduce-scattered gradients.
    EXPECT_EQ(static_cast<int64_t>(dev.m.size()) * c.dp, static_cast<int64_t>(dev.params.size()));
    EXPECT_FALSE(cpu.shard_grads.empty());
    EXPECT_TRUE(same_bits(dev.shard_grads, cpu.shard_grads))
        << differing(dev.shard_grads, cpu.shard_grads) << " ZeRO gradient shard elements differ";
  } else {
    EXPECT_EQ(dev.m.size(), dev.params.size());
  }
  // The device run's arenas (ZeRO-1: all-gathered from the shards) match over DP replicas.
  const std::vector<uint64_t> arena_all =
      all_gather_world(fingerprint(dev.params.data(), dev.params.size() * sizeof(float)));
  for (int r = 0; r < world_size(); ++r) {
    EXPECT_EQ(arena_all[r], arena_all[r % c.tp])
        << "device-run parameters of rank " << r << " differ from its DP peer rank " << r % c.tp;
  }

  // The fake device ran the model, and only the device run touched it.
  EXPECT_EQ(cpu.params_device, Device::kCpu);
  EXPECT_EQ(dev.params_device, Device::kCuda);
  EXPECT_EQ(cpu.fake_after.exec_calls, cpu.fake_before.exec_calls);
  EXPECT_EQ(cpu.fake_after.allocations, cpu.fake_before.allocations);
  EXPECT_GT(dev.fake_after.exec_calls, dev.fake_before.exec_calls);
  EXPECT_GT(dev.fake_after.backend_calls, dev.fake_before.backend_calls);
  // Every device tensor of the run went back when the Trainer did.
  EXPECT_EQ(dev.fake_after.live_blocks, dev.fake_before.live_blocks);

  // Tensor communicators: none on the CPU or in a world of one; staged MPI on the device.
  EXPECT_FALSE(cpu.tp_tensor_comm);
  EXPECT_FALSE(cpu.dp_tensor_comm);
  const bool staged = world_size() > 1;
  EXPECT_EQ(dev.tp_staging, staged);
  EXPECT_EQ(dev.dp_staging, staged);
  if (staged) {
    // Groups of one move nothing; the others carry every step's tensors.
    EXPECT_EQ(dev.tp_tensors.bytes > 0, c.tp > 1) << dev.tp_tensors.bytes << " bytes over TP";
    EXPECT_EQ(dev.dp_tensors.bytes > 0, c.dp > 1) << dev.dp_tensors.bytes << " bytes over DP";
    EXPECT_LE(dev.tp_tensors.bytes, dev.tp.bytes);
    EXPECT_LE(dev.dp_tensors.bytes, dev.dp.bytes);
    EXPECT_LE(dev.tp_tensors.calls, dev.tp.calls);
    EXPECT_LE(dev.dp_tensors.calls, dev.dp.calls);
  }
  // The MPI groups carried the same traffic in both runs: staging changes where the tensors
  // live, not what is sent.
  EXPECT_EQ(dev.tp.bytes, cpu.tp.bytes) << "TP group bytes";
  EXPECT_EQ(dev.tp.calls, cpu.tp.calls) << "TP group collectives";
  EXPECT_EQ(dev.dp.bytes, cpu.dp.bytes) << "DP group bytes";
  EXPECT_EQ(dev.dp.calls, cpu.dp.calls) << "DP group collectives";
  EXPECT_EQ(dev.world.bytes, cpu.world.bytes) << "world bytes";
  EXPECT_EQ(dev.world.calls, cpu.world.calls) << "world collectives";
  EXPECT_EQ(cpu.tp.bytes > 0, c.tp > 1);
  EXPECT_EQ(cpu.dp.bytes > 0, c.dp > 1);

  if (mpi_env().world_rank() == 0) {
    std::printf(
        "[ %s ] bitwise equal; MPI bytes per run: TP %lld, DP %lld, world %lld; staged on the "
        "device: TP %lld, DP %lld; fake-device exec calls %lld\n",
        c.name().c_str(), static_cast<long long>(cpu.tp.bytes),
        static_cast<long long>(cpu.dp.bytes), static_cast<long long>(cpu.world.bytes),
        static_cast<long long>(dev.tp_tensors.bytes), static_cast<long long>(dev.dp_tensors.bytes),
        static_cast<long long>(dev.fake_after.exec_calls - dev.fake_before.exec_calls));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, DeviceParallel, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
}  // namespace keel
