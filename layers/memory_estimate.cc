// Host memory per rank for a config and layout (see header). Each term follows the allocation it
// stands for; keep them in step when a layer's buffers change (memory_estimate_test compares the
// parameter count with a built model's).
#include "layers/memory_estimate.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "framework/kernels/exec_context.h"
#include "layers/gpt.h"

namespace keel {

namespace {

constexpr double kFloat = 4.0;  // bytes of an fp32 (and of an int32 token)

// A parameter tensor in the arena is padded to a multiple of 16 floats (64-byte aligned).
double padded(double elems) { return std::ceil(elems / 16.0) * 16.0; }

// Per block: about 14 ParamInfo records (name, two shapes), 4 layer objects holding some 25
// Tensor handles, and their allocations' headers and 64-byte rounding.
constexpr double kPerLayerBytes = 16.0 * 1024;

}  // namespace

MemoryEstimate estimate_memory(const config::KeelConfig& cfg, int tp_size, int dp_size,
                               int64_t micro_batch, int threads, Device device) {
  const config::Model& m = cfg.model();
  const double tp = std::max(1, tp_size), dp = std::max(1, dp_size);
  const double V = m.vocab_size(), C = m.d_model(), H = m.n_heads(), L = m.n_layers();
  const double F = m.d_ff() > 0 ? m.d_ff() : 4.0 * C;
  const double T = m.seq_len(), P = m.max_positions() > 0 ? m.max_positions() : T;
  const double D = m.head_dim() > 0 ? m.head_dim() : H > 0 ? C / H : 0;
  // Layout of ModelDims::from: under TP the vocabulary is padded to a multiple of 64 x tp.
  const double Vp = tp_size <= 1 ? V : std::ceil(V / (64.0 * tp)) * (64.0 * tp);
  const double Hl = H / tp, Fl = F / tp, Vl = Vp / tp, HD = Hl * D;
  // Note [gqa layouts] (layers/attention.h): k/v heads shard with the query heads, or every rank
  // holds them all when tp exceeds them.
  const double Hkv = m.n_kv_heads() > 0 ? m.n_kv_heads() : H;
  const bool gqa = Hkv != H;
  const double Hkvl = std::fmod(Hkv, tp) != 0 ? Hkv : Hkv / tp, KD = Hkvl * D;
  const bool layer_norm = m.norm() == config::LAYERNORM;
  const bool qk_on = m.qk_norm() != config::NONE;
  const bool bias = m.bias();
  const bool gated = m.mlp() == config::SWIGLU || m.mlp() == config::GEGLU;
  const bool rope = m.position() == config::ROPE;
  const bool post_norm = m.norm_placement() == config::POST_SUBLAYER;
  const bool sandwich = m.norm_placement() == config::SANDWICH;  // two more norms per block
  auto bias_of = [&](double elems) { return bias ? padded(elems) : 0.0; };

  // ---- parameters: this rank's slice of each tensor (layers/*.cc constructors)
  const double norm_params = padded(C) + (layer_norm ? bias_of(C) : 0);
  double qk_params = 0;
  if (m.qk_norm() == config::RMS || m.qk_norm() == config::LAYER) {
    const bool shared = m.qk_norm_scope() == config::HEAD_SHARED;
    const double gains = shared ? 2 * padded(D) : padded(HD) + padded(KD);  // q's and k's
    qk_params = (m.qk_norm() == config::LAYER && bias ? 2 : 1) * gains;
  } else if (m.qk_norm() == config::L2) {
    qk_params = padded(m.qk_norm_scope() == config::HEAD ? Hl : 1);
  }
  // qkv [3, Hl, D, C]; grouped-query: q [Hl, D, C] and kv [2, Hkvl, D, C].
  const double qkv_params =
      gqa ? padded(HD * C) + bias_of(HD) + padded(2 * KD * C) + bias_of(2 * KD)
          : padded(3 * HD * C) + bias_of(3 * HD);
  const double attn_params = qkv_params + qk_params + padded(C * HD) + bias_of(C);
  // up (fc) and, gated, gate: [Fl, C] each; down (proj): [C, Fl].
  const double mlp_params =
      (gated ? 2 : 1) * (padded(Fl * C) + bias_of(Fl)) + padded(C * Fl) + bias_of(C);
  const double block_params = (sandwich ? 4 : 2) * norm_params + attn_params + mlp_params;
  double arena = padded(Vl * C) + (rope ? 0 : padded(P * C)) + L * block_params + norm_params;
  if (!m.tie_embeddings()) arena += padded(Vl * C);
  arena = std::ceil(arena / (16.0 * dp)) * (16.0 * dp);  // padded so ZeRO-1 splits it evenly

  MemoryEstimate e;
  e.parameters = arena * kFloat;
  e.gradients = arena * kFloat;
  // AdamW m and v over this rank's shard; ZeRO-1 adds the reduce-scattered gradient shard.
  const bool zero = dp_size > 1 && cfg.parallel().zero_stage() == 1;
  e.optimizer = (zero ? 3 * arena / dp : 2 * arena) * kFloat;

  // ---- activations of one micro-batch (the allocate() methods and GPT's constructor)
  const double B = static_cast<double>(micro_batch), BT = B * T;
  const bool projection = m.qk_norm_scope() == config::PROJECTION;
  const double groups = projection ? 2 : Hl + Hkvl;  // q's and k's norm groups per row
  const bool gpu = device != Device::kCpu;
  // Note [act-dtype]: under BF16 on a GPU the activations only matrix products read are bf16,
  // half a float each: the logits, the final and (pre-sublayer) block norms' outputs, the
  // QK-normalised q and k, attention's output and its gradient, and the MLP's activated hidden.
  const bool bf16 = gpu && kernels::resolve_precision(cfg.train().precision(), device) ==
                               kernels::Precision::kBf16;
  const double act = bf16 ? 0.5 : 1.0;
  // qkv, what attention saves (CPU: probabilities; GPU: log-sum-exp), att, scales
  const double qkv = BT * (HD + 2 * KD);
  double attn = act * qkv + (gpu ? B * Hl * T : B * Hl * T * T) + act * BT * HD + Hl;
  if (qk_on) attn += act * BT * (HD + KD) + 2 * BT * groups;  // qk, q/k mean and rstd
  if (qk_on && m.qk_norm_scope() == config::PROJECTION) attn += 4 * BT;
  // Note [sequence parallel] (layers/gpt.h): the residual stream and the norms hold rows = BT / tp
  // token rows (fp32) on each rank; each sublayer's input is all-gathered into shared scratch.
  const bool sp = cfg.parallel().sequence_parallel() && tp_size > 1;
  const double rows = sp ? BT / tp : BT;
  const double norms = (sandwich ? 4 : 2) * 2 * rows;  // ln1, ln2 (and the post-norms): mean, rstd
  // GELU: pre-activation and output (both bf16 under BF16: Note [act-dtype]); gated: up and gate
  // (fp32) and their product.
  const double mlp = (gated ? 2 : act) * BT * Fl + act * BT * Fl;
  // n1, n2 (norm outputs before the sublayers, or post-sublayer the norms' fp32 inputs), r1, out
  // Sandwich norms: s1, s2 (the sublayer outputs, fp32) too.
  const double block = (post_norm || sp ? 2 : 2 * act) * rows * C + 2 * rows * C +
                       (sandwich ? 2 * rows * C : 0) + norms + attn + mlp;
  // tokens, targets; x0, dres; xf (all-gathered fp32 under SP); logits; max, lse, target logit
  double model = 2 * BT + 2 * rows * C + (sp ? 1 : act) * BT * C + act * BT * Vl + 3 * BT;
  model += 2 * rows;                    // ln_f mean and rstd
  if (sp) model += 3 * BT * C + 2 * C;  // sp_x, sp_dy, sp_part; sp_norm
  if (rope) model += T * D;             // the cos/sin table: [T, D / 2] each
  // Backward scratch shared by all blocks: dn, datt and dqkv (bf16 too), dqk, dh, dgate (gated;
  // bf16 too), dsub (post-norm), the per-thread T x T attention workspace and dscale.
  model += rows * C + act * BT * HD + act * qkv + (qk_on ? BT * (HD + KD) : 0) +
           (gated ? 1 : act) * BT * Fl;
  if (gated) model += act * BT * Fl;
  if (post_norm || sandwich) model += rows * C;
  // Note [bf16 wire]: the bf16 scratch of the TP all-reduces of activations written in bf16.
  if (bf16 && tp_size > 1 && tp_comm_bf16(cfg.parallel(), kernels::Precision::kBf16)) {
    model += 0.5 * BT * C;
  }
  model += (gpu ? 0 : std::max(1, threads) * 2 * T * T) + B * Hl + Hl;
  const double trainer = 2 * BT;  // the trainer's input and target batch
  // Note [recompute] (layers/gpt.h): the first N blocks share one block's saved activations and
  // keep only their outputs.
  const double shared = std::max(0, cfg.train().recompute_layers() - 1);
  const double blocks = L * block - shared * (block - rows * C);
  e.activations = (blocks + model + trainer) * kFloat;

  // MPI's temporaries for the DP gradient reduction (measured with Open MPI 4: a 2-rank job's
  // peak RSS grows by about the arena under ZeRO-1's reduce-scatter, and by about one bucket,
  // at most the arena, under the bucketed all-reduce).
  if (dp_size > 1) {
    const double bucket = static_cast<double>(cfg.parallel().bucket_mb()) * 1024 * 1024;
    e.communication = zero ? e.gradients : std::min(bucket, e.gradients);
  }
  if (cfg.data().format() == config::BUILTIN) {
    e.data = static_cast<double>(cfg.data().builtin_bytes());
  }
  // kProcessBaseline: about 21 MiB of peak RSS measured on a tiny job of a CPU-only build.
  e.overhead = kProcessBaselineBytes + L * kPerLayerBytes;
  return e;
}

std::string MemoryEstimate::describe() const {
  return format_bytes(total()) + " (parameters " + format_bytes(parameters) + ", gradients " +
         format_bytes(gradients) + ", AdamW state " + format_bytes(optimizer) + ", activations " +
         format_bytes(activations) + ", MPI buffers " + format_bytes(communication) + ", data " +
         format_bytes(data) + ", runtime and bookkeeping " + format_bytes(overhead) + ")";
}

double resident_memory_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long size = 0, resident = 0;
  const int got = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (got != 2 || resident <= 0 || page_size <= 0) return 0;
  return static_cast<double>(resident) * static_cast<double>(page_size);
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<double>(pages) * static_cast<double>(page_size);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), bytes < 1000.0 ? "%.3g %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

}  // namespace keel
