// The GPT model: token embedding (+ a learned position embedding, or RoPE inside attention),
// n_layers blocks (QK-norm attention, GELU or gated MLP; norms before each sublayer, or after it
// as OLMo 2), final norm, LM head (tied to the token embedding or not) and the loss:
// mean token cross-entropy plus z-loss  z_coef * mean(logsumexp(logits)^2), reported separately.
// Forward saves what backward needs; backward accumulates parameter gradients (+=), so several
// micro-batches accumulate into one optimizer step.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "framework/config/keel.pb.h"
#include "layers/attention.h"
#include "layers/context.h"
#include "layers/mlp.h"
#include "layers/norm.h"
#include "layers/params.h"
#include "layers/vocab_parallel_loss.h"

namespace keel {

// Note [sandwich norms]
// ~~~~~~~~~~~~~~~~~~~~~
// model.norm_placement = SANDWICH (Gemma 2 and 3) norms each sublayer's input and its output, each
// with its own gain: r1 = x + ln1_post(attn(ln1(x))), out = r1 + ln2_post(mlp(ln2(r1))). The
// post-norms (parameters blocks.N.ln1_post.*, ln2_post.*) act on the sublayer outputs after the
// sublayers leave the TP region, so they hold this rank's rows of the stream and are replicated
// under TP like ln1 and ln2. A block saves its pre-norm outputs as PRE does (n1_, n2_) and the
// sublayer outputs (s1_, s2_, fp32) that the post-norms' backward reads.

class Block {
 public:
  Block(const std::string& prefix, ParamStore& ps, const LayerContext& ctx);
  // share: a block whose saved activations this one reuses, keeping only its own output (Note
  // [recompute]).
  void allocate(const LayerContext& ctx, const Block* share = nullptr);
  // Writes out(); *max_logit (=, device memory) the largest |attention logit| of the block.
  // Deterministic: run again on the same x it rewrites every saved activation bit for bit (and
  // repeats its TP collectives), which is what recomputation relies on.
  void forward(const float* x, int64_t B, float* max_logit);
  // On entry dres = d(out); on exit dres = d(x).
  // x, out, dres and the saved activations are this rank's rows of the stream (Note [sequence
  // parallel]); the sublayers enter and leave the TP region (Note [tp regions]).
  void backward(const float* x, float* dres, int64_t B);
  const float* out() const { return out_.f32(); }

 private:
  const LayerContext& ctx_;
  Norm ln1_, ln2_;
  Attention attn_;
  Mlp mlp_;
  // SANDWICH only (Note [sandwich norms]): the norms of the attention and MLP outputs.
  std::unique_ptr<Norm> ln1_post_, ln2_post_;
  // [BT, C] each. Pre-norm: n1 = ln1(x), n2 = ln2(r1); post-norm: n1 = attn(x), n2 = mlp(r1);
  // r1 = the residual stream between the sublayers. Under SP: [rows(B), C] each, all fp32.
  Tensor n1_, r1_, n2_, out_;
  Tensor s1_, s2_;  // SANDWICH: the attention and MLP outputs, the post-norms' inputs
};

struct LossStats {
  double ce = 0.0;              // mean cross-entropy, nats/token
  double z_loss = 0.0;          // z_coef * mean(lse^2), the term added to the loss
  double log_z = 0.0;           // mean(lse): the output-logit scale z-loss pulls towards 0
  float max_attn_logit = 0.0f;  // largest |scaled q.k| of the forward, over layers and heads
  // [n_layers]: each block's largest |scaled q.k| (over this TP rank's heads)
  std::vector<float> max_attn_logit_layers;
  // [n_layers], with GPT::set_record_activation_norms only: the sum of squares of each block's
  // output over this rank's rows of the residual stream (empty otherwise)
  std::vector<double> act_sq_layers;
};

// Note [recompute]
// ~~~~~~~~~~~~~~~~
// train.recompute_layers = N trades compute for activation memory, as Megatron-LM's full
// recomputation (--recompute-granularity full) and torchtitan's activation checkpointing do. Blocks
// 0 ... N-1 share one set of saved activations (every tensor Block, Attention, Mlp and Norm keep
// for backward) and keep only their own output, which the next block reads as its input. Backward
// reaches them last-first: before block l < N-1 runs backward, its forward runs again on its input
// into the shared set; block N-1, the last to run forward, still holds its activations there and
// is not recomputed. So N blocks cost one block's activations plus N outputs of [BT, C] fp32, for
// N-1 extra block forwards per micro-batch: about a third more compute at N = n_layers, and on TP
// 2 (N-1) more all-reduces of BT x C (plus PROJ scope's statistics), counted in the bytes formula.
// The forward is deterministic (no dropout; the same kernels, shapes and thread counts), so the
// gradients equal those without recomputation bit for bit (tests/layers/device_neutral_test and,
// on a GPU, tests/gpu/train_step_test assert it).
// N = 1 changes nothing.

// Note [sequence parallel]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// parallel.sequence_parallel (tp > 1) is Megatron-LM's sequence parallelism (Korthikanti et al.
// 2022, "Reducing Activation Recomputation in Large Transformer Models"). Without it every TP rank
// holds the whole micro-batch in the regions between the tensor-parallel sublayers: the residual
// stream, the block and final norms and their outputs, 4 [BT, C] tensors a block, which TP does not
// shrink. With it, each rank holds rows(B) = BT / tp of the token rows there (rank r: rows
// [r BT / tp, (r + 1) BT / tp) of the [B, T] batch, so model.seq_len must divide by tp), and:
// - each sublayer's input is all-gathered into the shared [BT, C] scratch sp_x before its
//   column-parallel projection, and its row-parallel partial output (sp_part) is reduce-scattered
//   to the rank's rows instead of all-reduced: Megatron's all-gather / reduce-scatter pair in
//   place of copy / reduce at the same region boundaries (Note [tp regions] in
//   parallel/tp_regions.h), so the block and its sublayers are written once for both;
// - in backward the output gradient is all-gathered (sp_dy) and the partial input gradient
//   reduce-scattered; the sublayer's input is all-gathered again rather than kept whole (as
//   Megatron does), so a block saves 4 [BT / tp, C] tensors instead of 4 [BT, C];
// - the embedding's vocab-parallel partial sums (plus, on TP rank 0, the position table) are
//   reduce-scattered; the final norm's rows are all-gathered for the vocab-parallel LM head, whose
//   partial input gradient is reduce-scattered; the residual gradient is all-gathered for the
//   embedding's backward, so every rank computes the whole position-table gradient as before;
// - a norm's weight and bias gradients from its rows are partial: all-reduced over TP per
//   micro-batch (C or 2C floats) before they are accumulated.
// Attention, QK-norm (any scope) and the loss act on all BT rows as before. Bytes on the wire:
// per block forward 2 all-gathers and 2 reduce-scatters, backward 4 and 2, each counted as the
// whole [BT, C] buffer (Communicator::bytes_moved), against 2 + 2 all-reduces without SP; in a
// ring an all-reduce moves twice a reduce-scatter's bytes, so SP's forward costs what the
// all-reduces did and its backward 1.5 times (the two re-gathers). The collectives move fp32
// (AUTO resolves to FP32; BF16 is refused): bf16 all-gathers and reduce-scatters are future work.
// The same model to fp32 rounding: tests/parallel/tp_dp_equivalence_test (SP cases) and
// tests/parallel/comm_volume_test (the bytes).

// Note [forward stats]
// ~~~~~~~~~~~~~~~~~~~~
// What a forward reports (LossStats) is computed on the device and read back to the host once per
// forward, after the loss: a read waits for the stream, so every read mid-forward would be a host
// wait that leaves the device idle while the host catches up. GPT owns one small device buffer,
// fwd_stats_, laid out as
//   [0, 3)            f64  the loss's sums (VocabParallelLoss::forward writes, finish() reads)
//   3 + [0, L)        f32  each block's max |attention logit|, packed two to an f64 slot
//   3 + ceil(L/2) + l f64  block l's output sum of squares (set_record_activation_norms)
// The blocks and the loss write their parts as their kernels finish (the loss after its TP
// all-reduces), and one copy_to_host of the prefix a forward needs (the act_sq part only while
// recording) fills both TokenLoss and LossStats. The values are those the separate reads returned,
// bit for bit: only the read moved. 3 f64 and L f32 fit the device's pinned readback buffer
// (kPinnedReadbackBytes, 4 KiB) up to L = 1018, with act_sq up to L = 339, so the read is one
// stream wait on a GPU. A forward without targets reads the maxima (and act_sq) the same way.
// The CUDA emulator's StepBudget test counts the waits (3 a logged step: this read, the gradient
// norm, the step's end; docs/gpu.md, "Budgets the emulator counts").

// parallel.tp_comm_dtype resolved: whether the TP activation all-reduces move bf16 (Note [bf16
// wire] in parallel/communicator.h); AUTO means under the BF16 precision.
bool tp_comm_bf16(const config::Parallel& p, kernels::Precision precision);

class GPT {
 public:
  // micro_batch: sequences per forward; a forward may use fewer (B <= micro_batch). Parameters,
  // activations and gradients live on exec's device and every kernel runs through exec, which
  // must outlive the model.
  GPT(const config::KeelConfig& cfg, const Topology& topo, int64_t micro_batch,
      kernels::ExecContext& exec = kernels::cpu_exec());
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  // The number of parameters of cfg's model (validated): every logical tensor's elements with the
  // vocabulary unpadded, what a published parameter count counts. The parameters are declared as
  // the constructor declares them and never allocated, so any size costs microseconds.
  static int64_t count_parameters(const config::KeelConfig& cfg);

  void init(uint64_t seed) { ps_.init(seed); }
  ParamStore& params() { return ps_; }
  const ModelDims& dims() const { return ctx_.dims; }
  kernels::ExecContext& exec() const { return *ctx_.exec; }
  Profiler& profiler() { return profiler_; }

  // tokens, targets: [B, T]. targets may be null (inference: logits only, no loss).
  // loss_weight: the weight the backward of this forward will take, when the caller knows it (a
  // training step). Then, unless the vocabulary is sharded over TP, the loss's gradient is computed
  // in the loss's own pass over the logits (ExecContext::xent_fused: one read of them instead of
  // three on a GPU), replacing the logits; backward must then be given the same weight.
  LossStats forward(const int32_t* tokens, const int32_t* targets, int64_t B,
                    std::optional<float> loss_weight = std::nullopt);
  // Gradient of (loss_weight * (ce + z_loss)) of the last forward, accumulated into params().grads.
  void backward(float loss_weight);
  // [B T, V_local] logits of the last forward (valid until backward, or a forward given a
  // loss_weight, overwrites them with their gradient), on the
  // execution context's device, in its act_dtype() (bf16 under BF16 on a GPU: Note [act-dtype]):
  // read them on the host with Tensor::copy_to_host, or a row as floats with logits_row.
  const Tensor& logits() const { return logits_; }
  // Row `row` < B T of logits() on the host as V_local floats (bf16 ones widened exactly).
  std::vector<float> logits_row(int64_t row) const;

  // Called during backward with each parameter id as soon as its gradient is complete for this
  // backward (DP gradient sync starts its buckets from here). Empty: no calls.
  void set_grad_ready_hook(std::function<void(int)> hook) { ready_hook_ = std::move(hook); }

  // While on, forward also sums the squares of each block's output (LossStats::act_sq_layers):
  // one reduction per block, read back with the forward's other statistics (Note [forward stats]),
  // for the spike forensics' evidence.
  void set_record_activation_norms(bool on) { record_act_ = on; }

 private:
  struct DeclareOnly {};
  // count_parameters: ctx_.dims and ctx_.topo set and the parameters declared, nothing allocated.
  GPT(const config::KeelConfig& cfg, const Topology& topo, DeclareOnly);
  void declare_parameters();  // wte (wpe), the blocks, ln_f (lm_head) into ps_

  float* head_weight();
  float* head_grad();

  Profiler profiler_;
  Scratch scratch_;
  LayerContext ctx_;
  ParamStore ps_;
  int wte_, wpe_ = -1, lm_head_ = -1;  // wpe_: LEARNED positions only
  kernels::RopeTable rope_;            // ROPE: cos/sin for positions [0, T), shared by the layers
  std::vector<std::unique_ptr<Block>> blocks_;
  int64_t recompute_ = 0;  // train.recompute_layers: blocks [0, recompute_) share activations
  std::unique_ptr<Norm> ln_f_;
  Tensor tokens_, targets_;  // [BT] int32 copies of the last batch
  Tensor x0_, xf_, logits_;  // [rows(B), C], [BT, C], [BT, Vl]
  Tensor dres_;              // [rows(B), C] residual-stream gradient
  // Note [forward stats]: the loss's sums, each block's max |attention logit| and (record_act_)
  // each block's output sum of squares of the last forward, read back once per forward.
  Tensor fwd_stats_;
  std::vector<double> fwd_stats_host_;  // the host copy (allocated once)
  double* loss_sums() const { return fwd_stats_.f64(); }
  float* max_logits() const { return reinterpret_cast<float*>(fwd_stats_.f64() + 3); }
  int64_t act_sq_offset() const { return 3 + (ctx_.dims.L + 1) / 2; }
  double* act_sq() const { return fwd_stats_.f64() + act_sq_offset(); }
  bool record_act_ = false;
  std::unique_ptr<VocabParallelLoss> loss_;  // its row statistics; logits_ may hold its gradient
  int64_t last_B_ = 0;
  std::vector<std::pair<int, int>> block_params_;  // [first, last) parameter ids of each block
  std::pair<int, int> head_params_;                // ln_f (+ lm_head when untied)
  std::function<void(int)> ready_hook_;
  void notify(int first, int last) {
    if (ready_hook_) {
      for (int id = first; id < last; ++id) ready_hook_(id);
    }
  }
};

}  // namespace keel
