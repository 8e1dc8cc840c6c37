// What keel-bench and the GPU check's keel-gpu-train-bench time, and how they count FLOPs.
//
// FLOPs per training token (PaLM appendix B convention, the usual MFU accounting):
//   6 * N_matmul + 12 * n_layers * seq_len * d_model
// with N_matmul = n_layers * (4 d_model^2 + 2 d_model d_ff) + vocab * d_model (the LM head),
// 3 d_model d_ff for gated MLPs; the attention term counts the full T x T products (keel skips
// the masked half, so the true work is lower and the reported fraction is the conventional,
// comparable one).
#pragma once

#include <string>

#include "framework/config/keel.pb.h"
#include "framework/profiler.h"

namespace keel {
class Trainer;
}

namespace keel::bench {

struct Named {
  const char* name;
  const char* text;  // text-format config merged over default_config()
  bool gpu;          // a GPU config (keel-bench --device CUDA), else a CPU one
};

// d_ff = 4 d_model, qk_norm RMS, z-loss on, AdamW in the step. S and M are the CPU configs
// (fp32); 124M has GPT-2 small's shapes (vocab padded to 50304 as llm.c does) and 350M GPT-2
// medium's, for one GPU.
extern const Named kConfigs[4];

// Training FLOPs per token (forward and backward, no recomputation): 6 x the matrix weights
// (q, k, v of model.n_kv_heads and model.head_dim, the output projection, the MLP, the LM head)
// plus 12 L T H D for attention, as launch/tools/plan_step_time.py counts them.
double flops_per_token(const config::KeelConfig& c);

// The named config merged over default_config() for a timed run of warmup + steps steps: no
// evaluation, one warm-up step of the schedule at lr 6e-4 (keeps the few timed steps' losses
// sane), d_ff and max_positions from the model's defaults. Not validated.
config::KeelConfig bench_job(const Named& named, int steps, int warmup);

// The GPU's peak for the MFU denominator: keel's cuBLASLt GEMM on n^3 (8192^3 unless a smoke run
// asks for less) in the run's precision (bf16 inputs with fp32 accumulation, or exact fp32), the
// median of 5 timed samples after a warm-up (as keel-gpu-gemm-bench), on GPU 0 with a Context of
// its own. In TFLOP/s. Throws keel::Error (kUsage) in a build without CUDA.
double measure_cuda_peak_tflops(bool bf16, int64_t n = 8192);

// Prints prof's per-op breakdown over `steps` steps, largest first (ms per step and share of the
// profiled total), then the profiled total against `step_seconds`, the step it was taken in.
void print_profile(const Profiler& prof, int steps, double step_seconds);

// The device breakdown: `steps` more steps of trainer with its profiler enabled and synchronised
// with the device at every scope (framework/profiler.h), then "<prefix>per-op device time, ..."
// and print_profile against those steps' mean (the timed steps run unsynchronised before).
void profile_device_steps(Trainer& trainer, int steps, const std::string& prefix);

}  // namespace keel::bench
