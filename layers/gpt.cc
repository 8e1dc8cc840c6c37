// GPT model assembly: the blocks, the vocab-parallel embedding and LM head (the loss is
// layers/vocab_parallel_loss.cc).
#include "layers/gpt.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/cuda/bf16.h"
#include "parallel/communicator.h"

namespace keel {

ModelDims ModelDims::from(const config::Model& m, int64_t micro_batch, const Topology& topo) {
  ModelDims d{};
  d.V = m.vocab_size();
  d.C = m.d_model();
  d.H = m.n_heads();
  KEEL_CHECK(d.H > 0 && (m.head_dim() > 0 || d.C % d.H == 0), kConfig, "model.n_heads=", d.H,
             " does not divide model.d_model=", d.C);
  d.D = m.head_dim() > 0 ? m.head_dim() : d.C / d.H;
  d.F = m.d_ff() > 0 ? m.d_ff() : 4 * d.C;
  d.L = m.n_layers();
  d.T = m.seq_len();
  d.P = m.max_positions() > 0 ? m.max_positions() : d.T;
  KEEL_CHECK(d.T <= d.P, kConfig, "model.seq_len=", d.T, " exceeds model.max_positions=", d.P,
             " (the position table)");
  d.B = micro_batch;
  const int tp = topo.tp;
  KEEL_CHECK(d.H % tp == 0, kLayout, "parallel.tp=", tp, " does not divide model.n_heads=", d.H);
  KEEL_CHECK(d.F % tp == 0, kLayout, "parallel.tp=", tp, " does not divide model.d_ff=", d.F);
  // Note [vocab padding]: under TP the vocabulary is padded to a multiple of 64 x tp so it splits
  // evenly; padded rows are never looked up (tokens < V) and their logits are excluded from the
  // loss, so every layout computes the same function. tp = 1 keeps the exact [V, C] table.
  d.Vp = tp == 1 ? d.V : (d.V + 64 * tp - 1) / (64 * tp) * (64 * tp);
  d.Hl = d.H / tp;
  d.Fl = d.F / tp;
  d.Vl = d.Vp / tp;
  d.v_begin = topo.tp_rank * d.Vl;
  d.v_valid = std::clamp<int64_t>(d.V - d.v_begin, 0, d.Vl);
  d.tp_rank = topo.tp_rank;
  d.tp = tp;
  // Note [gqa layouts] (layers/attention.h).
  d.Hkv = m.n_kv_heads() > 0 ? m.n_kv_heads() : d.H;
  KEEL_CHECK(d.Hkv <= d.H && d.H % d.Hkv == 0, kConfig, "model.n_kv_heads=", d.Hkv,
             " does not divide model.n_heads=", d.H);
  KEEL_CHECK(d.Hkv % tp == 0 || tp % d.Hkv == 0, kLayout, "model.n_kv_heads=", d.Hkv,
             " and parallel.tp=", tp,
             ": k/v heads must be a multiple of tp (sharded) or divide it (replicated)");
  d.kv_replicated = d.Hkv % tp != 0;
  d.Hkvl = d.kv_replicated ? d.Hkv : d.Hkv / tp;
  // Replicated: this rank's query heads [tp_rank Hl, (tp_rank + 1) Hl) all lie in one group of
  // H / Hkv (tp % Hkv == 0), whose k/v head they read.
  d.kv_attn_head0 = d.kv_replicated ? topo.tp_rank * d.Hl / (d.H / d.Hkv) : 0;
  d.kv_attn_heads = d.kv_replicated ? 1 : d.Hkvl;
  d.qk_norm = m.qk_norm();
  d.qk_scope = m.qk_norm_scope();
  d.norm = m.norm();
  d.tied = m.tie_embeddings();
  d.init_std = m.init_std();
  d.position = m.position();
  d.rope_theta = m.rope_theta();
  d.mlp = m.mlp();
  d.bias = m.bias();
  d.post_norm = m.norm_placement() == config::POST_SUBLAYER;
  d.sandwich = m.norm_placement() == config::SANDWICH;
  return d;
}

// ---- Block -------------------------------------------------------------------------------------

Block::Block(const std::string& prefix, ParamStore& ps, const LayerContext& ctx)
    : ctx_(ctx),
      ln1_(prefix + ".ln1", ps, ctx),
      ln2_(prefix + ".ln2", ps, ctx),
      attn_(prefix + ".attn", ps, ctx),
      mlp_(prefix + ".mlp", ps, ctx) {
  if (ctx.dims.sandwich) {
    ln1_post_ = std::make_unique<Norm>(prefix + ".ln1_post", ps, ctx);
    ln2_post_ = std::make_unique<Norm>(prefix + ".ln2_post", ps, ctx);
  }
}

void Block::allocate(const LayerContext& ctx, const Block* share) {
  const Shape s{ctx.dims.rows(ctx.dims.B), ctx.dims.C};
  out_ = ctx.zeros(s);
  if (share != nullptr) {
    ln1_.allocate(ctx, &share->ln1_);
    ln2_.allocate(ctx, &share->ln2_);
    attn_.allocate(ctx, &share->attn_);
    mlp_.allocate(ctx, &share->mlp_);
    n1_ = share->n1_;
    r1_ = share->r1_;
    n2_ = share->n2_;
    if (ctx.dims.sandwich) {
      ln1_post_->allocate(ctx, share->ln1_post_.get());
      ln2_post_->allocate(ctx, share->ln2_post_.get());
      s1_ = share->s1_;
      s2_ = share->s2_;
    }
    return;
  }
  ln1_.allocate(ctx);
  ln2_.allocate(ctx);
  attn_.allocate(ctx);
  mlp_.allocate(ctx);
  if (ctx.dims.sandwich) {
    ln1_post_->allocate(ctx);
    ln2_post_->allocate(ctx);
    s1_ = ctx.zeros(s);
    s2_ = ctx.zeros(s);
  }
  // Note [act-dtype]: with pre-sublayer norms n1_ and n2_ hold the norm outputs, which only the
  // sublayers' input projections read; post-sublayer, the norms' fp32 inputs. Under SP (Note
  // [sequence parallel]) fp32 rows, which the fp32 all-gathers read.
  const DType norm_out = ctx.dims.post_norm || ctx.dims.sp ? DType::kF32 : ctx.exec->act_dtype();
  n1_ = ctx.zeros(s, norm_out);
  r1_ = ctx.zeros(s);
  n2_ = ctx.zeros(s, norm_out);
}

// One body per norm placement for every layout: the sublayers enter and leave the TP region
// themselves (Note [tp regions] in parallel/tp_regions.h), so x, out and the saved activations are
// this rank's rows of the stream, all B T rows or, under SP, rows(B) (Note [sequence parallel]).
void Block::forward(const float* x, int64_t B, float* max_logit) {
  const int64_t n = ctx_.dims.rows(B) * ctx_.dims.C;
  kernels::ExecContext& ex = *ctx_.exec;
  if (ctx_.dims.post_norm) {
    // r1 = x + ln1(attn(x)); out = r1 + ln2(mlp(r1)). n1_, n2_ keep the sublayer outputs (the
    // norms' inputs, which their backward reads); the norm outputs pass through out_.
    attn_.forward(x, n1_.f32(), B, max_logit);
    ln1_.forward(n1_.f32(), out_.f32(), B);
    ex.add(r1_.f32(), x, out_.f32(), n);
    mlp_.forward(r1_.f32(), n2_.f32(), B);
    ln2_.forward(n2_.f32(), out_.f32(), B);
    ex.add_inplace(out_.f32(), r1_.f32(), n);
    return;
  }
  if (ctx_.dims.sandwich) {
    // Note [sandwich norms]: r1 = x + ln1_post(attn(ln1(x))); out = r1 + ln2_post(mlp(ln2(r1))).
    // n1_, n2_ keep the pre-norm outputs (the sublayer inputs), s1_, s2_ the sublayer outputs
    // (the post-norms' inputs); the post-norm outputs pass through out_.
    ln1_.forward(x, kernels::act(n1_), B);
    attn_.forward(kernels::act(n1_), s1_.f32(), B, max_logit);
    ln1_post_->forward(s1_.f32(), out_.f32(), B);
    ex.add(r1_.f32(), x, out_.f32(), n);
    ln2_.forward(r1_.f32(), kernels::act(n2_), B);
    mlp_.forward(kernels::act(n2_), s2_.f32(), B);
    ln2_post_->forward(s2_.f32(), out_.f32(), B);
    ex.add_inplace(out_.f32(), r1_.f32(), n);
    return;
  }
  // r1 = x + attn(ln1(x)); out = r1 + mlp(ln2(r1)). n1_, n2_ keep the norm outputs (the sublayer
  // inputs); the attention and MLP outputs pass through out_ before the residual adds, or, on the
  // bf16 TP wire, through the bf16 scratch the all-reduce sums in place (Note [bf16 wire]).
  ln1_.forward(x, kernels::act(n1_), B);
  const bool bf16_y = ctx_.dims.tp_bf16_act;
  const kernels::ActOut y =
      bf16_y ? kernels::act(ctx_.scratch->tp_bf16) : kernels::ActOut(out_.f32());
  attn_.forward(kernels::act(n1_), y, B, max_logit);
  ex.add(r1_.f32(), x, y, n);
  ln2_.forward(r1_.f32(), kernels::act(n2_), B);
  mlp_.forward(kernels::act(n2_), y, B);
  if (bf16_y) {
    ex.add(out_.f32(), r1_.f32(), y, n);
  } else {
    ex.add_inplace(out_.f32(), r1_.f32(), n);
  }
}

void Block::backward(const float* x, float* dres, int64_t B) {
  float* dn = ctx_.scratch->dn.f32();
  if (ctx_.dims.post_norm) {
    // A sublayer's input gradient is summed over TP before it joins the residual gradient, so it
    // is written to dsub and added, never accumulated into dres by the sublayer.
    const int64_t n = ctx_.dims.rows(B) * ctx_.dims.C;
    float* dsub = ctx_.scratch->dsub.f32();
    ln2_.backward(n2_.f32(), dres, dn, /*accumulate=*/false, B);
    mlp_.backward(r1_.f32(), dn, dsub, B);
    ctx_.exec->add_inplace(dres, dsub, n);
    ln1_.backward(n1_.f32(), dres, dn, /*accumulate=*/false, B);
    attn_.backward(x, dn, dsub, B);
    ctx_.exec->add_inplace(dres, dsub, n);
    return;
  }
  if (ctx_.dims.sandwich) {
    // dres = d(out) = d(r1) through the residual; each post-norm's gradient is written to dn,
    // the sublayer's input gradient (summed over TP by the sublayer) to dsub, and the pre-norm
    // adds its input gradient into dres.
    float* dsub = ctx_.scratch->dsub.f32();
    ln2_post_->backward(s2_.f32(), dres, dn, /*accumulate=*/false, B);
    mlp_.backward(kernels::act(n2_), dn, dsub, B);
    ln2_.backward(r1_.f32(), dsub, dres, /*accumulate=*/true, B);
    ln1_post_->backward(s1_.f32(), dres, dn, /*accumulate=*/false, B);
    attn_.backward(kernels::act(n1_), dn, dsub, B);
    ln1_.backward(x, dsub, dres, /*accumulate=*/true, B);
    return;
  }
  mlp_.backward(kernels::act(n2_), dres, dn, B);
  ln2_.backward(r1_.f32(), dn, dres, /*accumulate=*/true, B);
  attn_.backward(kernels::act(n1_), dres, dn, B);
  ln1_.backward(x, dn, dres, /*accumulate=*/true, B);
}

// ---- GPT ---------------------------------------------------------------------------------------

bool tp_comm_bf16(const config::Parallel& p, kernels::Precision precision) {
  // Note [sequence parallel]: its all-gathers and reduce-scatters move fp32.
  if (p.sequence_parallel()) return false;
  const std::string w = upper_ascii(p.tp_comm_dtype());
  if (w == "BF16") return true;
  if (w == "FP32") return false;
  return precision == kernels::Precision::kBf16;  // AUTO (or unset)
}

GPT::GPT(const config::KeelConfig& cfg, const Topology& topo, int64_t micro_batch,
         kernels::ExecContext& exec) {
  ctx_.dims = ModelDims::from(cfg.model(), micro_batch, topo);
  ctx_.dims.sp = cfg.parallel().sequence_parallel() && topo.tp > 1;
  KEEL_CHECK(!ctx_.dims.sp || ctx_.dims.T % topo.tp == 0, kLayout,
             "parallel.sequence_parallel: parallel.tp=", topo.tp,
             " does not divide model.seq_len=", ctx_.dims.T);
  ctx_.dims.tp_bf16_wire = tp_comm_bf16(cfg.parallel(), exec.precision());
  ctx_.dims.tp_bf16_act = ctx_.dims.tp_bf16_wire && topo.tp > 1 && exec.act_dtype() == DType::kBF16;
  ctx_.exec = &exec;
  ctx_.topo = &topo;
  ctx_.scratch = &scratch_;
  ctx_.profiler = &profiler_;
  const ModelDims& d = ctx_.dims;

  declare_parameters();
  // The arena is padded to a multiple of dp so ZeRO-1 can split it evenly.
  ps_.allocate(topo.tp_rank, topo.tp, topo.dp, exec.device());
  if (d.position == config::ROPE) {
    rope_ = kernels::make_rope_table(d.T, d.D, d.rope_theta);
    ctx_.rope = &rope_;
  }

  // Note [recompute]: blocks 1 ... N-1 reuse block 0's saved activations.
  recompute_ = cfg.train().recompute_layers();
  KEEL_CHECK(recompute_ >= 0 && recompute_ <= d.L, kConfig, "train.recompute_layers=", recompute_,
             " must be in [0, model.n_layers=", d.L, "]");
  for (int64_t l = 0; l < d.L; ++l) {
    blocks_[l]->allocate(ctx_, l > 0 && l < recompute_ ? blocks_[0].get() : nullptr);
  }
  ln_f_->allocate(ctx_);
  const int64_t BT = d.BT(), C = d.C, HD = d.Hl * d.D, rows = d.rows(d.B);
  tokens_ = ctx_.zeros({BT}, DType::kI32);
  targets_ = ctx_.zeros({BT}, DType::kI32);
  x0_ = ctx_.zeros({rows, C});
  // Note [act-dtype]: only the LM head's GEMMs read the final norm's output (all-gathered in fp32
  // under SP: Note [sequence parallel]).
  xf_ = ctx_.zeros({BT, C}, d.sp ? DType::kF32 : exec.act_dtype());
  // Note [act-dtype]: bf16 under BF16 on a device (only the head's GEMMs and the loss read it).
  logits_ = ctx_.zeros({BT, d.Vl}, exec.act_dtype());
  loss_ = std::make_unique<VocabParallelLoss>(ctx_, cfg.loss().z_loss());
  dres_ = ctx_.zeros({rows, C});
  scratch_.dn = ctx_.zeros({rows, C});
  scratch_.datt = ctx_.zeros({BT, HD}, exec.act_dtype());             // Note [act-dtype]
  scratch_.dqkv = ctx_.zeros({BT, d.qkv_width()}, exec.act_dtype());  // Note [act-dtype]
  if (d.qk_norm != config::NONE) scratch_.dqk = ctx_.zeros({BT, (d.Hl + d.Hkvl) * d.D});
  // Note [act-dtype]: GELU's backward reads the activated hidden's gradient in bf16.
  scratch_.dh = ctx_.zeros({BT, d.Fl}, d.gated_mlp() ? DType::kF32 : exec.act_dtype());
  if (d.gated_mlp()) scratch_.dgate = ctx_.zeros({BT, d.Fl}, exec.act_dtype());
  if (d.post_norm || d.sandwich) scratch_.dsub = ctx_.zeros({rows, C});
  if (d.sp) {
    scratch_.sp_x = ctx_.zeros({BT, C});
    scratch_.sp_dy = ctx_.zeros({BT, C});
    scratch_.sp_part = ctx_.zeros({BT, C});
    scratch_.sp_norm = ctx_.zeros({2 * C});
  }
  if (d.tp_bf16_act) scratch_.tp_bf16 = ctx_.zeros({BT, C}, DType::kBF16);
  scratch_.attn_threads = exec.threads();
  const kernels::AttentionShape as{d.B, d.T, d.Hl, d.D, 0, 0, 0, 0, scratch_.attn_threads};
  scratch_.attn_ws = ctx_.zeros({std::max<int64_t>(1, exec.attention_workspace_elems(as))});
  scratch_.dscale = ctx_.zeros({d.Hl});
  // Note [forward stats]: the loss's 3 sums, L f32 maxima in ceil(L / 2) slots, L act_sq.
  fwd_stats_ = ctx_.zeros({act_sq_offset() + d.L}, DType::kF64);
  fwd_stats_host_.resize(static_cast<size_t>(fwd_stats_.numel()));
}

// The parameters in the order checkpoints and the arenas list them: wte (wpe), each block's, ln_f
// (lm_head).
void GPT::declare_parameters() {
  const ModelDims& d = ctx_.dims;
  // Vocab-parallel embedding: rows [v_begin, v_begin + Vl) of the logical [V, C] table.
  wte_ = ps_.add({"wte", {d.Vp, d.C}, 0, ParamInit::kNormal, d.init_std, true, false, d.V});
  // RoPE encodes positions in attention: no position table.
  if (d.position != config::ROPE) {
    wpe_ = ps_.add({"wpe", {d.P, d.C}, -1, ParamInit::kNormal, d.init_std, true});
  }
  for (int64_t l = 0; l < d.L; ++l) {
    const int first = ps_.size();
    blocks_.push_back(std::make_unique<Block>("blocks." + std::to_string(l), ps_, ctx_));
    block_params_.emplace_back(first, ps_.size());
  }
  const int head_first = ps_.size();
  ln_f_ = std::make_unique<Norm>("ln_f", ps_, ctx_);
  if (!d.tied) {
    lm_head_ = ps_.add(
        {"lm_head.weight", {d.Vp, d.C}, 0, ParamInit::kNormal, d.init_std, true, false, d.V});
  }
  head_params_ = {head_first, ps_.size()};
}

GPT::GPT(const config::KeelConfig& cfg, const Topology& topo, DeclareOnly) {
  ctx_.dims = ModelDims::from(cfg.model(), /*micro_batch=*/1, topo);
  ctx_.topo = &topo;
  declare_parameters();
}

int64_t GPT::count_parameters(const config::KeelConfig& cfg) {
  std::unique_ptr<Communicator> self_tp, self_dp;
  const Topology single = Topology::single(self_tp, self_dp);
  const GPT declared(cfg, single, DeclareOnly{});
  int64_t n = 0;
  for (int id = 0; id < declared.ps_.size(); ++id) {
    const ParamSpec& spec = declared.ps_.info(id).spec;
    Shape shape = spec.logical;
    if (spec.valid_rows > 0) shape[0] = spec.valid_rows;  // the vocabulary, unpadded
    n += shape_numel(shape);
  }
  return n;
}

std::vector<float> GPT::logits_row(int64_t row) const {
  const int64_t V = logits_.dim(1);
  KEEL_CHECK(row >= 0 && row < logits_.dim(0), kInternal, "GPT::logits_row: row ", row,
             " outside [0, ", logits_.dim(0), ")");
  std::vector<float> out(static_cast<size_t>(V));
  if (logits_.dtype() == DType::kBF16) {
    std::vector<Bf16> bits(out.size());
    logits_.copy_to_host(row * V, V, bits.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = from_bf16(bits[i]);
  } else {
    logits_.copy_to_host(row * V, V, out.data());
  }
  return out;
}

float* GPT::head_weight() { return ps_.param(lm_head_ >= 0 ? lm_head_ : wte_); }
float* GPT::head_grad() { return ps_.grad(lm_head_ >= 0 ? lm_head_ : wte_); }

LossStats GPT::forward(const int32_t* tokens, const int32_t* targets, int64_t B,
                       std::optional<float> loss_weight) {
  const ModelDims& d = ctx_.dims;
  KEEL_ASSERT(B >= 1 && B <= d.B);
  const int64_t BT = B * d.T, C = d.C, n = d.rows(B) * C;
  last_B_ = B;
  loss_->reset();
  // From here on only the model's own buffers are read (device memory on a GPU backend).
  ctx_.exec->load_tokens(tokens_.i32(), tokens, BT);
  if (targets) ctx_.exec->load_tokens(targets_.i32(), targets, BT);
  const TpRegion region = ctx_.region();
  {
    // Note [tp regions]: the vocab-parallel embedding leaves the region. Each rank looks up the
    // rows of its vocabulary shard (the others' are zero) for all B T tokens; exit() sums them
    // into this rank's rows. Under SP the position table joins the partial sums once (TP rank
    // 0, as a row-parallel bias: a rank's rows need not be whole sequences); otherwise it is
    // added after the sum.
    float* part = region.partial(x0_.f32(), scratch_.sp_part.f32());
    {
      ProfileScope p(&profiler_, "embedding");
      ctx_.exec->embedding_forward(part, tokens_.i32(), BT, ps_.param(wte_), d.v_begin, d.Vl, C);
      if (wpe_ >= 0 && d.sp && d.tp_rank == 0) {
        ctx_.exec->position_forward(part, ps_.param(wpe_), B, d.T, C);
      }
    }
    region.exit(part, x0_.f32(), n);
    if (wpe_ >= 0 && !d.sp) {
      ProfileScope p(&profiler_, "embedding");
      ctx_.exec->position_forward(x0_.f32(), ps_.param(wpe_), B, d.T, C);
    }
  }
  const float* x = x0_.f32();
  for (size_t l = 0; l < blocks_.size(); ++l) {
    blocks_[l]->forward(x, B, max_logits() + l);
    x = blocks_[l]->out();
    if (record_act_) ctx_.exec->sum_squares(x, n, act_sq() + l, /*accumulate=*/false);
  }
  // Note [tp regions]: the vocab-parallel LM head enters the region: the final norm's rows, which
  // under SP go through sp_part (free until the head's backward) to be gathered into xf_.
  const kernels::ActOut xf_rows =
      d.sp ? kernels::ActOut(scratch_.sp_part.f32()) : kernels::act(xf_);
  ln_f_->forward(x, xf_rows, B);
  const kernels::ActIn xf = region.enter(xf_rows, kernels::act(xf_), n);
  {
    ProfileScope p(&profiler_, "matmul.lm_head");
    ctx_.exec->linear_forward(kernels::act(logits_), xf, head_weight(), nullptr, BT, C, d.Vl);
  }
  if (targets) loss_->forward(kernels::act(logits_), targets_.i32(), BT, loss_weight, loss_sums());
  // Note [forward stats]: the forward's one read from the device (which waits for it), after the
  // loss's kernels and collectives were enqueued: its sums, the layers' maxima and (recording)
  // their output norms.
  const int64_t L = static_cast<int64_t>(blocks_.size());
  double* host = fwd_stats_host_.data();
  if (targets || L > 0) {
    fwd_stats_.copy_to_host(0, record_act_ ? act_sq_offset() + L : 3 + (L + 1) / 2, host);
  }
  LossStats stats;
  if (targets) {
    const TokenLoss loss = loss_->finish(host, BT);
    stats.ce = loss.ce;
    stats.z_loss = loss.z_loss;
    stats.log_z = loss.log_z;
  }
  if (L > 0) {
    std::vector<float>& maxima = stats.max_attn_logit_layers;
    maxima.resize(static_cast<size_t>(L));
    std::memcpy(maxima.data(), host + 3, maxima.size() * sizeof(float));
    for (float m : maxima) stats.max_attn_logit = std::max(stats.max_attn_logit, m);
  }
  if (record_act_ && L > 0) {
    stats.act_sq_layers.assign(host + act_sq_offset(), host + act_sq_offset() + L);
  }
  return stats;
}

void GPT::backward(float loss_weight) {
  const ModelDims& d = ctx_.dims;
  const int64_t B = last_B_, BT = B * d.T, C = d.C, n = d.rows(B) * C;
  const TpRegion region = ctx_.region();
  loss_->backward(kernels::act(logits_), targets_.i32(), BT, loss_weight);
  float* dxf = scratch_.dn.f32();
  // The LM head is column-parallel over vocab: its input gradient is a partial sum, which
  // enter_backward() sums into this rank's rows of dxf. On the bf16 TP wire it is written in bf16
  // for the all-reduce, then widened (Note [bf16 wire]).
  const kernels::ActOut dxo =
      region.partial(d.tp_bf16_act ? kernels::act(scratch_.tp_bf16) : kernels::ActOut(dxf),
                     scratch_.sp_part.f32());
  {
    ProfileScope p(&profiler_, "matmul.lm_head");
    ctx_.exec->linear_backward(dxo, false, head_grad(), nullptr, kernels::act(logits_),
                               kernels::act(xf_), head_weight(), BT, C, d.Vl);
  }
  region.enter_backward(dxo, dxf, n);
  const float* x_last = blocks_.empty() ? x0_.f32() : blocks_.back()->out();
  ln_f_->backward(x_last, dxf, dres_.f32(), /*accumulate=*/false, B);
  notify(head_params_.first, head_params_.second);
  for (int64_t l = d.L - 1; l >= 0; --l) {
    const float* x = l == 0 ? x0_.f32() : blocks_[l - 1]->out();
    // Note [recompute]: the shared activations hold block recompute_ - 1's; rebuild this one's.
    if (l + 1 < recompute_) blocks_[l]->forward(x, B, max_logits() + l);
    blocks_[l]->backward(x, dres_.f32(), B);
    notify(block_params_[l].first, block_params_[l].second);
  }
  // The embedding's exit, backward: every row's gradient (gathered under SP, so every rank
  // computes the whole position-table gradient, as without SP).
  const float* dx0 = region.exit_backward(dres_.f32(), scratch_.sp_dy.f32(), n);
  {
    ProfileScope p(&profiler_, "embedding");
    ctx_.exec->embedding_backward(ps_.grad(wte_), dx0, tokens_.i32(), BT, d.v_begin, d.Vl, C);
    if (wpe_ >= 0) ctx_.exec->position_backward(ps_.grad(wpe_), dx0, B, d.T, C);
  }
  notify(wte_, wte_ + 1);
  if (wpe_ >= 0) notify(wpe_, wpe_ + 1);
}

}  // namespace keel
