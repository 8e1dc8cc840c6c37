// Device neutrality of the model and optimizer: a GPT and AdamW built on the fake protected device
// of tests/fake_device.h (Device::kCuda memory the host cannot touch; its ExecContext runs the
// CPU kernels) must compute exactly what the same model computes on the CPU. For a representative
// set of model variants (every QK-norm mode and scope, learned positions and RoPE, GELU and gated
// MLPs, pre- and post-sublayer norms, tied and untied heads, with and without biases): two
// micro-batches of forward (with targets) and accumulated backward, then two AdamW steps, and a
// forward without targets (inference, fewer sequences than the micro-batch). LossStats, logits,
// the whole gradient arena, AdamW's moments and the parameters are compared bit for bit. The same
// variants show that activation recomputation (train.recompute_layers) and the fused loss gradient
// change no bit of the gradients.
//
// Why this proves device neutrality: every host dereference of the fake model's memory (a layer
// reading a parameter, the loss reading a logit, the optimizer touching a moment outside an
// ExecContext call) dies with SIGSEGV, and every pointer the fake's ExecContext is handed must be
// fake-device memory (a host buffer given to a device kernel throws). So a run that completes and
// matches the CPU bitwise reached device memory only through the ExecContext and the backend's
// copies, as it must on a GPU. The test also asserts the fake was really used (its tensors are
// Device::kCuda, its exec ran kernels) and, as a positive control, that a host read of the fake
// model's parameters does die.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "framework/config/keel.pb.h"
#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "framework/optim/optimizer.h"
#include "framework/tensor.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"
#include "tests/fake_device.h"

namespace keel {
namespace {

using testing::FakeDeviceMemory;
using testing::ScopedFakeDevice;

// Death tests re-run this binary rather than fork a process that may hold OpenMP threads.
class ThreadsafeDeathTests : public ::testing::Environment {
 public:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new ThreadsafeDeathTests);

constexpr int64_t kB = 2;           // the micro-batch
constexpr int kMicroBatches = 2;    // accumulated into one optimizer step
constexpr int kOptimizerSteps = 2;  // AdamW's second step also reads the moments it wrote

struct Variant {
  const char* name;
  config::QkNorm qk = config::NONE;
  config::QkNormScope scope = config::HEAD_SHARED;
  config::Position position = config::LEARNED;
  config::MlpKind mlp = config::GELU;
  config::NormPlacement placement = config::PRE;
  config::NormKind norm = config::LAYERNORM;
  bool tied = true;
  bool bias = true;
};

// gtest prints a parameter by name rather than as bytes.
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

config::KeelConfig tiny_config(const Variant& v) {
  config::KeelConfig cfg;
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(64);
  m->set_seq_len(16);
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_d_ff(64);
  m->set_max_positions(0);
  m->set_init_std(0.1f);
  m->set_qk_norm(v.qk);
  m->set_qk_norm_scope(v.scope);
  m->set_position(v.position);
  m->set_rope_theta(100.0);
  m->set_mlp(v.mlp);
  m->set_norm_placement(v.placement);
  m->set_norm(v.norm);
  m->set_tie_embeddings(v.tied);
  m->set_bias(v.bias);
  cfg.mutable_loss()->set_z_loss(1e-2);
  config::Optim* o = cfg.mutable_optim();
  o->set_lr(1e-2f);
  o->set_weight_decay(0.1f);
  o->set_beta1(0.9f);
  o->set_beta2(0.95f);
  o->set_eps(1e-8f);
  return cfg;
}

// Every element of t as bytes on the host, through the backend's copy (any device).
std::vector<unsigned char> bytes_of(const Tensor& t) {
  std::vector<unsigned char> out(t.nbytes());
  if (t.numel() > 0) t.copy_to_host(0, t.numel(), out.data());
  return out;
}

// The same bytes; names the first differing float element otherwise.
void expect_same_floats(const Tensor& cpu, const Tensor& dev, const std::string& what) {
  ASSERT_EQ(cpu.dtype(), DType::kF32) << what;
  ASSERT_EQ(cpu.numel(), dev.numel()) << what;
  const std::vector<unsigned char> a = bytes_of(cpu), b = bytes_of(dev);
  if (std::memcmp(a.data(), b.data(), a.size()) == 0) return;
  for (size_t i = 0; i < a.size(); i += sizeof(float)) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      float x, y;
      std::memcpy(&x, &a[i], sizeof(float));
      std::memcpy(&y, &b[i], sizeof(float));
      ADD_FAILURE() << what << ": element " << i / sizeof(float) << " of " << cpu.numel()
                    << ": cpu " << x << ", fake device " << y;
      return;
    }
  }
}

void expect_same_stats(const LossStats& a, const LossStats& b, const std::string& what) {
  EXPECT_EQ(std::memcmp(&a.ce, &b.ce, sizeof(double)), 0)
      << what << ": ce " << a.ce << " vs " << b.ce;
  EXPECT_EQ(std::memcmp(&a.z_loss, &b.z_loss, sizeof(double)), 0)
      << what << ": z_loss " << a.z_loss << " vs " << b.z_loss;
  EXPECT_EQ(std::memcmp(&a.log_z, &b.log_z, sizeof(double)), 0)
      << what << ": log_z " << a.log_z << " vs " << b.log_z;
  EXPECT_EQ(std::memcmp(&a.max_attn_logit, &b.max_attn_logit, sizeof(float)), 0)
      << what << ": max_attn_logit " << a.max_attn_logit << " vs " << b.max_attn_logit;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t below, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(below - 1));
  std::vector<int32_t> v(n);
  for (int32_t& t : v) t = tok(rng);
  return v;
}

std::vector<ParamSegment> segments_of(ParamStore& ps) {
  std::vector<ParamSegment> segs;
  for (int id = 0; id < ps.size(); ++id) {
    segs.push_back({ps.info(id).offset, ps.info(id).numel(), ps.info(id).spec.decay});
  }
  return segs;
}

// One model with its optimizer on one execution context.
struct Side {
  Side(const config::KeelConfig& cfg, kernels::ExecContext& exec)
      : topo(Topology::single(tp, dp)),
        model(cfg, topo, kB, exec),
        opt(cfg.optim(), model.params().total_elems(), segments_of(model.params()), exec) {
    model.init(1234);
  }
  std::unique_ptr<Communicator> tp, dp;
  Topology topo;
  GPT model;
  AdamW opt;
};

class DeviceNeutral : public ::testing::TestWithParam<Variant> {};

TEST_P(DeviceNeutral, FakeDeviceMatchesTheCpuBitwise) {
  const config::KeelConfig cfg = tiny_config(GetParam());
  ScopedFakeDevice fake;
  const FakeDeviceMemory::Stats before = fake.memory().stats();
  std::unique_ptr<kernels::ExecContext> dev_exec = kernels::make_exec(Device::kCuda);
  ASSERT_EQ(dev_exec->device(), Device::kCuda);
  Side cpu(cfg, kernels::cpu_exec());
  Side dev(cfg, *dev_exec);

  // Where each side's tensors live: the comparison means nothing if both ran on the host.
  ParamStore &pc = cpu.model.params(), &pd = dev.model.params();
  EXPECT_EQ(pc.params().device(), Device::kCpu);
  EXPECT_EQ(pd.params().device(), Device::kCuda);
  EXPECT_EQ(pd.grads().device(), Device::kCuda);
  EXPECT_EQ(dev.opt.m().device(), Device::kCuda);
  EXPECT_EQ(dev.opt.v().device(), Device::kCuda);
  ASSERT_TRUE(fake.memory().is_device_range(pd.params().raw(), pd.params().nbytes()));
  ASSERT_EQ(pc.total_elems(), pd.total_elems());
  expect_same_floats(pc.params(), pd.params(), "initial parameters");

  const ModelDims& d = cpu.model.dims();
  for (int step = 0; step < kOptimizerSteps; ++step) {
    pc.zero_grads();
    pd.zero_grads();
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      const std::string where =
          "step " + std::to_string(step) + " micro-batch " + std::to_string(mb);
      const uint32_t seed = static_cast<uint32_t>(100 * step + mb);
      const std::vector<int32_t> tokens = random_tokens(kB * d.T, d.V, seed);
      const std::vector<int32_t> targets = random_tokens(kB * d.T, d.V, seed + 50);
      const LossStats sc = cpu.model.forward(tokens.data(), targets.data(), kB);
      const LossStats sd = dev.model.forward(tokens.data(), targets.data(), kB);
      EXPECT_GT(sc.z_loss, 0.0) << where;
      expect_same_stats(sc, sd, where);
      EXPECT_EQ(dev.model.logits().device(), Device::kCuda);
      expect_same_floats(cpu.model.logits(), dev.model.logits(), where + " logits");
      cpu.model.backward(1.0f / kMicroBatches);
      dev.model.backward(1.0f / kMicroBatches);
      expect_same_floats(pc.grads(), pd.grads(), where + " gradients");
    }
    // A clip factor below 1, as global-norm clipping would pass.
    cpu.opt.step(pc.params().f32(), pc.grads().f32(), 1e-2f, 0.75f);
    dev.opt.step(pd.params().f32(), pd.grads().f32(), 1e-2f, 0.75f);
    const std::string where = "after AdamW step " + std::to_string(step + 1);
    EXPECT_EQ(cpu.opt.t(), dev.opt.t());
    expect_same_floats(cpu.opt.m(), dev.opt.m(), where + ": m");
    expect_same_floats(cpu.opt.v(), dev.opt.v(), where + ": v");
    expect_same_floats(pc.params(), pd.params(), where + ": parameters");
  }
  // The steps moved the parameters (else equal parameters would prove little about AdamW).
  Side fresh(cfg, kernels::cpu_exec());
  EXPECT_NE(bytes_of(fresh.model.params().params()), bytes_of(pc.params()));

  // Inference: no targets, and fewer sequences than the micro-batch.
  const std::vector<int32_t> prompt = random_tokens(d.T, d.V, 999);
  const LossStats ic = cpu.model.forward(prompt.data(), nullptr, 1);
  const LossStats id = dev.model.forward(prompt.data(), nullptr, 1);
  EXPECT_EQ(std::memcmp(&ic.max_attn_logit, &id.max_attn_logit, sizeof(float)), 0)
      << ic.max_attn_logit << " vs " << id.max_attn_logit;
  // The first B=1 rows are this forward's; compare exactly those.
  const int64_t rows = d.T * d.Vl;
  std::vector<float> lc(rows), ld(rows);
  cpu.model.logits().copy_to_host(0, rows, lc.data());
  dev.model.logits().copy_to_host(0, rows, ld.data());
  EXPECT_EQ(std::memcmp(lc.data(), ld.data(), rows * sizeof(float)), 0) << "inference logits";

  const FakeDeviceMemory::Stats after = fake.memory().stats();
  EXPECT_GT(after.exec_calls, before.exec_calls) << "the fake's ExecContext ran no kernel";
  EXPECT_GT(after.backend_calls, before.backend_calls) << "no backend copy reached the fake";
  EXPECT_FALSE(fake.memory().unlocked()) << "the fake device was left unlocked";
}

// A forward told the loss weight computes the loss gradient in the loss's own pass
// (ExecContext::xent_fused): the same statistics and, after backward, the same gradients bit for
// bit as the separate forward and backward. backward must get the forward's weight.
TEST_P(DeviceNeutral, FusedLossGradientIsTheSeparateOnesBitwise) {
  const config::KeelConfig cfg = tiny_config(GetParam());
  Side separate(cfg, kernels::cpu_exec()), fused(cfg, kernels::cpu_exec());
  ParamStore &ps = separate.model.params(), &pf = fused.model.params();
  const ModelDims& d = separate.model.dims();
  ps.zero_grads();
  pf.zero_grads();
  const float weight = 1.0f / kMicroBatches;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    const std::string where = "micro-batch " + std::to_string(mb);
    const std::vector<int32_t> tokens = random_tokens(kB * d.T, d.V, 300 + mb);
    const std::vector<int32_t> targets = random_tokens(kB * d.T, d.V, 350 + mb);
    const LossStats a = separate.model.forward(tokens.data(), targets.data(), kB);
    const LossStats b = fused.model.forward(tokens.data(), targets.data(), kB, weight);
    expect_same_stats(a, b, where);
    separate.model.backward(weight);
    fused.model.backward(weight);
    expect_same_floats(ps.grads(), pf.grads(), where + " gradients");
  }
  const std::vector<int32_t> tokens = random_tokens(kB * d.T, d.V, 400);
  fused.model.forward(tokens.data(), tokens.data(), kB, weight);
  try {
    fused.model.backward(2.0f * weight);
    ADD_FAILURE() << "backward took another weight than the fused forward's";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("differs from the forward's"), std::string::npos)
        << e.what();
  }
}

// Note [recompute] (layers/gpt.h): with train.recompute_layers = N the first N of 3 blocks share
// one set of saved activations and backward recomputes blocks 0 ... N-2 from their inputs. The
// losses, logits and accumulated gradients equal those of the model that keeps everything, bit
// for bit, on the CPU and on the fake device (N = 3; the forward given the loss weight, as the
// trainer calls it), and N = 2 leaves the last block its own activations. Without the recompute
// the shared set would hold block N-1's activations and the gradients would differ.
TEST_P(DeviceNeutral, RecomputedActivationsGiveTheSameGradientsBitwise) {
  config::KeelConfig cfg = tiny_config(GetParam());
  cfg.mutable_model()->set_n_layers(3);
  ScopedFakeDevice fake;
  std::unique_ptr<kernels::ExecContext> dev_exec = kernels::make_exec(Device::kCuda);
  Side keep(cfg, kernels::cpu_exec());
  config::KeelConfig two = cfg, all = cfg;
  two.mutable_train()->set_recompute_layers(2);
  all.mutable_train()->set_recompute_layers(3);
  Side partial(two, kernels::cpu_exec()), full(all, kernels::cpu_exec());
  size_t bytes = fake.memory().stats().live_bytes;
  Side dev_keep(cfg, *dev_exec);
  const size_t keep_bytes = fake.memory().stats().live_bytes - bytes;
  bytes = fake.memory().stats().live_bytes;
  Side dev_full(all, *dev_exec);
  const size_t full_bytes = fake.memory().stats().live_bytes - bytes;
  EXPECT_LT(full_bytes, keep_bytes) << "recomputation saved no device memory";
  Side* sides[] = {&keep, &partial, &full, &dev_keep, &dev_full};
  const char* names[] = {"keep", "recompute 2", "recompute 3", "fake device", "fake recompute 3"};
  const ModelDims& d = keep.model.dims();
  const float weight = 1.0f / kMicroBatches;
  for (Side* s : sides) s->model.params().zero_grads();
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    const std::vector<int32_t> tokens = random_tokens(kB * d.T, d.V, 500 + mb);
    const std::vector<int32_t> targets = random_tokens(kB * d.T, d.V, 550 + mb);
    const LossStats want = keep.model.forward(tokens.data(), targets.data(), kB);
    const Tensor want_logits = keep.model.logits().to(Device::kCpu);
    keep.model.backward(weight);
    int64_t keep_calls = 0;
    for (size_t i = 1; i < std::size(sides); ++i) {
      const std::string where = std::string(names[i]) + ", micro-batch " + std::to_string(mb);
      GPT& m = sides[i]->model;
      const bool fused = i == 2 || i == 4;  // as the trainer calls it: the loss gradient fused
      const LossStats got = fused ? m.forward(tokens.data(), targets.data(), kB, weight)
                                  : m.forward(tokens.data(), targets.data(), kB);
      expect_same_stats(want, got, where);
      if (!fused) expect_same_floats(want_logits, m.logits(), where + " logits");
      const int64_t calls = fake.memory().stats().exec_calls;
      m.backward(weight);
      if (i == 3) keep_calls = fake.memory().stats().exec_calls - calls;
      if (i == 4) {
        EXPECT_GT(fake.memory().stats().exec_calls - calls, keep_calls)
            << where << ": backward ran no recomputation";
      }
      expect_same_floats(keep.model.params().grads(), m.params().grads(), where + " gradients");
    }
  }
}

std::string variant_name(const ::testing::TestParamInfo<Variant>& info) { return info.param.name; }

constexpr config::Position kRope = config::ROPE;
constexpr config::NormPlacement kPost = config::POST_SUBLAYER;
INSTANTIATE_TEST_SUITE_P(
    Variants, DeviceNeutral,
    ::testing::Values(
        // GPT-2: learned positions, GELU, LayerNorm before each sublayer, tied, biases.
        Variant{.name = "gpt2"},
        Variant{.name = "rms_head_rope_swiglu_nobias",
                .qk = config::RMS,
                .scope = config::HEAD,
                .position = kRope,
                .mlp = config::SWIGLU,
                .norm = config::RMSNORM,
                .tied = false,
                .bias = false},
        Variant{.name = "layer_projection_post",
                .qk = config::LAYER,
                .scope = config::PROJECTION,
                .placement = kPost},
        Variant{.name = "layer_head_nobias_untied",
                .qk = config::LAYER,
                .scope = config::HEAD,
                .tied = false,
                .bias = false},
        Variant{.name = "l2_head_shared_rope_geglu",
                .qk = config::L2,
                .position = kRope,
                .mlp = config::GEGLU},
        Variant{.name = "l2_projection_post_untied",
                .qk = config::L2,
                .scope = config::PROJECTION,
                .placement = kPost,
                .tied = false},
        Variant{.name = "l2_head_swiglu",
                .qk = config::L2,
                .scope = config::HEAD,
                .mlp = config::SWIGLU},
        // OLMo 2: RMSNorm after each sublayer, RMS QK-norm over the projection, RoPE, SwiGLU, no
        // biases, untied head.
        Variant{.name = "olmo2",
                .qk = config::RMS,
                .scope = config::PROJECTION,
                .position = kRope,
                .mlp = config::SWIGLU,
                .placement = kPost,
                .norm = config::RMSNORM,
                .tied = false,
                .bias = false},
        // Gemma 3: RMSNorm before and after each sublayer (Note [sandwich norms]), RoPE, GeGLU.
        Variant{.name = "gemma3_sandwich",
                .qk = config::RMS,
                .position = kRope,
                .mlp = config::GEGLU,
                .placement = config::SANDWICH,
                .norm = config::RMSNORM,
                .bias = false},
        // Qwen3: pre-norm RMSNorm, per-head RMS QK-norm with one shared gain, RoPE, SwiGLU.
        Variant{.name = "qwen3",
                .qk = config::RMS,
                .position = kRope,
                .mlp = config::SWIGLU,
                .norm = config::RMSNORM,
                .tied = false,
                .bias = false}),
    variant_name);

// In a death test's child: no core file for the expected SIGSEGV.
void no_core_dump() {
  const rlimit none{0, 0};
  setrlimit(RLIMIT_CORE, &none);
}

// Positive control: the fake model's parameters really are unreadable from the host, so the
// comparison above could not have passed had a layer or the optimizer read them directly.
TEST(DeviceNeutralControl, AHostReadOfTheFakeModelsParametersDies) {
  EXPECT_EXIT(
      {
        no_core_dump();
        ScopedFakeDevice fake;
        std::unique_ptr<kernels::ExecContext> exec = kernels::make_exec(Device::kCuda);
        Side dev(tiny_config(Variant{.name = "gpt2"}), *exec);
        volatile float first = dev.model.params().params().f32()[0];
        (void)first;
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
}  // namespace keel
