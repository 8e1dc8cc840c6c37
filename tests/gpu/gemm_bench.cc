// keel-gpu-gemm-bench: achieved TFLOP/s of keel's cuBLASLt GEMMs (framework/kernels/cuda/gemm.h)
// on the square 8192^3 product (the measured peak that MFU is quoted against) and on GPT-2 124M's
// training shapes at 8192 tokens per step (forward, input-gradient and weight-gradient GEMMs of
// qkv, attention projection, MLP fc and proj, and the LM head), for bf16 (fp32 accumulation),
// TF32 and exact fp32. Times by CUDA events: warm-up, then the median of several samples.
//
// Usage: keel-gpu-gemm-bench [--quick]   (--quick: 8192^3 and bf16 only)
// Exit codes: 0 done, 77 no CUDA device (skipped), 1 error.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {
namespace {

struct Shape {
  const char* name;
  const char* pass;  // fwd: out = x W^T; dgrad: dx = dy W; wgrad: dW += dy^T x
  bool trans_a, trans_b;
  int64_t M, N, K;
  int layers;  // how many times one training step runs it (for the step summary)
};

struct Mode {
  const char* name;
  DType ab;
  Fp32Matmul fp32;
};

std::vector<Shape> gpt2_shapes() {
  const int64_t BT = 8192, C = 768, L = 12, V = 50304;
  struct Linear {
    const char* name;
    int64_t IC, OC;
    int layers;
  };
  const Linear linears[] = {{"qkv", C, 3 * C, L},
                            {"attn_proj", C, C, L},
                            {"fc", C, 4 * C, L},
                            {"mlp_proj", 4 * C, C, L},
                            {"lm_head", C, V, 1}};
  std::vector<Shape> out;
  for (const Linear& l : linears) {
    out.push_back({l.name, "fwd", false, true, BT, l.OC, l.IC, l.layers});
    out.push_back({l.name, "dgrad", false, false, BT, l.IC, l.OC, l.layers});
    out.push_back({l.name, "wgrad", true, false, l.OC, l.IC, BT, l.layers});
  }
  return out;
}

struct Result {
  double ms = 0.0, tflops = 0.0;
};

Result run(Context& ctx, const Shape& s, const Mode& mode) {
  ctx.set_fp32_matmul(mode.fp32);
  // Weight gradients accumulate into fp32 master gradients; other outputs have the input type.
  const bool wgrad = std::strcmp(s.pass, "wgrad") == 0;
  const DType c = wgrad ? DType::kF32 : mode.ab;
  const size_t ab_bytes = mode.ab == DType::kF32 ? 4 : 2, c_bytes = c == DType::kF32 ? 4 : 2;
  const int64_t lda = s.trans_a ? s.M : s.K, ldb = s.trans_b ? s.K : s.N, ldc = s.N;
  const int64_t a_elems = s.M * s.K, b_elems = s.K * s.N, c_elems = s.M * s.N;
  DeviceBuffer A = ctx.alloc(a_elems * ab_bytes), B = ctx.alloc(b_elems * ab_bytes);
  DeviceBuffer C = ctx.alloc(c_elems * c_bytes);
  const auto fill = [&](DeviceBuffer& buf, DType t, int64_t n, uint64_t seed) {
    if (t == DType::kF32) {
      fill_uniform(ctx, buf.as<float>(), n, -1.0f, 1.0f, seed);
    } else {
      fill_uniform(ctx, buf.as<Bf16>(), n, -1.0f, 1.0f, seed);
    }
  };
  fill(A, mode.ab, a_elems, 1);
  fill(B, mode.ab, b_elems, 2);
  fill(C, c, c_elems, 3);
  const float beta = wgrad ? 1.0f : 0.0f;
  const auto once = [&] {
    gemm(ctx, s.trans_a, s.trans_b, s.M, s.N, s.K, 1.0f, A.data(), lda, B.data(), ldb, beta,
         C.data(), ldc, mode.ab, c);
  };
  once();  // plan, heuristic, clocks
  once();
  const float first = ctx.time_ms(once);
  // ~25 ms per sample, at least one call, at most 50.
  const int reps = std::clamp(static_cast<int>(25.0f / std::max(first, 1e-3f)), 1, 50);
  std::vector<double> samples;
  for (int i = 0; i < 5; ++i) {
    samples.push_back(ctx.time_ms([&] {
      for (int r = 0; r < reps; ++r) once();
    }) / reps);
  }
  std::sort(samples.begin(), samples.end());
  Result res;
  res.ms = samples[samples.size() / 2];
  res.tflops = 2.0 * s.M * s.N * s.K / (res.ms * 1e-3) / 1e12;
  return res;
}

int bench(bool quick) {
  if (device_count() == 0) {
    std::printf("keel-gpu-gemm-bench: no CUDA device (no GPU or no driver); skipped\n");
    return 77;
  }
  Context ctx(0);
  std::printf("device: %s\n%s\n", device_description(0).c_str(), library_versions().c_str());
  const std::vector<Mode> modes =
      quick ? std::vector<Mode>{{"bf16", DType::kBF16, Fp32Matmul::kExact}}
            : std::vector<Mode>{{"bf16", DType::kBF16, Fp32Matmul::kExact},
                                {"tf32", DType::kF32, Fp32Matmul::kTf32},
                                {"fp32", DType::kF32, Fp32Matmul::kExact}};
  const Shape square{"square", "fwd", false, true, 8192, 8192, 8192, 1};
  std::printf("\n%-10s %-6s %-5s %6s %6s %6s %9s %9s %8s\n", "shape", "pass", "dtype", "M", "N",
              "K", "ms", "TFLOP/s", "of-peak");
  double peak = 0.0;
  for (const Mode& mode : modes) {
    const Result r = run(ctx, square, mode);
    if (mode.ab == DType::kBF16) peak = r.tflops;
    std::printf("%-10s %-6s %-5s %6ld %6ld %6ld %9.3f %9.1f %7.1f%%\n", square.name, square.pass,
                mode.name, static_cast<long>(square.M), static_cast<long>(square.N),
                static_cast<long>(square.K), r.ms, r.tflops, 100.0 * r.tflops / peak);
    std::fflush(stdout);
  }
  for (const Mode& mode : modes) {
    double step_ms = 0.0, step_flop = 0.0;
    for (const Shape& s : gpt2_shapes()) {
      const Result r = run(ctx, s, mode);
      step_ms += r.ms * s.layers;
      step_flop += 2.0 * s.M * s.N * s.K * s.layers;
      std::printf("%-10s %-6s %-5s %6ld %6ld %6ld %9.3f %9.1f %7.1f%%\n", s.name, s.pass, mode.name,
                  static_cast<long>(s.M), static_cast<long>(s.N), static_cast<long>(s.K), r.ms,
                  r.tflops, 100.0 * r.tflops / peak);
      std::fflush(stdout);
    }
    std::printf(
        "%-10s %-6s %-5s: GPT-2 124M step GEMMs (12 layers + lm_head, 8192 tokens) "
        "%.2f ms, %.1f TFLOP/s, %.1f%% of the bf16 peak\n",
        "step", "all", mode.name, step_ms, step_flop / (step_ms * 1e-3) / 1e12,
        100.0 * step_flop / (step_ms * 1e-3) / 1e12 / peak);
    std::fflush(stdout);
  }
  const AllocatorStats st = ctx.allocator().stats();
  std::printf("\nallocator: %ld cudaMalloc calls, %ld cache hits, peak %.2f GiB in use\n",
              static_cast<long>(st.device_mallocs), static_cast<long>(st.cache_hits),
              static_cast<double>(st.peak_bytes_in_use) / (1ull << 30));
  return 0;
}

}  // namespace
}  // namespace keel::kernels::cuda

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: keel-gpu-gemm-bench [--quick]\n");
      return 2;
    }
  }
  try {
    return keel::kernels::cuda::bench(quick);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-gpu-gemm-bench: %s\n", e.what());
    return 1;
  }
}
