// MLP: GELU  y = down(gelu(up(x)))  or gated (SwiGLU, GEGLU)  y = down(act(gate(x)) * up(x)).
// The up (fc) and gate projections are column-parallel ([F, C] sharded on F), the down projection
// (proj) row-parallel ([C, F] sharded on F), so the activation and the gating run on this rank's
// d_ff columns with no communication: the up projections enter the TP region and the down
// projection leaves it (Note [tp regions] in parallel/tp_regions.h), gated or not.
#pragma once

#include <string>

#include "framework/kernels/glu.h"
#include "layers/context.h"
#include "layers/params.h"

namespace keel {

class Mlp {
 public:
  Mlp(const std::string& prefix, ParamStore& ps, const LayerContext& ctx);
  // share: another MLP whose saved activations this one reuses (Note [recompute] in layers/gpt.h).
  void allocate(const LayerContext& ctx, const Mlp* share = nullptr);
  // x, y, dy, dx: this rank's rows of the stream, [rows(B), C] (all B T rows without sequence
  // parallelism). x: fp32, or bf16 under BF16 on a GPU (Note [act-dtype]); only the projections
  // read it. y: fp32, or bf16 with ModelDims::tp_bf16_act.
  void forward(kernels::ActIn x, kernels::ActOut y, int64_t B);            // y (=)
  void backward(kernels::ActIn x, const float* dy, float* dx, int64_t B);  // dx (=)

 private:
  ParamStore& ps_;
  const LayerContext& ctx_;
  bool gated_;
  kernels::GluAct act_ = kernels::GluAct::kSilu;  // gated only
  // fc: the up projection; gate: gated MLPs only. Biases: -1 when model.bias is false.
  int fc_w_, fc_b_ = -1, gate_w_ = -1, gate_b_ = -1, proj_w_, proj_b_ = -1;
  Tensor h_;  // [BT, Fl] GELU: pre-activation; gated: up projection output
  Tensor a_;  // [BT, Fl] gated: gate projection output (pre-activation)
  // [BT, Fl] GELU output / act(a) * h: the down projection's input; in backward, after the down
  // projection's, the gradient w.r.t. h (Note [act-dtype])
  Tensor g_;
};

}  // namespace keel
