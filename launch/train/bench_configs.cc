// The benchmark configs, the FLOP count and the GPU's GEMM peak (bench_configs.h).
#include "launch/train/bench_configs.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#if KEEL_HAVE_CUDA
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/ops.h"
#endif
#include "launch/train/trainer.h"

namespace keel::bench {

const Named kConfigs[4] = {
    {"S",
     "model { vocab_size: 256 d_model: 384 n_layers: 6 n_heads: 6 seq_len: 256 }"
     " train { global_batch: 8 }",
     false},
    {"M",
     "model { vocab_size: 8192 d_model: 768 n_layers: 4 n_heads: 12 seq_len: 512 }"
     " train { global_batch: 4 }",
     false},
    {"124M",
     "model { vocab_size: 50304 d_model: 768 n_layers: 12 n_heads: 12 seq_len: 1024 }"
     " train { global_batch: 16 }",
     true},
    {"350M",
     "model { vocab_size: 50304 d_model: 1024 n_layers: 24 n_heads: 16 seq_len: 1024 }"
     " train { global_batch: 8 }",
     true},
};

#if KEEL_HAVE_CUDA
double measure_cuda_peak_tflops(bool bf16, int64_t n) {
  namespace cuda = kernels::cuda;
  cuda::Context ctx(0);
  const cuda::DType ab = bf16 ? cuda::DType::kBF16 : cuda::DType::kF32;
  const size_t ab_bytes = bf16 ? 2 : 4;
  cuda::DeviceBuffer A = ctx.alloc(n * n * ab_bytes), B = ctx.alloc(n * n * ab_bytes);
  cuda::DeviceBuffer C = ctx.alloc(n * n * 4);
  if (bf16) {
    cuda::fill_uniform(ctx, A.as<Bf16>(), n * n, -1.0f, 1.0f, 1);
    cuda::fill_uniform(ctx, B.as<Bf16>(), n * n, -1.0f, 1.0f, 2);
  } else {
    cuda::fill_uniform(ctx, A.as<float>(), n * n, -1.0f, 1.0f, 1);
    cuda::fill_uniform(ctx, B.as<float>(), n * n, -1.0f, 1.0f, 2);
  }
  const auto once = [&] {
    cuda::gemm(ctx, false, true, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n, ab,
               cuda::DType::kF32);
  };
  once();
  once();
  std::vector<double> ms;
  for (int i = 0; i < 5; ++i) ms.push_back(ctx.time_ms(once));
  std::sort(ms.begin(), ms.end());
  return 2.0 * n * n * n / (ms[ms.size() / 2] * 1e-3) / 1e12;
}
#else
double measure_cuda_peak_tflops(bool /*bf16*/, int64_t /*n*/) {
  KEEL_FAIL(kUsage, "this keel was built without CUDA");
}
#endif

double flops_per_token(const config::KeelConfig& c) {
  const config::Model& m = c.model();
  const double L = m.n_layers(), d = m.d_model(), T = m.seq_len(), V = m.vocab_size();
  const double f = m.d_ff() > 0 ? m.d_ff() : 4 * d;
  // Heads of head_dim D (model.head_dim, else d / H); grouped-query k and v have Hkv heads.
  const double H = m.n_heads(), D = m.head_dim() > 0 ? m.head_dim() : d / H;
  const double Hkv = m.n_kv_heads() > 0 ? m.n_kv_heads() : H;
  // Gated MLPs (SWIGLU, GEGLU) have three d x f matrices: gate, up and down.
  const double mlp_mats = m.mlp() == config::GELU ? 2 : 3;
  // q, k, v: d x (H + 2 Hkv) D; the output projection H D x d (4 d^2 for multi-head attention).
  const double attn_mats = d * (H + 2 * Hkv) * D + H * D * d;
  const double n_matmul = L * (attn_mats + mlp_mats * d * f) + V * d;
  // QK^T and AV: 2 T H D multiply-adds per token and layer forward, twice that backward.
  return 6 * n_matmul + 12 * L * T * H * D;
}

config::KeelConfig bench_job(const Named& named, int steps, int warmup) {
  config::KeelConfig cfg = default_config();
  merge_config_text(named.text, std::string("config ") + named.name, cfg);
  cfg.mutable_train()->set_eval_every(0);
  cfg.mutable_train()->set_steps(steps + warmup);
  cfg.mutable_optim()->set_warmup_steps(1);
  cfg.mutable_optim()->set_lr(6e-4);  // keeps the few timed steps' losses sane
  cfg.mutable_model()->set_d_ff(0);
  cfg.mutable_model()->set_max_positions(0);
  return cfg;
}

void print_profile(const Profiler& prof, int steps, double step_seconds) {
  double sum = 0.0;
  for (const auto& e : prof.entries()) sum += e.second;
  std::printf("  %-18s %10s %7s\n", "op", "ms/step", "share");
  auto entries = prof.entries();
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  for (const auto& e : entries) {
    std::printf("  %-18s %10.1f %6.1f%%\n", e.first.c_str(), 1e3 * e.second / steps,
                100 * e.second / sum);
  }
  std::printf("  %-18s %10.1f (step %.1f; the rest is data and bookkeeping)\n", "profiled",
              1e3 * sum / steps, 1e3 * step_seconds);
}

void profile_device_steps(Trainer& trainer, int steps, const std::string& prefix) {
  Profiler& prof = trainer.model().profiler();
  prof.set_sync([&trainer] { trainer.exec().synchronize(); });
  prof.reset();
  prof.set_enabled(true);
  double profiled = 0.0;
  for (int i = 0; i < steps; ++i) profiled += trainer.step().seconds;
  prof.set_enabled(false);
  prof.set_sync({});
  std::printf("%sper-op device time, synchronised at every op, over %d more step%s:\n",
              prefix.c_str(), steps, steps == 1 ? "" : "s");
  print_profile(prof, steps, profiled / steps);
}

}  // namespace keel::bench
