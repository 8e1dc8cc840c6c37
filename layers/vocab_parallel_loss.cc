// Vocab-parallel cross-entropy + z-loss (vocab_parallel_loss.h).
#include "layers/vocab_parallel_loss.h"

#include <cstring>

#include "framework/error.h"

namespace keel {

VocabParallelLoss::VocabParallelLoss(const LayerContext& ctx, double z_coef)
    : ctx_(ctx), z_coef_(z_coef) {
  const int64_t N = ctx.dims.BT();
  row_max_ = ctx.zeros({N});
  lse_ = ctx.zeros({N});
  tl_ = ctx.zeros({N});
}

void VocabParallelLoss::forward(kernels::ActOut logits, const int32_t* targets, int64_t N,
                                std::optional<float> loss_weight, double* sums) {
  const ModelDims& d = ctx_.dims;
  kernels::ExecContext& ex = *ctx_.exec;
  Communicator& tp = ctx_.topo->tp_tensors();
  ProfileScope p(ctx_.profiler, "loss");
  fused_weight_.reset();
  float* mx = row_max_.f32();
  float* lse = lse_.f32();
  float* tl = tl_.f32();
  ex.xent_target_logit(logits, targets, N, d.Vl, d.v_begin, tl);
  if (tp.size() == 1 && loss_weight.has_value()) {
    // The whole vocabulary on this rank and the weight known: the gradient in the same pass,
    // written over the logits (after their target logits were read).
    ex.xent_fused(logits, logits, targets, N, d.Vl, d.v_valid, d.v_begin,
                  *loss_weight / static_cast<float>(N), static_cast<float>(z_coef_), mx, lse);
    fused_weight_ = loss_weight;
  } else if (tp.size() == 1) {
    // The whole vocabulary on this rank: both row passes in one call (one read on a GPU).
    ex.xent_row_max_sumexp(logits, N, d.Vl, d.v_valid, mx, lse);
  } else {
    ex.xent_row_max(logits, N, d.Vl, d.v_valid, mx);
    {
      // The target logits (one rank's shard holds each, the others 0) and the row maxima are
      // independent: one group, one launch and one wait (Note [collective groups]); the sum-exp
      // needs the global maxima, so its all-reduce follows on its own.
      CommGroup group(tp);
      tp.all_reduce(tl, N, ReduceOp::kSum);
      tp.all_reduce(mx, N, ReduceOp::kMax);
    }
    ex.xent_row_sumexp(logits, mx, N, d.Vl, d.v_valid, lse);
    tp.all_reduce(lse, N, ReduceOp::kSum);
  }
  // lse_ holds the sum-exp until xent_finish overwrites it with the log-sum-exp. sums: of
  // (lse - target logit), of lse^2, of lse.
  ex.xent_finish(mx, lse, tl, N, lse, sums);
}

TokenLoss VocabParallelLoss::finish(const double sums[3], int64_t N) const {
  TokenLoss out;
  out.ce = sums[0] / static_cast<double>(N);
  out.log_z = sums[2] / static_cast<double>(N);
  out.z_loss = z_coef_ * sums[1] / static_cast<double>(N);
  return out;
}

void VocabParallelLoss::backward(kernels::ActOut logits, const int32_t* targets, int64_t N,
                                 float loss_weight) {
  if (fused_weight_.has_value()) {
    // The forward computed the loss gradient (xent_fused); the same weight, bit for bit (NaN too:
    // debug.inject_nan_at_step).
    KEEL_CHECK(std::memcmp(&*fused_weight_, &loss_weight, sizeof(float)) == 0, kInternal,
               "GPT::backward: loss_weight ", loss_weight, " differs from the forward's ",
               *fused_weight_);
    fused_weight_.reset();
    return;
  }
  const ModelDims& d = ctx_.dims;
  ProfileScope p(ctx_.profiler, "loss");
  ctx_.exec->xent_backward(logits, logits, lse_.f32(), targets, N, d.Vl, d.v_valid, d.v_begin,
                           loss_weight / static_cast<float>(N), static_cast<float>(z_coef_));
}

}  // namespace keel
