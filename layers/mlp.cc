// MLP forward/backward, GELU or gated (SwiGLU, GEGLU).
#include "layers/mlp.h"

#include <cmath>

#include "parallel/tp_regions.h"

namespace keel {

Mlp::Mlp(const std::string& prefix, ParamStore& ps, const LayerContext& ctx) : ps_(ps), ctx_(ctx) {
  const ModelDims& d = ctx.dims;
  gated_ = d.gated_mlp();
  if (d.mlp == config::GEGLU) act_ = kernels::GluAct::kGelu;
  const float resid_std = d.init_std / std::sqrt(2.0f * static_cast<float>(d.L));
  fc_w_ = ps.add({prefix + ".fc.weight", {d.F, d.C}, 0, ParamInit::kNormal, d.init_std, true});
  if (d.bias) fc_b_ = ps.add({prefix + ".fc.bias", {d.F}, 0, ParamInit::kConstant, 0.0f});
  if (gated_) {
    gate_w_ =
        ps.add({prefix + ".gate.weight", {d.F, d.C}, 0, ParamInit::kNormal, d.init_std, true});
    if (d.bias) gate_b_ = ps.add({prefix + ".gate.bias", {d.F}, 0, ParamInit::kConstant, 0.0f});
  }
  proj_w_ = ps.add({prefix + ".proj.weight", {d.C, d.F}, 1, ParamInit::kNormal, resid_std, true});
  if (d.bias) proj_b_ = ps.add({prefix + ".proj.bias", {d.C}, -1, ParamInit::kConstant, 0.0f});
}

void Mlp::allocate(const LayerContext& ctx, const Mlp* share) {
  if (share != nullptr) {
    h_ = share->h_;
    a_ = share->a_;
    g_ = share->g_;
    return;
  }
  h_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl});
  if (gated_) a_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl});
  // Note [act-dtype]: only the down projection reads the activated hidden.
  g_ = ctx.zeros({ctx.dims.BT(), ctx.dims.Fl}, ctx.exec->act_dtype());
}

void Mlp::forward(kernels::ActIn x, kernels::ActOut y, int64_t B) {
  const ModelDims& d = ctx_.dims;
  const int64_t BT = B * d.T;
  Profiler* prof = ctx_.profiler;
  {
    ProfileScope p(prof, "matmul.mlp_fc");
    ctx_.exec->linear_forward(h_.f32(), x, ps_.param(fc_w_), ps_.param_or_null(fc_b_), BT, d.C,
                              d.Fl);
    if (gated_) {
      ctx_.exec->linear_forward(a_.f32(), x, ps_.param(gate_w_), ps_.param_or_null(gate_b_), BT,
                                d.C, d.Fl);
    }
  }
  if (gated_) {
    ProfileScope p(prof, "glu");
    ctx_.exec->glu_forward(act_, kernels::act(g_), a_.f32(), h_.f32(), BT * d.Fl);
  } else {
    ProfileScope p(prof, "gelu");
    ctx_.exec->gelu_forward(kernels::act(g_), h_.f32(), BT * d.Fl);
  }
  {
    ProfileScope p(prof, "matmul.mlp_proj");
    // Row-parallel: partial sums over this rank's d_ff columns; the bias is added once.
    const float* bias = d.tp_rank == 0 ? ps_.param_or_null(proj_b_) : nullptr;
    ctx_.exec->linear_forward(y, kernels::act(g_), ps_.param(proj_w_), bias, BT, d.Fl, d.C);
  }
  if (!d.sp) {  // under SP the block reduce-scatters y (Note [sequence parallel])
    ProfileScope p(prof, "tp.all_reduce");
    tp_region::reduce_from_tp_forward(ctx_.topo->tp_tensors(), y, BT * d.C, d.tp_bf16_wire);
  }
}

void Mlp::backward(kernels::ActIn x, const float* dy, float* dx, int64_t B) {
  const ModelDims& d = ctx_.dims;
  const int64_t BT = B * d.T;
  float* dh = ctx_.scratch->dh.f32();
  Profiler* prof = ctx_.profiler;
  {
    ProfileScope p(prof, "matmul.mlp_proj");
    ctx_.exec->linear_backward(dh, false, ps_.grad(proj_w_), ps_.grad_or_null(proj_b_), dy,
                               kernels::act(g_), ps_.param(proj_w_), BT, d.Fl, d.C);
  }
  // Note [act-dtype]: the hidden gradients, which only the up (and gate) projections' backward
  // reads, go where the activated hidden was (nothing reads g_ after the down projection's
  // backward) and into the gate's scratch; the projections' bias gradients are summed in fp32.
  const kernels::ActOut dup = kernels::act(g_);
  const kernels::ActOut dgate =
      gated_ ? kernels::act(ctx_.scratch->dgate) : kernels::ActOut(nullptr);
  if (gated_) {
    ProfileScope p(prof, "glu");
    ctx_.exec->glu_backward(act_, dgate, dup, ps_.grad_or_null(gate_b_), ps_.grad_or_null(fc_b_),
                            dh, a_.f32(), h_.f32(), BT, d.Fl);
  } else {
    ProfileScope p(prof, "gelu");
    ctx_.exec->gelu_backward(dup, ps_.grad_or_null(fc_b_), h_.f32(), dh, BT, d.Fl);
  }
  // On the bf16 TP wire the up projection writes its partial dx in bf16 for the all-reduce, then
  // widened into dx (Note [bf16 wire]); a gated MLP's two projections accumulate it in fp32.
  const bool bf16_dx = d.tp_bf16_act && !gated_;
  const kernels::ActOut dxo = bf16_dx ? kernels::act(ctx_.scratch->tp_bf16) : kernels::ActOut(dx);
  {
    ProfileScope p(prof, "matmul.mlp_fc");
    ctx_.exec->linear_backward(dxo, false, ps_.grad(fc_w_), nullptr, dup, x, ps_.param(fc_w_), BT,
                               d.C, d.Fl);
    if (gated_) {
      // Both projections read x: their input gradients add up before the one all-reduce.
      ctx_.exec->linear_backward(dx, true, ps_.grad(gate_w_), nullptr, dgate, x, ps_.param(gate_w_),
                                 BT, d.C, d.Fl);
    }
  }
  if (!d.sp) {  // under SP the block reduce-scatters dx (Note [sequence parallel])
    ProfileScope p(prof, "tp.all_reduce");
    tp_region::copy_to_tp_backward(ctx_.topo->tp_tensors(), dxo, BT * d.C, d.tp_bf16_wire);
    if (bf16_dx) ctx_.exec->copy_to_f32(dx, dxo, BT * d.C);
  }
}

}  // namespace keel
