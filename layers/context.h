// What every layer needs besides its own weights: the resolved model dimensions, the execution
// context (the device its tensors live on and the one way to its kernels), the topology (for TP
// collectives), the shared backward scratch and the profiler.
#pragma once

#include <cstdint>
#include <utility>

#include "framework/config/keel.pb.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/rope.h"
#include "framework/profiler.h"
#include "framework/tensor.h"
#include "parallel/communicator.h"
#include "parallel/tp_regions.h"

namespace keel {

struct ModelDims {
  int64_t V, C, H, D, F, L, P;  // vocab, d_model, heads, head_dim, d_ff, layers, positions
  int64_t Vp;                   // vocab padded to a multiple of 64 x tp (Vp = V when tp = 1)
  int64_t T;                    // sequence length
  int64_t B;                    // micro-batch (sequences)
  int64_t Hl, Fl, Vl;           // this TP rank's heads, d_ff columns and vocab rows
  int64_t v_begin;              // first vocab row held here
  int64_t v_valid;              // rows of this rank's shard below V (the rest are padding)
  int tp_rank, tp;
  // Note [gqa layouts] (layers/attention.h). Hkv: k/v heads (H for multi-head attention); Hkvl:
  // those this rank holds and projects (Hkv / tp sharded, all Hkv when replicated); kv_replicated:
  // tp > Hkv, so every rank holds every k/v head and its query heads read one of them,
  // kv_attn_head0 (a local k/v head index), through attention's kv_attn_heads (Hkvl sharded, 1
  // replicated).
  int64_t Hkv, Hkvl, kv_attn_head0, kv_attn_heads;
  bool kv_replicated;
  config::QkNorm qk_norm;
  config::QkNormScope qk_scope;
  config::NormKind norm;
  bool tied;
  float init_std;
  config::Position position;  // LEARNED: wpe table; ROPE: rotary q, k after QK-norm
  double rope_theta;
  config::MlpKind mlp;  // GELU, SWIGLU, GEGLU
  bool bias;            // biases in linear layers and LayerNorms
  bool post_norm;       // norm_placement == POST_SUBLAYER: x + norm(f(x))
  bool sandwich;        // norm_placement == SANDWICH: x + norm(f(norm(x))) (Note [sandwich norms])
  // The TP activation all-reduces move bf16 (parallel.tp_comm_dtype; Note [bf16 wire] in
  // parallel/communicator.h). Set by GPT from the config and the execution precision.
  bool tp_bf16_wire = false;
  // ... and the layers' GEMMs write those activations in bf16, the all-reduce sums them in place
  // and their readers widen them (tp > 1 and bf16 activations: Note [act-dtype]), instead of
  // rounding and widening fp32 buffers around the all-reduce. Set by GPT.
  bool tp_bf16_act = false;
  // Note [sequence parallel] (layers/gpt.h): parallel.sequence_parallel with tp > 1. The residual
  // stream and the block and final norms hold rows(B) = B T / tp token rows on each rank. Set by
  // GPT from the config.
  bool sp = false;
  static ModelDims from(const config::Model& m, int64_t micro_batch, const Topology& topo);
  int64_t BT() const { return B * T; }
  // Token rows of a micro-batch of B sequences this rank holds in the residual stream.
  int64_t rows(int64_t B_) const { return sp ? B_ * T / tp : B_ * T; }
  bool gated_mlp() const { return mlp == config::SWIGLU || mlp == config::GEGLU; }
  // Grouped-query (or multi-query) attention: separate q and kv projections (Note [gqa layouts]).
  bool gqa() const { return Hkv != H; }
  // Columns of the projection output row(s): q, k, v of this rank's heads.
  int64_t qkv_width() const { return (Hl + 2 * Hkvl) * D; }
};

// Backward temporaries shared by all blocks (one block runs backward at a time).
struct Scratch {
  Tensor dn;    // [BT, C]     gradient w.r.t. a norm output
  Tensor datt;  // [BT, Hl D]  gradient w.r.t. the attention output (Note [act-dtype])
  Tensor dqkv;  // [BT, ModelDims::qkv_width()] (Attention::qkv_'s layout; Note [act-dtype])
  // [BT, Hl D] then [BT, Hkvl D]: gradient w.r.t. the QK-normalised q, then k (Attention::qk_'s
  // layout), fp32; under BF16 without RoPE its first half holds them in bf16 (Note [act-dtype]).
  // In a forward with RoPE and bf16 q, k, the fp32 normalised q, k before the rotation.
  Tensor dqk;
  Tensor dh;  // [BT, Fl]    gradient w.r.t. the MLP's activated hidden (the down input)
  // [BT, Fl] gated MLPs: gradient w.r.t. the gate projection's output (Note [act-dtype])
  Tensor dgate;
  Tensor dsub;  // [BT, C]     post-sublayer and sandwich norms: a sublayer's input gradient
  // [BT, C] bf16 when ModelDims::tp_bf16_act: a row-parallel output in forward (read by the
  // residual add right after its all-reduce) and a column-parallel input gradient in backward
  // (widened into fp32 right after its all-reduce), on the bf16 TP wire (Note [bf16 wire])
  Tensor tp_bf16;
  Tensor attn_ws;  // attention backward workspace, sized for attn_threads (CPU: OpenMP threads)
  int attn_threads = 1;
  Tensor dscale;  // [Hl] per-head gradient of the attention scale
  // Note [sequence parallel] (layers/gpt.h), fp32, shared by all blocks:
  Tensor sp_x;     // [BT, C] a sublayer's all-gathered input (forward, and again in backward)
  Tensor sp_dy;    // [BT, C] a sublayer's all-gathered output gradient
  Tensor sp_part;  // [BT, C] a sublayer's partial output or input gradient, before reduce-scatter
  Tensor sp_norm;  // [2 C] a norm's partial weight (and bias) gradient, before its all-reduce
};

struct LayerContext {
  ModelDims dims;
  // Every kernel call goes through it and every tensor is made on its device: layers never ask
  // which device they run on (framework/kernels/exec_context.h).
  kernels::ExecContext* exec = nullptr;
  const Topology* topo = nullptr;
  Scratch* scratch = nullptr;
  Profiler* profiler = nullptr;
  // position == ROPE: cos/sin for positions [0, T), built once by GPT and shared by every layer.
  const kernels::RopeTable* rope = nullptr;

  // The TP region boundaries of this model's sublayers (Note [tp regions] in
  // parallel/tp_regions.h): copy/reduce, or all-gather/reduce-scatter under dims.sp.
  TpRegion region() const {
    return TpRegion(topo->tp_tensors(), dims.sp, dims.tp_bf16_wire, *exec, profiler);
  }

  // A zero-filled tensor on the execution context's device.
  Tensor zeros(Shape shape, DType dtype = DType::kF32) const {
    return Tensor::zeros(std::move(shape), dtype, exec->device());
  }
};

}  // namespace keel
