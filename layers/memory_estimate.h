// How much host memory one rank of a job needs, computed from the config and the layout before
// anything is allocated, so that keel-train can refuse a job no machine holds with a clear error
// instead of dying with "out of memory" (or stalling for hours building 2^31 layers).
//
// The estimate mirrors what the code allocates (fp32, but for the bf16 activations of a BF16 GPU
// run): the parameter and gradient arenas (layers/params.cc, this TP rank's slice, each tensor
// padded to 16 floats), the AdamW moments m and v (framework/optim; a 1/dp shard of the arena plus
// its reduce-scattered gradient shard under ZeRO-1), the activations one micro-batch saves for
// backward (fewer with train.recompute_layers: Note [recompute] in layers/gpt.h) plus the logits
// and the shared backward scratch (layers/gpt.cc, attention.cc, mlp.cc, norm.cc), the temporary
// buffers MPI allocates to reduce gradients over DP (measured with Open MPI: about one bucket for
// the all-reduce, the whole arena for ZeRO-1's reduce-scatter), the built-in corpus held in memory,
// and a fixed process baseline (runtime, MPI, OpenBLAS) plus bookkeeping per layer. Files given as
// data.path are memory-mapped page cache, which the kernel can drop, so they are not counted.
// Doubles throughout: a config of 2^31 layers or a 2^31 vocabulary computes a huge number, never an
// overflowed one.
#pragma once

#include <cstdint>
#include <string>

#include "framework/config/keel.pb.h"
#include "framework/device_backend.h"

namespace keel {

struct MemoryEstimate {
  double parameters = 0;     // bytes of this rank's parameter slices
  double gradients = 0;      // the gradient arena (same layout as the parameters)
  double optimizer = 0;      // AdamW m and v (and ZeRO-1's gradient shard)
  double activations = 0;    // one micro-batch's saved activations, logits and backward scratch
  double communication = 0;  // MPI's temporary buffers for the DP gradient reduction
  double data = 0;           // the built-in corpus (files are mapped, not counted)
  double overhead = 0;       // process baseline and per-layer bookkeeping
  double total() const {
    return parameters + gradients + optimizer + activations + communication + data + overhead;
  }
  // "1.23 GiB (parameters 0.10 GiB, gradients ..., ...)" for messages.
  std::string describe() const;
};

// `cfg` must be validated (d_ff and max_positions resolved). tp and dp are the layout's sizes,
// micro_batch the sequences per forward on a rank, threads the OpenMP threads per rank (the
// attention backward keeps a T x T workspace per thread). On a GPU (`device` kCuda) the memory is
// the device's: attention keeps only its log-sum-exp [B, H, T] (no T x T probabilities or
// per-thread workspace).
MemoryEstimate estimate_memory(const config::KeelConfig& cfg, int tp, int dp, int64_t micro_batch,
                               int threads, Device device = Device::kCpu);

// Physical memory of this machine in bytes (sysconf), 0 when it cannot be told.
double physical_memory_bytes();

// The estimate's fixed process baseline (C++/MPI/OpenBLAS runtime, thread stacks, page tables),
// part of MemoryEstimate::overhead. What a process already holds can be more: a CUDA-enabled
// build maps about 200 MiB of CUDA libraries (cuBLASLt, cuDNN) even when it trains on the CPU.
// keel-train measures it (resident_memory_bytes, before the model exists) and counts that instead
// when it is larger.
inline constexpr double kProcessBaselineBytes = 24.0 * 1024 * 1024;

// This process's resident set now, in bytes (/proc/self/statm), 0 when it cannot be told.
double resident_memory_bytes();

// Three significant digits, or whole units from 1000 up: "512 B", "146 MiB", "3.25 GiB",
// "1010 KiB", "2000000 TiB".
std::string format_bytes(double bytes);

}  // namespace keel
