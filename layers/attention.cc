// QK-norm attention: projection, per-head (or per-projection) normalisation of q and k, rotary
// position embedding of q and k (position == ROPE), causal attention, output projection.
// Shapes are written as [rows, columns] of row-major buffers.
#include "layers/attention.h"

#include <cmath>

#include "framework/error.h"

namespace keel {

namespace {
constexpr float kNormEps = 1e-5f;
constexpr float kL2Eps = 1e-6f;

kernels::NormOp qk_op(config::QkNorm q) {
  switch (q) {
    case config::RMS:
      return kernels::NormOp::kRms;
    case config::LAYER:
      return kernels::NormOp::kLayer;
    default:
      return kernels::NormOp::kL2;
  }
}
}  // namespace

Attention::Attention(const std::string& prefix, ParamStore& ps, const LayerContext& ctx)
    : ps_(ps), ctx_(ctx) {
  const ModelDims& d = ctx.dims;
  const float resid_std = d.init_std / std::sqrt(2.0f * static_cast<float>(d.L));
  if (!d.gqa()) {
    qkv_w_ = ps.add(
        {prefix + ".qkv.weight", {3, d.H, d.D, d.C}, 1, ParamInit::kNormal, d.init_std, true});
    if (d.bias) {
      qkv_b_ = ps.add({prefix + ".qkv.bias", {3, d.H, d.D}, 1, ParamInit::kConstant, 0.0f, false});
    }
  } else {
    // Note [gqa layouts]: replicated k/v heads get TP partial gradients, like a shared gain.
    const int kv_shard = d.kv_replicated ? -1 : 1;
    const bool kv_partial = d.kv_replicated;
    qkv_w_ =
        ps.add({prefix + ".q.weight", {d.H, d.D, d.C}, 0, ParamInit::kNormal, d.init_std, true});
    kv_w_ = ps.add({prefix + ".kv.weight",
                    {2, d.Hkv, d.D, d.C},
                    kv_shard,
                    ParamInit::kNormal,
                    d.init_std,
                    true,
                    kv_partial});
    if (d.bias) {
      qkv_b_ = ps.add({prefix + ".q.bias", {d.H, d.D}, 0, ParamInit::kConstant, 0.0f, false});
      kv_b_ = ps.add({prefix + ".kv.bias",
                      {2, d.Hkv, d.D},
                      kv_shard,
                      ParamInit::kConstant,
                      0.0f,
                      false,
                      kv_partial});
    }
  }
  if (d.qk_norm == config::RMS || d.qk_norm == config::LAYER) {
    // HEAD_SHARED: one [D] gain for all heads (replicated under TP); HEAD and PROJECTION: [H, D]
    // for q and [Hkv, D] for k, sharded with the heads (k's replicated with its heads: Note [gqa
    // layouts]).
    const bool shared = d.qk_scope == config::HEAD_SHARED;
    // A shared gain sees only this rank's heads in backward: its gradient is a TP partial sum.
    auto spec = [&](const char* name, float value, int64_t heads, bool replicated) {
      const bool one = shared || replicated;
      return ParamSpec{prefix + name,
                       shared ? Shape{d.D} : Shape{heads, d.D},
                       one ? -1 : 0,
                       ParamInit::kConstant,
                       value,
                       false,
                       one};
    };
    q_norm_w_ = ps.add(spec(".q_norm.weight", 1.0f, d.H, false));
    k_norm_w_ = ps.add(spec(".k_norm.weight", 1.0f, d.Hkv, d.kv_replicated));
    // LAYER's bias follows model.bias like every other bias (without it, LAYER still centres).
    if (d.qk_norm == config::LAYER && d.bias) {
      q_norm_b_ = ps.add(spec(".q_norm.bias", 0.0f, d.H, false));
      k_norm_b_ = ps.add(spec(".k_norm.bias", 0.0f, d.Hkv, d.kv_replicated));
    }
  } else if (d.qk_norm == config::L2) {
    // Henry et al. 2020: g0 = log2(L^2 - L) for training length L.
    const float g0 = std::log2(static_cast<float>(d.T * d.T - d.T));
    const bool per_head = d.qk_scope == config::HEAD;
    qk_scale_ = ps.add({prefix + ".qk_scale", per_head ? Shape{d.H} : Shape{1}, per_head ? 0 : -1,
                        ParamInit::kConstant, g0, false, !per_head});
  }
  proj_w_ =
      ps.add({prefix + ".proj.weight", {d.C, d.H * d.D}, 1, ParamInit::kNormal, resid_std, true});
  if (d.bias) proj_b_ = ps.add({prefix + ".proj.bias", {d.C}, -1, ParamInit::kConstant, 0.0f});
}

void Attention::allocate(const LayerContext& ctx, const Attention* share) {
  if (share != nullptr) {
    qkv_ = share->qkv_;
    qk_ = share->qk_;
    q_mean_ = share->q_mean_;
    q_rstd_ = share->q_rstd_;
    k_mean_ = share->k_mean_;
    k_rstd_ = share->k_rstd_;
    q_stats_ = share->q_stats_;
    k_stats_ = share->k_stats_;
    saved_ = share->saved_;
    att_ = share->att_;
    scales_ = share->scales_;
    return;
  }
  const ModelDims& d = ctx.dims;
  const int64_t HD = d.Hl * d.D;
  // Note [act-dtype]: the projection's output, which only QK-norm, RoPE (without QK-norm) and
  // attention read, in bf16 under BF16.
  qkv_ = ctx.zeros({d.BT(), d.qkv_width()}, ctx.exec->act_dtype());
  const bool projection = d.qk_scope == config::PROJECTION;
  const int64_t q_groups = projection ? 1 : d.Hl, k_groups = projection ? 1 : d.Hkvl;
  if (d.qk_norm != config::NONE) {
    // Note [act-dtype]: only attention (forward and backward) reads the normalised q, k.
    qk_ = ctx.zeros({d.BT(), (d.Hl + d.Hkvl) * d.D}, ctx.exec->act_dtype());
    q_mean_ = ctx.zeros({d.BT() * q_groups});
    q_rstd_ = ctx.zeros({d.BT() * q_groups});
    k_mean_ = ctx.zeros({d.BT() * k_groups});
    k_rstd_ = ctx.zeros({d.BT() * k_groups});
  }
  if (d.qk_scope == config::PROJECTION && d.qk_norm != config::NONE) {
    q_stats_ = ctx.zeros({d.BT(), 2});
    k_stats_ = ctx.zeros({d.BT(), 2});
  }
  // What the forward keeps for the backward: the probabilities on the CPU, the log-sum-exp of a
  // fused GPU kernel (the execution context says how much).
  const kernels::AttentionShape as{d.B, d.T, d.Hl, d.D, 0,
                                   0,   0,   0,    0,   d.gqa() ? d.kv_attn_heads : 0};
  saved_ = ctx.zeros({ctx.exec->attention_saved_elems(as)});
  // Note [act-dtype]: only the output projection and attention's backward read it.
  att_ = ctx.zeros({d.BT(), HD}, ctx.exec->act_dtype());
  scales_ = ctx.zeros({d.Hl});
}

Attention::QkvView Attention::qkv_view(kernels::ActOut base, int64_t B) const {
  const ModelDims& d = ctx_.dims;
  const int64_t HD = d.Hl * d.D, KD = d.Hkvl * d.D;
  if (!d.gqa()) return {base, base.at(HD), base.at(2 * HD), 3 * HD, 3 * HD};
  const kernels::ActOut kv = base.at(B * d.T * HD);
  return {base, kv, kv.at(KD), HD, 2 * KD};
}

kernels::NormShape Attention::qk_norm_shape(int64_t B, int64_t heads, int64_t ld_in) const {
  const ModelDims& d = ctx_.dims;
  const int64_t HD = heads * d.D;
  kernels::NormShape s;
  s.N = B * d.T;
  if (d.qk_scope == config::PROJECTION) {
    s.G = 1;
    s.Cg = HD;
  } else {
    s.G = heads;
    s.Cg = d.D;
  }
  s.ld_in = ld_in;
  s.ld_out = HD;
  s.w_group_stride = d.qk_scope == config::HEAD_SHARED ? 0 : s.Cg;
  return s;
}

void Attention::qk_scales(float* out) const {
  const ModelDims& d = ctx_.dims;
  // L2 QK-norm learns the scale (per head with HEAD scope, else one for all heads); otherwise
  // the usual 1/sqrt(D). The gain is read by a kernel, where the parameter lives.
  const float* gain =
      d.qk_norm == config::L2 ? const_cast<ParamStore&>(ps_).param(qk_scale_) : nullptr;
  ctx_.exec->attention_scales(out, gain, d.Hl, d.qk_scope != config::HEAD,
                              1.0f / std::sqrt(static_cast<float>(d.D)));
}

void Attention::forward(kernels::ActIn x_rows, kernels::ActOut y, int64_t B, float* max_logit) {
  const ModelDims& d = ctx_.dims;
  const int64_t HD = d.Hl * d.D, KD = d.Hkvl * d.D, BT = B * d.T, n = d.rows(B) * d.C;
  Profiler* prof = ctx_.profiler;
  // Note [tp regions]: the column-parallel QKV projection enters the region, the row-parallel
  // output projection leaves it.
  const TpRegion region = ctx_.region();
  const kernels::ActIn x = region.enter(x_rows, ctx_.scratch->sp_x.f32(), n);
  const QkvView raw = qkv_view(kernels::act(qkv_), B);
  {
    ProfileScope p(prof, "matmul.qkv");
    if (!d.gqa()) {
      ctx_.exec->linear_forward(raw.q, x, ps_.param(qkv_w_), ps_.param_or_null(qkv_b_), BT, d.C,
                                3 * HD);
    } else {
      ctx_.exec->linear_forward(raw.q, x, ps_.param(qkv_w_), ps_.param_or_null(qkv_b_), BT, d.C,
                                HD);
      ctx_.exec->linear_forward(raw.k, x, ps_.param(kv_w_), ps_.param_or_null(kv_b_), BT, d.C,
                                2 * KD);
    }
  }
  // q and k as attention reads them: inside qkv_ (row strides raw.ldq, raw.ldkv), or
  // QK-normalised in qk_: q's rows [0, BT) (row stride HD), then k's (row stride KD), bf16 under
  // BF16 (Note [act-dtype]).
  kernels::ActIn q = raw.q, k = raw.k;
  int64_t ldq = raw.ldq, ldk = raw.ldkv;
  const bool rope = d.position == config::ROPE;
  if (d.qk_norm != config::NONE) {
    // With RoPE and bf16 q, k the norm writes fp32 into the backward scratch dqk (free until this
    // layer's backward) and the rotation rounds each value once into qk_; otherwise the norm
    // writes qk_ and RoPE rotates it in place.
    const kernels::ActOut qk = kernels::act(qk_);
    const kernels::ActOut normed =
        rope && qk.dtype != DType::kF32 ? kernels::ActOut(ctx_.scratch->dqk.f32()) : qk;
    {
      ProfileScope p(prof, "qk_norm");
      const kernels::NormShape sq = qk_norm_shape(B, d.Hl, raw.ldq);
      const kernels::NormShape sk = qk_norm_shape(B, d.Hkvl, raw.ldkv);
      const kernels::NormOp op = qk_op(d.qk_norm);
      const float eps = d.qk_norm == config::L2 ? kL2Eps : kNormEps;
      auto w = [&](int id) { return ps_.param_or_null(id); };
      if (d.qk_scope == config::PROJECTION) {
        // The norm spans every head, so its statistics span every TP rank: all-reduce [BT, 2]
        // partial sums, never the activations (a rank holding every k head has k's whole).
        Communicator& tp = ctx_.topo->tp_tensors();
        ctx_.exec->norm_partial_stats(sq, raw.q, q_stats_.f32());
        ctx_.exec->norm_partial_stats(sk, raw.k, k_stats_.f32());
        {
          CommGroup group(tp);  // one launch, one wait (Note [collective groups])
          tp.all_reduce(q_stats_.f32(), 2 * BT, ReduceOp::kSum);
          if (!d.kv_replicated) tp.all_reduce(k_stats_.f32(), 2 * BT, ReduceOp::kSum);
        }
        ctx_.exec->norm_forward_from_stats(op, sq, d.H * d.D, q_stats_.f32(), normed, raw.q,
                                           w(q_norm_w_), w(q_norm_b_), q_mean_.f32(), q_rstd_.f32(),
                                           eps);
        ctx_.exec->norm_forward_from_stats(op, sk, d.Hkv * d.D, k_stats_.f32(), normed.at(BT * HD),
                                           raw.k, w(k_norm_w_), w(k_norm_b_), k_mean_.f32(),
                                           k_rstd_.f32(), eps);
      } else {
        ctx_.exec->norm_forward(op, sq, normed, raw.q, w(q_norm_w_), w(q_norm_b_), q_mean_.f32(),
                                q_rstd_.f32(), eps);
        ctx_.exec->norm_forward(op, sk, normed.at(BT * HD), raw.k, w(k_norm_w_), w(k_norm_b_),
                                k_mean_.f32(), k_rstd_.f32(), eps);
      }
    }
    if (rope) {
      // q and k are rotated after QK-norm (OLMo 2, Qwen3). The norm's backward reads only qkv_'s
      // raw q, k and the saved statistics, and the QKV projection's backward reads x, so nothing
      // needs the unrotated values. Multi-head: k's rows follow q's, so one call rotates both as
      // 2 B sequences (row r is position r mod T either way); grouped-query: k's rows are
      // narrower, so a second call.
      ProfileScope p(prof, "rope");
      const float* nf = static_cast<const float*>(normed.data);
      if (!d.gqa()) {
        ctx_.exec->rope_forward(*ctx_.rope, qk, nf, 2 * B, d.T, d.Hl, d.D, HD);
      } else {
        ctx_.exec->rope_forward(*ctx_.rope, qk, nf, B, d.T, d.Hl, d.D, HD);
        ctx_.exec->rope_forward(*ctx_.rope, qk.at(BT * HD), nf + BT * HD, B, d.T, d.Hkvl, d.D, KD);
      }
    }
    q = qk;
    k = qk.at(BT * HD);
    ldq = HD;
    ldk = KD;
  } else if (rope) {
    // Without QK-norm q and k are rotated in place inside qkv_: multi-head, a row's q heads and k
    // heads are adjacent, so one call rotates both as 2 Hl heads.
    ProfileScope p(prof, "rope");
    if (!d.gqa()) {
      ctx_.exec->rope_forward(*ctx_.rope, raw.q, raw.q, B, d.T, 2 * d.Hl, d.D, raw.ldq);
    } else {
      ctx_.exec->rope_forward(*ctx_.rope, raw.q, raw.q, B, d.T, d.Hl, d.D, raw.ldq);
      ctx_.exec->rope_forward(*ctx_.rope, raw.k, raw.k, B, d.T, d.Hkvl, d.D, raw.ldkv);
    }
  }
  qk_scales(scales_.f32());
  {
    ProfileScope p(prof, "attention");
    // Note [gqa layouts]: a rank holding every k/v head reads the one its query heads use.
    const int64_t kv0 = d.kv_attn_head0 * d.D;
    const kernels::AttentionShape s{B,   d.T,      d.Hl, d.D, ldq,
                                    ldk, raw.ldkv, HD,   0,   d.gqa() ? d.kv_attn_heads : 0};
    ctx_.exec->attention_forward(s, kernels::act(att_), saved_.f32(), q, k.at(kv0), raw.v.at(kv0),
                                 scales_.f32(), max_logit);
  }
  const kernels::ActOut part = region.partial(y, ctx_.scratch->sp_part.f32());
  {
    ProfileScope p(prof, "matmul.attn_proj");
    // Row-parallel: partial sums over this rank's heads; the bias is added once (TP rank 0).
    const float* bias = d.tp_rank == 0 ? ps_.param_or_null(proj_b_) : nullptr;
    ctx_.exec->linear_forward(part, kernels::act(att_), ps_.param(proj_w_), bias, BT, HD, d.C);
  }
  region.exit(part, y, n);
}

void Attention::backward(kernels::ActIn x_rows, const float* dy_rows, float* dx, int64_t B) {
  const ModelDims& d = ctx_.dims;
  const int64_t HD = d.Hl * d.D, KD = d.Hkvl * d.D, BT = B * d.T, n = d.rows(B) * d.C;
  Scratch& sc = *ctx_.scratch;
  Profiler* prof = ctx_.profiler;
  // Note [tp regions]: the output gradient and (under SP, gathered again rather than kept) the
  // input on every row.
  const TpRegion region = ctx_.region();
  const float* dy = region.exit_backward(dy_rows, sc.sp_dy.f32(), n);
  const kernels::ActIn x = region.enter(x_rows, sc.sp_x.f32(), n);
  {
    ProfileScope p(prof, "matmul.attn_proj");
    ctx_.exec->linear_backward(kernels::act(sc.datt), false, ps_.grad(proj_w_),
                               ps_.grad_or_null(proj_b_), dy, kernels::act(att_),
                               ps_.param(proj_w_), BT, HD, d.C);
  }
  const bool normed = d.qk_norm != config::NONE, rope = d.position == config::ROPE;
  const QkvView raw = qkv_view(kernels::act(qkv_), B);
  // The gradients of q, k and v in dqkv (raw's layout), bf16 under BF16 on a device (Note
  // [act-dtype]: only the QKV projection's backward GEMMs and its bias sum read them).
  const kernels::ActOut dqkv = kernels::act(sc.dqkv);
  const QkvView draw = qkv_view(dqkv, B);
  // dq, dk in the layout of the q, k attention read: inside dqkv, or dq's rows then dk's in dqk.
  // With QK-norm they are bf16 too where the norm's backward reads them as they are; RoPE's
  // backward first rotates them, in place in fp32, so that the norm's backward sees no rounding
  // the fp32 path would not make.
  const int64_t ldq = normed ? HD : raw.ldq, ldk = normed ? KD : raw.ldkv;
  kernels::ActOut dq = draw.q, dk = draw.k;
  if (normed) {
    dq = dqkv.dtype != DType::kF32 && !rope ? kernels::ActOut(sc.dqk.raw(), dqkv.dtype)
                                            : kernels::ActOut(sc.dqk.f32());
    dk = dq.at(BT * HD);
  }
  if (d.kv_replicated) {
    // Note [gqa layouts]: attention writes the gradient of the one k/v head this rank reads; the
    // others get none from this rank.
    sc.dqkv.zero_();
    if (normed) sc.dqk.zero_();
  }
  {
    ProfileScope p(prof, "attention");
    // q, k as the forward's attention read them (rotated with ROPE).
    const kernels::ActIn q = normed ? kernels::ActIn(kernels::act(qk_)) : raw.q;
    const kernels::ActIn k = normed ? kernels::ActIn(kernels::act(qk_).at(BT * HD)) : raw.k;
    const int64_t kv0 = d.kv_attn_head0 * d.D;
    kernels::AttentionShape s{
        B, d.T, d.Hl, d.D, ldq, ldk, raw.ldkv, HD, sc.attn_threads, d.gqa() ? d.kv_attn_heads : 0};
    // dq/dk use ldq/ldk, dv uses ldv (raw.ldkv, inside dqkv).
    float* dscale = nullptr;
    if (d.qk_norm == config::L2) {
      sc.dscale.zero_();
      dscale = sc.dscale.f32();
    }
    ctx_.exec->attention_backward(s, dq, dk.at(kv0), draw.v.at(kv0), dscale, kernels::act(sc.datt),
                                  kernels::act(att_), saved_.f32(), q, k.at(kv0), raw.v.at(kv0),
                                  scales_.f32(), sc.attn_ws.f32());
    if (dscale) {
      ctx_.exec->scale_grad_accumulate(ps_.grad(qk_scale_), dscale, d.Hl,
                                       d.qk_scope != config::HEAD);
    }
  }
  if (rope) {
    // dq, dk are gradients w.r.t. the rotated q, k; the transposed rotation gives them w.r.t. the
    // (normalised) q, k before RoPE, in place, in one call as in forward (multi-head): dk's rows
    // follow dq's (2 B sequences) with QK-norm, else dk's heads follow dq's in the same rows (2 Hl
    // heads); grouped-query: a call each.
    ProfileScope p(prof, "rope");
    if (d.gqa()) {
      ctx_.exec->rope_backward(*ctx_.rope, dq, dq, B, d.T, d.Hl, d.D, ldq);
      ctx_.exec->rope_backward(*ctx_.rope, dk, dk, B, d.T, d.Hkvl, d.D, ldk);
    } else if (normed) {
      ctx_.exec->rope_backward(*ctx_.rope, dq, dq, 2 * B, d.T, d.Hl, d.D, ldq);
    } else {
      ctx_.exec->rope_backward(*ctx_.rope, dq, dq, B, d.T, 2 * d.Hl, d.D, ldq);
    }
  }
  if (normed) {
    ProfileScope p(prof, "qk_norm");
    // Gradients flow from the normalised q, k (dk's rows after dq's) to the raw ones inside dqkv.
    const kernels::NormShape sq = qk_norm_shape(B, d.Hl, raw.ldq);
    const kernels::NormShape sk = qk_norm_shape(B, d.Hkvl, raw.ldkv);
    const kernels::NormOp op = qk_op(d.qk_norm);
    auto w = [&](int id) { return ps_.param_or_null(id); };
    auto g = [&](int id) { return ps_.grad_or_null(id); };
    // norm_backward writes dinp with ld_in and reads dout with ld_out.
    if (d.qk_scope == config::PROJECTION) {
      Communicator& tp = ctx_.topo->tp_tensors();
      float* qp = q_stats_.f32();  // reused: forward statistics are no longer needed
      float* kp = k_stats_.f32();
      ctx_.exec->norm_backward_partials(sq, dq, raw.q, w(q_norm_w_), q_mean_.f32(), q_rstd_.f32(),
                                        qp);
      ctx_.exec->norm_backward_partials(sk, dk, raw.k, w(k_norm_w_), k_mean_.f32(), k_rstd_.f32(),
                                        kp);
      {
        CommGroup group(tp);  // one launch, one wait (Note [collective groups])
        tp.all_reduce(qp, 2 * BT, ReduceOp::kSum);
        // Replicated k heads: this rank's dk is a partial sum over TP already (linear in dk).
        if (!d.kv_replicated) tp.all_reduce(kp, 2 * BT, ReduceOp::kSum);
      }
      ctx_.exec->norm_backward_from_partials(op, sq, d.H * d.D, qp, draw.q, false, g(q_norm_w_),
                                             g(q_norm_b_), dq, raw.q, w(q_norm_w_), q_mean_.f32(),
                                             q_rstd_.f32());
      ctx_.exec->norm_backward_from_partials(op, sk, d.Hkv * d.D, kp, draw.k, false, g(k_norm_w_),
                                             g(k_norm_b_), dk, raw.k, w(k_norm_w_), k_mean_.f32(),
                                             k_rstd_.f32());
    } else {
      ctx_.exec->norm_backward(op, sq, draw.q, false, g(q_norm_w_), g(q_norm_b_), dq, raw.q,
                               w(q_norm_w_), q_mean_.f32(), q_rstd_.f32());
      ctx_.exec->norm_backward(op, sk, draw.k, false, g(k_norm_w_), g(k_norm_b_), dk, raw.k,
                               w(k_norm_w_), k_mean_.f32(), k_rstd_.f32());
    }
  }
  // Column-parallel input: each rank's dx covers its heads only, a partial sum. On the bf16 TP
  // wire the projection writes it in bf16 for the all-reduce, which is then widened into dx (Note
  // [bf16 wire]).
  const kernels::ActOut dxo = region.partial(
      d.tp_bf16_act ? kernels::act(sc.tp_bf16) : kernels::ActOut(dx), sc.sp_part.f32());
  {
    ProfileScope p(prof, "matmul.qkv");
    if (!d.gqa()) {
      ctx_.exec->linear_backward(dxo, false, ps_.grad(qkv_w_), ps_.grad_or_null(qkv_b_), dqkv, x,
                                 ps_.param(qkv_w_), BT, d.C, 3 * HD);
    } else {
      // The kv projection adds its input gradient to q's (fp32 only: a bf16 dinp cannot
      // accumulate, and grouped-query attention runs on the CPU).
      KEEL_CHECK(dxo.dtype == DType::kF32, kInternal, "grouped-query attention with a bf16 dx");
      ctx_.exec->linear_backward(dxo, false, ps_.grad(qkv_w_), ps_.grad_or_null(qkv_b_), draw.q, x,
                                 ps_.param(qkv_w_), BT, d.C, HD);
      ctx_.exec->linear_backward(dxo, true, ps_.grad(kv_w_), ps_.grad_or_null(kv_b_), draw.k, x,
                                 ps_.param(kv_w_), BT, d.C, 2 * KD);
    }
  }
  region.enter_backward(dxo, dx, n);
}

}  // namespace keel
