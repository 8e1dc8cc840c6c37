// Helpers shared by the MPI tests in tests/parallel: the process's one MpiEnv, the tiny model
// configuration every equivalence and volume test trains, and the QK-norm modes to sweep.
// Every rank runs every test in the same order; a helper that communicates must be called by all
// ranks (no early returns between collectives).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/config/keel.pb.h"
#include "parallel/mpi_env.h"

namespace keel::testing {

// MPI is initialised by mpi_test_main.cc; the MpiEnv only reads the world. It is never destroyed
// (its destructor would finalise MPI before main's own MPI_Finalize and the final all-reduce).
inline const MpiEnv& mpi_env() {
  static MpiEnv* env = new MpiEnv(nullptr, nullptr);
  return *env;
}

inline int world_size() { return mpi_env().world_size(); }

struct QkMode {
  config::QkNorm norm;
  config::QkNormScope scope;
  std::string name() const {
    if (norm == config::NONE) return "NONE";
    return config::QkNorm_Name(norm) + "_" + config::QkNormScope_Name(scope);
  }
};

// NONE, then {RMS, LAYER, L2} x {HEAD_SHARED, HEAD, PROJECTION}.
inline std::vector<QkMode> all_qk_modes() {
  std::vector<QkMode> out = {{config::NONE, config::HEAD_SHARED}};
  for (auto n : {config::RMS, config::LAYER, config::L2}) {
    for (auto s : {config::HEAD_SHARED, config::HEAD, config::PROJECTION}) out.push_back({n, s});
  }
  return out;
}

// The block's shape beyond QK-norm: the config defaults (GPT-2: LayerNorm, learned positions, GELU,
// biases, pre-norm), or a modern block (below).
struct BlockKind {
  std::string tag;  // "" for the GPT-2 block; otherwise a suffix for test names
  config::NormKind norm = config::LAYERNORM;
  config::Position position = config::LEARNED;
  double rope_theta = 10000;
  config::MlpKind mlp = config::GELU;
  bool bias = true;
  config::NormPlacement placement = config::PRE;
};

// OLMo 2's block: RMSNorm after each sublayer, RoPE (base 500000), SwiGLU, no biases.
inline BlockKind olmo2_block() {
  return {.tag = "olmo2",
          .norm = config::RMSNORM,
          .position = config::ROPE,
          .rope_theta = 500000,
          .mlp = config::SWIGLU,
          .bias = false,
          .placement = config::POST_SUBLAYER};
}

// Gemma 3's block: RMSNorm before and after each sublayer (Note [sandwich norms]), RoPE (base
// 1000000), GeGLU, no biases.
inline BlockKind gemma3_block() {
  return {.tag = "gemma3",
          .norm = config::RMSNORM,
          .position = config::ROPE,
          .rope_theta = 1000000,
          .mlp = config::GEGLU,
          .bias = false,
          .placement = config::SANDWICH};
}

// Qwen3's block: pre-norm RMSNorm, RoPE (base 1000000), SwiGLU, no biases.
inline BlockKind qwen3_block() {
  return {.tag = "qwen3",
          .norm = config::RMSNORM,
          .position = config::ROPE,
          .rope_theta = 1000000,
          .mlp = config::SWIGLU,
          .bias = false,
          .placement = config::PRE};
}

// A Qwen3-shaped block with what Qwen3 lacks switched on: GEGLU with biases (column-parallel gate
// and up biases, the row-parallel down bias added once) and LayerNorm with biases, under RoPE.
inline BlockKind rope_geglu_bias_block() {
  return {.tag = "rope_geglu_bias",
          .norm = config::LAYERNORM,
          .position = config::ROPE,
          .rope_theta = 10000,
          .mlp = config::GEGLU,
          .bias = true,
          .placement = config::PRE};
}

// The tiny job: V = 130 (the built-in corpus is ASCII, bytes < 123, so a vocabulary below 128
// cannot read it; 130 is not a multiple of 64 x tp, so TP pads it: Vp = 256 at tp = 2 and 4, and
// at tp = 4 the last rank's vocabulary shard is all padding), T = 16, C = 32, 2 layers, 4 heads of
// 8, d_ff 64 (also for the gated MLPs: it splits over tp = 4), global batch 8. Warm-up is off so
// three AdamW steps move the parameters (the cosine schedule spans 100 steps). Note [AdamW
// conditioning]: AdamW's step lr m / (sqrt(v) + eps) has slope up to lr / eps in g where |g| <~
// eps, so rounding differences between layouts (~1e-9 in near-zero gradient elements, e.g. a
// hidden unit almost off for one batch) grow into parameter differences. Worst relative difference
// in norm of any parameter tensor after three steps, over every layout of tp_dp_equivalence_test
// (measured): lr 3e-3, eps 1e-8 (the default peak, warm-up off) 1.0e-4 (4e-5 absolute); lr 1e-3,
// eps 1e-8: 3.6e-5; lr 3e-3, eps 1e-5: 3.6e-6. With every optimizer default (40 warm-up steps, so
// steps 1-3 run at lr <= 2.25e-4 and gain <= 2.25e4) it is 6.3e-6. lr 1e-3 and eps 1e-5 keep the
// gain lr / eps at 100, so layouts that differ only in summation order agree to ~3e-6 after three
// steps (measured; the bound is 1e-5). The differences are rounding amplified, not errors:
// gradients at step 1 (identical parameters) agree to ~5e-6 whatever the optimizer.
struct TinyJob {
  int tp = 1;
  int zero_stage = 0;
  int micro_batch = 0;  // 0: global_batch / dp
  QkMode qk{config::RMS, config::HEAD_SHARED};
  bool tied = true;
  double grad_clip = 1e9;  // large: clipping does not bind
  double bucket_mb = 25;
  BlockKind block;
  int recompute = 0;  // train.recompute_layers
  bool sp = false;    // parallel.sequence_parallel
};

inline constexpr int kVocab = 130;
inline constexpr int kSeqLen = 16, kDModel = 32, kLayers = 2, kHeads = 4, kDff = 64;
inline constexpr int kGlobalBatch = 8;

inline config::KeelConfig tiny_config(const TinyJob& j) {
  const std::vector<std::string> sets = {
      "model.vocab_size=" + std::to_string(kVocab),
      "model.seq_len=" + std::to_string(kSeqLen),
      "model.d_model=" + std::to_string(kDModel),
      "model.n_layers=" + std::to_string(kLayers),
      "model.n_heads=" + std::to_string(kHeads),
      "model.d_ff=" + std::to_string(kDff),
      "model.qk_norm=" + config::QkNorm_Name(j.qk.norm),
      "model.qk_norm_scope=" + config::QkNormScope_Name(j.qk.scope),
      std::string("model.tie_embeddings=") + (j.tied ? "true" : "false"),
      "model.norm=" + config::NormKind_Name(j.block.norm),
      "model.position=" + config::Position_Name(j.block.position),
      "model.rope_theta=" + std::to_string(j.block.rope_theta),
      "model.mlp=" + config::MlpKind_Name(j.block.mlp),
      std::string("model.bias=") + (j.block.bias ? "true" : "false"),
      "model.norm_placement=" + config::NormPlacement_Name(j.block.placement),
      "parallel.tp=" + std::to_string(j.tp),
      "parallel.zero_stage=" + std::to_string(j.zero_stage),
      "parallel.bucket_mb=" + std::to_string(j.bucket_mb),
      std::string("parallel.sequence_parallel=") + (j.sp ? "true" : "false"),
      "train.global_batch=" + std::to_string(kGlobalBatch),
      "train.micro_batch=" + std::to_string(j.micro_batch),
      "train.recompute_layers=" + std::to_string(j.recompute),
      "train.steps=100",
      "train.seed=4242",
      "train.eval_every=0",
      "train.sample_chars=0",
      "data.builtin_bytes=200000",
      "loss.z_loss=1e-3",
      "optim.lr=1e-3",
      "optim.eps=1e-5",
      "optim.warmup_steps=0",
      "optim.grad_clip=" + std::to_string(j.grad_clip),
  };
  return load_config("", sets);
}

// Whether every rank of MPI_COMM_WORLD holds the same bits in `v`.
inline bool same_on_all_ranks(double v) {
  double mx = v, mn = v;
  MPI_Allreduce(MPI_IN_PLACE, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &mn, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return std::memcmp(&mx, &mn, sizeof(double)) == 0 && std::memcmp(&mx, &v, sizeof(double)) == 0;
}

// FNV-1a over bytes (bitwise fingerprints of parameter arenas).
inline uint64_t fingerprint(const void* data, size_t bytes, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Every rank's `v`, in world-rank order.
inline std::vector<uint64_t> all_gather_world(uint64_t v) {
  std::vector<uint64_t> out(static_cast<size_t>(world_size()));
  MPI_Allgather(&v, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  return out;
}

}  // namespace keel::testing
