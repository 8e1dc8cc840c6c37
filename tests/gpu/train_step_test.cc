// Whole training on the GPU against the CPU: one GPT training step (forward, backward, AdamW) on
// CudaExec against the same model on cpu_exec() with the same seed and batch, for several model
// shapes (grouped-query and multi-query attention among them); 200 steps of the default job through
// the in-process Trainer on both devices, ending at the same validation loss within 2%; and
// checkpoints moved between the devices (a GPU checkpoint resumed on the CPU and a CPU one resumed
// on the GPU), loaded bit for bit and continued to the losses of an uninterrupted run on the other
// device. Without a GPU every test skips.
//
// Bounds. Except in the default job's run at the default precision (BF16 matrix products on a
// GPU, held to the same 2%), the GPU path here is fp32 (train.precision=FP32, and cuda::Context's
// fp32 GEMMs are exact fp32 by default, asserted below), so the two devices differ only in the
// order of fp32 sums: the loss's three terms (ce, z_loss, log_z: means over B T rows of per-row
// sums in fp32, finished in double) and the largest attention logit within 1e-5 relative; the whole
// gradient arena within 1e-4 in relative norm (||g_gpu - g_cpu|| / ||g_cpu||; per element, entries
// that cancel to near zero carry more relative error, so none is asserted element-wise). AdamW's
// first step moves each parameter by lr (mhat / (sqrt(vhat) + eps) + wd p) with mhat / sqrt(vhat) =
// sign(g) for |g| >> eps: a sign that differs between the devices (an element whose gradient is
// within rounding of zero) moves it by up to 2 lr. So each parameter after the step must match
// the CPU's within what its two gradients explain, lr |u(g_gpu) - u(g_cpu)| (u as AdamW computes
// it, in double), plus fp32 rounding 1e-6 |p| + 1e-5 lr; and the GPU's update must equal the CPU
// optimizer applied to the GPU's own gradients within fp32 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "framework/config/config.h"
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/gemm.h"
#include "framework/optim/optimizer.h"
#include "framework/tensor.h"
#include "launch/train/trainer.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/test_util.h"

namespace keel::gpu_test {
namespace {

using keel::testing::TempDir;

class TrainStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
    }
    // What keel-train does at start-up, so train.device=CUDA finds the GPU.
    cuda::register_cuda_exec_factory();
  }
};

std::vector<float> to_host(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.copy_to_host(0, t.numel(), v.data());
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ||a - ref|| / ||ref|| in double.
double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    diff += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(diff / norm);
}

double norm2(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

double rel(double a, double ref) { return std::abs(a - ref) / std::abs(ref); }

// ---- one step of the model ----

struct Variant {
  const char* name;
  std::vector<std::string> sets;
};

// d_model 128, 4 heads, T 64, B 4, byte vocabulary; z-loss on, so its term and gradient count.
config::KeelConfig step_config(const Variant& v) {
  std::vector<std::string> sets = {"model.vocab_size=256", "model.seq_len=64",
                                   "model.d_model=128",    "model.n_heads=4",
                                   "train.global_batch=4", "loss.z_loss=1e-4"};
  sets.insert(sets.end(), v.sets.begin(), v.sets.end());
  return load_config("", sets);
}

// u = mhat / (sqrt(vhat) + eps) of AdamW's first step (t = 1, zero moments) for gradient g scaled
// by s, in double: the bias corrections cancel the (1 - beta) factors.
double first_adam_direction(double g, double s, double eps) {
  const double gs = g * s;
  return gs / (std::abs(gs) + eps);
}

TEST_F(TrainStepTest, OneTrainingStepMatchesTheCpu) {
  const std::vector<Variant> variants = {
      {"GPT-2 shape: LEARNED + GELU, qk_norm RMS (head-shared), LayerNorm, tied, 2 layers",
       {"model.n_layers=2", "model.position=LEARNED", "model.mlp=GELU", "model.qk_norm=RMS",
        "model.qk_norm_scope=HEAD_SHARED", "model.norm=LAYERNORM"}},
      {"ROPE + SWIGLU, qk_norm L2, RMSNorm, untied, no bias, 4 layers",
       {"model.n_layers=4", "model.position=ROPE", "model.mlp=SWIGLU", "model.qk_norm=L2",
        "model.norm=RMSNORM", "model.tie_embeddings=false", "model.bias=false"}},
      {"OLMo 2 shape: ROPE + SWIGLU, qk_norm RMS (projection), post-sublayer norms, 3 layers",
       {"model.n_layers=3", "model.position=ROPE", "model.mlp=SWIGLU", "model.qk_norm=RMS",
        "model.qk_norm_scope=PROJECTION", "model.norm=RMSNORM",
        "model.norm_placement=POST_SUBLAYER", "model.tie_embeddings=false", "model.bias=false"}},
      {"LEARNED + GEGLU, no qk_norm, 2 layers",
       {"model.n_layers=2", "model.position=LEARNED", "model.mlp=GEGLU", "model.qk_norm=NONE"}},
      // Grouped-query and multi-query attention (Note [gqa layouts] in layers/attention.h): the
      // CUDA kernels' k/v head sharing and the dk, dv sums over each group; with a head_dim
      // apart from d_model / n_heads (4 x 48 = 192 != 128).
      {"grouped-query: 4 heads of 48 on 2 k/v heads, ROPE + SWIGLU, qk_norm L2 (per head), 2 "
       "layers",
       {"model.n_layers=2", "model.n_kv_heads=2", "model.head_dim=48", "model.position=ROPE",
        "model.mlp=SWIGLU", "model.qk_norm=L2", "model.qk_norm_scope=HEAD", "model.norm=RMSNORM",
        "model.bias=false"}},
      {"multi-query: 4 heads on 1 k/v head, LEARNED + GELU, no qk_norm, 2 layers",
       {"model.n_layers=2", "model.n_kv_heads=1", "model.position=LEARNED", "model.mlp=GELU",
        "model.qk_norm=NONE"}},
  };
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    const config::KeelConfig cfg = step_config(variant);
    const int64_t B = 4, T = cfg.model().seq_len(), V = cfg.model().vocab_size();
    std::unique_ptr<Communicator> tp, dp;
    const Topology topo = Topology::single(tp, dp);

    // Declared before the models and optimizers, so it outlives their device tensors.
    cuda::CudaExec gexec(0);
    ASSERT_EQ(gexec.context().fp32_matmul(), cuda::Fp32Matmul::kExact)
        << "the bounds assume exact fp32 GEMMs, cuda::Context's default";
    gexec.set_precision(kernels::Precision::kFp32);
    kernels::ExecContext& cexec = kernels::cpu_exec();

    GPT cpu(cfg, topo, B, cexec), gpu(cfg, topo, B, gexec);
    cpu.init(cfg.train().seed());
    gpu.init(cfg.train().seed());
    ParamStore& pc = cpu.params();
    ParamStore& pg = gpu.params();
    ASSERT_EQ(pc.total_elems(), pg.total_elems());
    const std::vector<float> p0 = to_host(pc.params());
    // Init draws on the host (Philox) and copies: the GPU starts from the CPU's bits.
    ASSERT_TRUE(same_bits(to_host(pg.params()), p0));

    // B sequences of T + 1 random tokens: inputs and next-token targets.
    std::mt19937 gen(1234);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V - 1));
    std::vector<int32_t> tokens(B * T), targets(B * T);
    for (int64_t b = 0; b < B; ++b) {
      int32_t prev = tok(gen);
      for (int64_t t = 0; t < T; ++t) {
        const int32_t next = tok(gen);
        tokens[b * T + t] = prev;
        targets[b * T + t] = next;
        prev = next;
      }
    }

    const LossStats lc = cpu.forward(tokens.data(), targets.data(), B);
    const LossStats lg = gpu.forward(tokens.data(), targets.data(), B);
    std::printf(
        "%s\n  ce %.9g vs %.9g (rel %.2e), z_loss rel %.2e, log_z rel %.2e, "
        "max_attn_logit %.7g vs %.7g (rel %.2e)\n",
        variant.name, lg.ce, lc.ce, rel(lg.ce, lc.ce), rel(lg.z_loss, lc.z_loss),
        rel(lg.log_z, lc.log_z), lg.max_attn_logit, lc.max_attn_logit,
        rel(lg.max_attn_logit, lc.max_attn_logit));
    EXPECT_TRUE(std::isfinite(lc.ce) && lc.ce > 0 && lc.z_loss > 0 && lc.max_attn_logit > 0);
    EXPECT_NEAR(lg.ce, lc.ce, 1e-5 * std::abs(lc.ce));
    EXPECT_NEAR(lg.z_loss, lc.z_loss, 1e-5 * std::abs(lc.z_loss));
    EXPECT_NEAR(lg.log_z, lc.log_z, 1e-5 * std::abs(lc.log_z));
    EXPECT_NEAR(lg.max_attn_logit, lc.max_attn_logit, 1e-5 * std::abs(lc.max_attn_logit));

    cpu.backward(1.0f);
    gpu.backward(1.0f);
    const std::vector<float> gc = to_host(pc.grads()), gg = to_host(pg.grads());
    const double grad_err = rel_norm_diff(gg, gc);
    // The worst parameter tensor, for the log (element groups that cancel can be worse than the
    // arena as a whole, so only the arena is asserted).
    double worst = 0.0;
    std::string worst_name;
    for (int id = 0; id < pc.size(); ++id) {
      const ParamInfo& info = pc.info(id);
      const auto first = static_cast<size_t>(info.offset);
      const auto n = static_cast<size_t>(info.numel());
      const std::vector<float> a(gg.begin() + first, gg.begin() + first + n);
      const std::vector<float> r(gc.begin() + first, gc.begin() + first + n);
      if (norm2(r) == 0.0) continue;
      const double e = rel_norm_diff(a, r);
      if (e > worst) worst = e, worst_name = info.spec.name;
    }
    std::printf("  gradient arena: ||g_gpu - g_cpu|| / ||g_cpu|| = %.2e (worst tensor %s: %.2e)\n",
                grad_err, worst_name.c_str(), worst);
    EXPECT_GT(norm2(gc), 0.0);
    EXPECT_LT(grad_err, 1e-4);

    // One AdamW step on each device, as the trainer takes it: the global norm's clip scale, then
    // the update of every parameter segment (decay per the segment).
    std::vector<ParamSegment> segs;
    for (int id = 0; id < pc.size(); ++id) {
      segs.push_back({pc.info(id).offset, pc.info(id).numel(), pc.info(id).spec.decay});
    }
    const config::Optim& oc = cfg.optim();
    const float lr = oc.lr();
    const float scale_c = clip_scale(norm2(gc), oc.grad_clip());
    const float scale_g = clip_scale(norm2(gg), oc.grad_clip());
    AdamW opt_c(oc, pc.total_elems(), segs, cexec), opt_g(oc, pg.total_elems(), segs, gexec);
    opt_c.step(pc.params().f32(), pc.grads().f32(), lr, scale_c);
    opt_g.step(pg.params().f32(), pg.grads().f32(), lr, scale_g);
    const std::vector<float> p1c = to_host(pc.params()), p1g = to_host(pg.params());

    // The GPU optimizer against the CPU one on the GPU's gradients: the same arithmetic.
    {
      Tensor p = Tensor::zeros({pc.total_elems()});
      Tensor g = Tensor::zeros({pc.total_elems()});
      p.copy_from_host(0, p.numel(), p0.data());
      g.copy_from_host(0, g.numel(), gg.data());
      AdamW opt_ref(oc, pc.total_elems(), segs, cexec);
      opt_ref.step(p.f32(), g.f32(), lr, scale_g);
      EXPECT_TRUE(matches(p1g, to_host(p), 1e-6)) << "AdamW on the GPU vs on the CPU, same grads";
    }

    // The whole step: each parameter within what its two gradients explain.
    std::vector<char> in_segment(p0.size(), 0);
    for (const ParamSegment& s : segs) std::fill_n(in_segment.begin() + s.offset, s.n, 1);
    int64_t bad = 0, flips = 0;
    std::string first_bad;
    for (size_t i = 0; i < p0.size(); ++i) {
      if (!in_segment[i]) continue;  // arena padding: no segment, never updated
      const double ug = first_adam_direction(gg[i], scale_g, oc.eps());
      const double uc = first_adam_direction(gc[i], scale_c, oc.eps());
      flips += (ug > 0) != (uc > 0);
      const double bound = lr * std::abs(ug - uc) + 1e-6 * std::abs(p0[i]) + 1e-5 * lr;
      if (!(std::abs(static_cast<double>(p1g[i]) - p1c[i]) <= bound)) {
        if (bad++ == 0) {
          char line[160];
          std::snprintf(line, sizeof(line), "[%zu] gpu %.9g cpu %.9g bound %.3g", i, p1g[i], p1c[i],
                        bound);
          first_bad = line;
        }
      }
    }
    std::printf(
        "  after AdamW: %lld of %zu updates differ in sign (gradients within rounding of "
        "zero)\n",
        static_cast<long long>(flips), p0.size());
    EXPECT_EQ(bad, 0) << "parameters after one step outside the bound; first " << first_bad;
    EXPECT_FALSE(same_bits(p1c, p0)) << "the step did not move the parameters";
  }
}

// A head_dim keel's fused attention does not take (136 > 128) runs only where cuDNN takes it
// (bf16): in FP32 the model is refused when it is built, and in BF16 without a cuDNN that takes the
// shape (the emulator's stops at 128) at the first forward, each with one kConfig error naming
// model.head_dim, not the kernel's internal limit. With a cuDNN that takes it, the step runs on
// cuDNN's attention.
TEST_F(TrainStepTest, HeadDimNoAttentionTakesIsRefusedNamingTheField) {
  const Variant variant{"head_dim 136",
                        {"model.n_layers=1", "model.seq_len=32", "model.n_kv_heads=2",
                         "model.head_dim=136", "model.qk_norm=NONE"}};
  const config::KeelConfig cfg = step_config(variant);
  const int64_t B = 2, T = cfg.model().seq_len();
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  auto expect_head_dim_error = [](const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.head_dim=136"), std::string::npos) << e.what();
  };
  {
    cuda::CudaExec gexec(0);
    gexec.set_precision(kernels::Precision::kFp32);
    try {
      GPT gpu(cfg, topo, B, gexec);
      ADD_FAILURE() << "FP32 built a model with head_dim 136";
    } catch (const Error& e) {
      expect_head_dim_error(e);
    }
  }
  cuda::CudaExec gexec(0);
  gexec.set_precision(kernels::Precision::kBf16);
  GPT gpu(cfg, topo, B, gexec);
  gpu.init(cfg.train().seed());
  std::vector<int32_t> tokens(B * T, 7), targets(B * T, 8);
  try {
    const LossStats l = gpu.forward(tokens.data(), targets.data(), B);
    EXPECT_TRUE(std::isfinite(l.ce));
    EXPECT_EQ(gexec.attention_path(), "cuDNN fused SDPA");
  } catch (const Error& e) {
    expect_head_dim_error(e);
  }
}

// Note [recompute] (layers/gpt.h) on the GPU at its default precision (BF16: bf16 activations,
// the fused attention's log-sum-exp, the fused loss gradient): a model that recomputes its blocks'
// activations in backward (train.recompute_layers = n_layers, and fewer) gives the losses and
// the accumulated gradients of the model that keeps them all, bit for bit (every GPU kernel keel
// runs, attention's backward included, is deterministic), with less device memory.
TEST_F(TrainStepTest, RecomputationChangesNoBit) {
  const std::vector<Variant> variants = {
      {"GPT-2 shape, 3 layers, all recomputed",
       {"model.n_layers=3", "model.seq_len=32", "model.qk_norm=RMS", "train.recompute_layers=3"}},
      {"OLMo 2 shape, 3 layers, the first 2 recomputed",
       {"model.n_layers=3", "model.seq_len=32", "model.position=ROPE", "model.mlp=SWIGLU",
        "model.qk_norm=RMS", "model.qk_norm_scope=PROJECTION", "model.norm=RMSNORM",
        "model.norm_placement=POST_SUBLAYER", "model.tie_embeddings=false", "model.bias=false",
        "train.recompute_layers=2"}},
      // Grouped-query attention in BF16: bf16 QK-normalised k of Hkv heads read in place, with a
      // head_dim apart from d_model / n_heads (4 x 40 = 160 != 128).
      {"grouped-query, 4 heads of 40 on 2 k/v heads, ROPE, 2 layers, all recomputed",
       {"model.n_layers=2", "model.seq_len=32", "model.n_kv_heads=2", "model.head_dim=40",
        "model.position=ROPE", "model.qk_norm=RMS", "model.qk_norm_scope=HEAD",
        "train.recompute_layers=2"}},
  };
  for (const Variant& variant : variants) {
    SCOPED_TRACE(variant.name);
    const config::KeelConfig cfg = step_config(variant);
    config::KeelConfig keep_cfg = cfg;
    keep_cfg.mutable_train()->set_recompute_layers(0);
    const int64_t B = 4, T = cfg.model().seq_len(), V = cfg.model().vocab_size();
    std::unique_ptr<Communicator> tp, dp;
    const Topology topo = Topology::single(tp, dp);
    cuda::CudaExec gexec(0);
    gexec.set_precision(kernels::Precision::kBf16);
    auto in_use = [&] { return gexec.context().allocator().stats().bytes_in_use; };
    const int64_t before = in_use();
    GPT keep(keep_cfg, topo, B, gexec);
    const int64_t keep_bytes = in_use() - before;
    GPT rec(cfg, topo, B, gexec);
    const int64_t rec_bytes = in_use() - before - keep_bytes;
    EXPECT_LT(rec_bytes, keep_bytes) << "recomputation saved no device memory";
    keep.init(cfg.train().seed());
    rec.init(cfg.train().seed());
    keep.params().zero_grads();
    rec.params().zero_grads();
    std::mt19937 gen(99);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(V - 1));
    for (int mb = 0; mb < 2; ++mb) {  // two micro-batches accumulate, as in a step
      std::vector<int32_t> tokens(B * T), targets(B * T);
      for (int32_t& t : tokens) t = tok(gen);
      for (int32_t& t : targets) t = tok(gen);
      const LossStats a = keep.forward(tokens.data(), targets.data(), B, 0.5f);
      const LossStats b = rec.forward(tokens.data(), targets.data(), B, 0.5f);
      EXPECT_EQ(a.ce, b.ce) << "micro-batch " << mb;
      EXPECT_EQ(a.z_loss, b.z_loss) << "micro-batch " << mb;
      EXPECT_EQ(a.max_attn_logit, b.max_attn_logit) << "micro-batch " << mb;
      keep.backward(0.5f);
      rec.backward(0.5f);
      const std::vector<float> ga = to_host(keep.params().grads());
      const std::vector<float> gb = to_host(rec.params().grads());
      EXPECT_GT(norm2(ga), 0.0);
      EXPECT_TRUE(same_bits(ga, gb))
          << "micro-batch " << mb << ": gradients differ, relative " << rel_norm_diff(gb, ga);
    }
    std::printf("%s: model on the device %lld bytes, recomputing %lld bytes\n", variant.name,
                static_cast<long long>(keep_bytes), static_cast<long long>(rec_bytes));
  }
}

// ---- the Trainer on each device ----

// A Trainer with its own single-process topology (the Trainer copies it; its communicators stay
// owned here).
class TrainerRun {
 public:
  explicit TrainerRun(const config::KeelConfig& cfg, std::string run_dir = "",
                      std::function<int()> stop_signal = {})
      : topo_(Topology::single(tp_, dp_)) {
    TrainerOptions opts;
    opts.run_dir = std::move(run_dir);
    opts.stop_signal = std::move(stop_signal);
    opts.progress = false;
    trainer_ = std::make_unique<Trainer>(cfg, topo_, opts);
  }
  Trainer* operator->() { return trainer_.get(); }

  std::vector<float> params() { return to_host(trainer_->model().params().params()); }
  std::vector<float> m() { return to_host(trainer_->optimizer().m()); }
  std::vector<float> v() { return to_host(trainer_->optimizer().v()); }

 private:
  std::unique_ptr<Communicator> tp_, dp_;
  Topology topo_;
  std::unique_ptr<Trainer> trainer_;
};

// The CPU kernels' threads while it lives (the GPU machine's cores), restored after.
class CpuThreads {
 public:
  explicit CpuThreads(int n) : before_(kernels::num_threads()) { kernels::set_num_threads(n); }
  ~CpuThreads() { kernels::set_num_threads(before_); }
  CpuThreads(const CpuThreads&) = delete;
  CpuThreads& operator=(const CpuThreads&) = delete;

 private:
  int before_;
};

int hardware_threads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// launch/configs/default.pbtxt: under the source tree this binary was built from, or under the
// working directory (tests/gpu/check.sh runs from the repository root on the GPU machine, where
// the build's source path may not exist). Empty when neither has it.
std::string default_job_path() {
  std::vector<std::string> candidates;
#ifdef KEEL_SOURCE_DIR
  candidates.push_back(std::string(KEEL_SOURCE_DIR) + "/launch/configs/default.pbtxt");
#endif
  candidates.push_back("launch/configs/default.pbtxt");
  for (const std::string& c : candidates) {
    if (std::filesystem::is_regular_file(c)) return c;
  }
  return "";
}

struct JobResult {
  double val_loss = 0.0;
  double train_loss = 0.0;
  double seconds = 0.0;
};

// The default job cut to 200 steps: train.steps sets the cosine schedule's end
// (learning_rate(cfg, step, train.steps)), so both devices decay over the same 200 steps
// (warmup 40, then cosine to min_lr_ratio at step 200), and the last step evaluates. The spike
// guard is off: the CPU run's gradient norm crosses its skip threshold once (step 141), and the
// GPU's, a rounding away, need not; this test compares arithmetic, not the guard.
JobResult run_default_job(const std::string& path, const std::vector<std::string>& device_sets) {
  std::vector<std::string> sets = {"train.steps=200", "train.plot=false", "train.tensorboard=false",
                                   "spike.enabled=false"};
  sets.insert(sets.end(), device_sets.begin(), device_sets.end());
  const config::KeelConfig cfg = load_config(path, sets);
  const auto t0 = std::chrono::steady_clock::now();
  TrainerRun run(cfg);
  run->run();
  JobResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(run->steps_done(), 200);
  EXPECT_TRUE(run->evaluated()) << "the last step did not evaluate";
  r.val_loss = run->last_val_loss();
  r.train_loss = run->last().loss;
  std::printf("default job, 200 steps on %s: val loss %.5f, last train loss %.5f, %.1f s\n",
              run->exec().describe().c_str(), r.val_loss, r.train_loss, r.seconds);
  return r;
}

#if KEEL_CUDA_EMULATOR
// This file also builds into the CUDA emulator's tests (tests/cuda_emu), which run every kernel on
// the CPU one CUDA thread at a time: 200 steps of the default job would take hours there.
constexpr const char* kDefaultJobOnEmulator =
    "the 200-step default job is too slow for the CUDA emulator; it runs on a GPU "
    "(tests/gpu/check.sh)";
#endif

// The CPU run, once per process (both GPU precisions compare against it): ~80 s on 2 cores,
// about a fifth of that on the GPU machine's 16.
const JobResult& cpu_default_job(const std::string& path) {
  static const JobResult cpu = [&] {
    const CpuThreads threads(hardware_threads());
    return run_default_job(path, {"train.device=CPU"});
  }();
  return cpu;
}

TEST_F(TrainStepTest, DefaultJob200StepsOnTheGpuInFp32ReachTheCpuValidationLoss) {
#if KEEL_CUDA_EMULATOR
  GTEST_SKIP() << kDefaultJobOnEmulator;
#endif
  const std::string path = default_job_path();
  ASSERT_FALSE(path.empty()) << "launch/configs/default.pbtxt not found under KEEL_SOURCE_DIR or "
                                "the working directory (run from the repository root)";
  const JobResult& cpu = cpu_default_job(path);
  const JobResult gpu = run_default_job(path, {"train.device=CUDA", "train.precision=FP32"});
  ASSERT_TRUE(std::isfinite(cpu.val_loss) && cpu.val_loss > 0);
  EXPECT_LT(rel(gpu.val_loss, cpu.val_loss), 0.02)
      << "GPU " << gpu.val_loss << " vs CPU " << cpu.val_loss;
}

// The default precision on a GPU (train.precision AUTO: BF16 matrix products, fp32 master
// weights), the job as a user runs it: the same 2%.
TEST_F(TrainStepTest, DefaultJob200StepsOnTheGpuAtDefaultPrecisionReachTheCpuValidationLoss) {
#if KEEL_CUDA_EMULATOR
  GTEST_SKIP() << kDefaultJobOnEmulator;
#endif
  const std::string path = default_job_path();
  ASSERT_FALSE(path.empty()) << "launch/configs/default.pbtxt not found under KEEL_SOURCE_DIR or "
                                "the working directory (run from the repository root)";
  const JobResult& cpu = cpu_default_job(path);
  const JobResult gpu = run_default_job(path, {"train.device=CUDA"});
  ASSERT_TRUE(std::isfinite(cpu.val_loss) && cpu.val_loss > 0);
  EXPECT_LT(rel(gpu.val_loss, cpu.val_loss), 0.02)
      << "GPU " << gpu.val_loss << " vs CPU " << cpu.val_loss;
}

// ---- checkpoints between the devices ----

// A tiny byte-level job (2 layers, d_model 32, 16-token windows, batches of 8), 6 steps,
// checkpoints every 2; fp32 on both devices. `sets` change the model (applied last).
config::KeelConfig ckpt_config(const std::string& device,
                               const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {
      "model.seq_len=16",        "model.d_model=32",         "model.n_layers=2",
      "model.n_heads=2",         "train.global_batch=8",     "train.steps=6",
      "train.eval_every=0",      "train.sample_chars=0",     "train.plot=false",
      "train.tensorboard=false", "data.builtin_bytes=60000", "optim.warmup_steps=2",
      "checkpoint.every=2",      "checkpoint.keep=10",       "train.precision=FP32",
      "train.device=" + device};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// Trains `from` for 4 of the job's 6 steps in a run directory (a stop signal after step 4, so the
// schedule is the 6-step job's and run() saves steps 2 and 4), resumes that directory on `to`:
// parameters, AdamW moments, its step count and the data position load bit for bit; the resumed
// steps 5 and 6 are compared with an uninterrupted 6-step run on `from`, within 1e-4 relative
// (the devices differ by fp32 rounding from step 5 on).
void check_resume_across_devices(const std::string& from, const std::string& to,
                                 const std::vector<std::string>& sets = {}) {
  SCOPED_TRACE("checkpoint written on " + from + ", resumed on " + to);
  TempDir dir("keel_gpu_ckpt");
  const std::string run_dir = dir.file("run");
  std::vector<float> params4, m4, v4;
  int64_t t4 = 0;
  uint64_t next_sample4 = 0;
  {
    int polls = 0;
    TrainerRun run(ckpt_config(from, sets), run_dir, [&] { return ++polls >= 4 ? SIGUSR1 : 0; });
    run->run();
    ASSERT_EQ(run->steps_done(), 4);
    ASSERT_EQ(run->stopped_by_signal(), SIGUSR1);
    ASSERT_FALSE(run->failed_checkpoint().has_value());
    params4 = run.params();
    m4 = run.m();
    v4 = run.v();
    t4 = run->optimizer().t();
    next_sample4 = run->state().sampler.next_sample;
  }
  EXPECT_EQ(CheckpointStore(run_dir + "/checkpoints").steps(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(t4, 4);

  // Uninterrupted on `from` (after the first run is gone: one device context at a time).
  std::vector<StepResult> straight;
  std::vector<float> straight_params;
  {
    TrainerRun run(ckpt_config(from, sets));
    for (int s = 1; s <= 6; ++s) straight.push_back(run->step());
    straight_params = run.params();
  }

  TrainerRun resumed(ckpt_config(to, sets), run_dir);
  ASSERT_EQ(resumed->resumed_from(), std::optional<int64_t>(4));
  EXPECT_EQ(resumed->exec().device(), to == "CPU" ? Device::kCpu : Device::kCuda);
  EXPECT_TRUE(same_bits(resumed.params(), params4)) << "parameters at load";
  EXPECT_TRUE(same_bits(resumed.m(), m4)) << "AdamW m at load";
  EXPECT_TRUE(same_bits(resumed.v(), v4)) << "AdamW v at load";
  EXPECT_EQ(resumed->optimizer().t(), t4);
  EXPECT_EQ(resumed->state().sampler.next_sample, next_sample4);
  for (int s = 5; s <= 6; ++s) {
    const StepResult r = resumed->step();
    const StepResult& want = straight[s - 1];
    ASSERT_EQ(r.step, s);
    std::printf(
        "%s -> %s, step %d: loss %.9g vs uninterrupted %.9g (rel %.2e), grad_norm rel "
        "%.2e\n",
        from.c_str(), to.c_str(), s, r.loss, want.loss, rel(r.loss, want.loss),
        rel(r.grad_norm, want.grad_norm));
    EXPECT_EQ(r.first_sample, want.first_sample) << "step " << s << " read other data";
    EXPECT_EQ(r.lr, want.lr) << "step " << s;
    EXPECT_NEAR(r.loss, want.loss, 1e-4 * std::abs(want.loss)) << "step " << s;
    EXPECT_NEAR(r.z_loss, want.z_loss, 1e-4 * std::abs(want.z_loss)) << "step " << s;
  }
  const double param_err = rel_norm_diff(resumed.params(), straight_params);
  std::printf("%s -> %s: parameters after step 6, relative norm difference %.2e\n", from.c_str(),
              to.c_str(), param_err);
  EXPECT_LT(param_err, 1e-4);
}

TEST_F(TrainStepTest, GpuCheckpointResumesOnTheCpu) { check_resume_across_devices("CUDA", "CPU"); }

TEST_F(TrainStepTest, CpuCheckpointResumesOnTheGpu) { check_resume_across_devices("CPU", "CUDA"); }

// The Trainer with grouped-query attention (4 heads on 2 k/v heads): 4 steps on the GPU, resumed
// on the CPU, against the uninterrupted GPU run, to the same bounds.
TEST_F(TrainStepTest, GroupedQueryGpuCheckpointResumesOnTheCpu) {
  check_resume_across_devices("CUDA", "CPU", {"model.n_heads=4", "model.n_kv_heads=2"});
}

}  // namespace
}  // namespace keel::gpu_test
