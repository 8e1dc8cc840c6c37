// GELU MLP: up projection column-parallel ([F, C] sharded on F), down projection row-parallel
// ([C, F] sharded on F), so the GELU runs on this rank's d_ff columns with no communication.
#pragma once

#include <string>

#include "layers/context.h"
#include "layers/params.h"

namespace keel {

class Mlp {
 public:
  Mlp(const std::string& prefix, ParamStore& ps, const LayerContext& ctx);
  void allocate(const LayerContext& ctx);
  void forward(const float* x, float* y, int64_t B);                     // y[BT, C] (=)
  void backward(const float* x, const float* dy, float* dx, int64_t B);  // dx[BT, C] (=)

 private:
  ParamStore& ps_;
  const LayerContext& ctx_;
  int fc_w_, fc_b_, proj_w_, proj_b_;
  Tensor h_;  // [BT, Fl] pre-activation
  Tensor g_;  // [BT, Fl] GELU output
};

}  // namespace keel
