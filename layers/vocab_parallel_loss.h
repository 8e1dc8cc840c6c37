// The LM head's loss over vocabulary-parallel logits: mean token cross-entropy plus z-loss
// z_coef * mean(logsumexp(logits)^2), as Megatron's vocab-parallel cross-entropy computes it
// (tensor_parallel/cross_entropy.py): each TP rank holds the logits of its vocabulary shard, and
// three all-reduces of one value per token row (the target logit, the row maximum, the sum of
// exponentials) combine the shards without gathering the logits. Padded vocabulary rows (Note
// [vocab padding] in layers/gpt.cc) are left out of every row statistic.
#pragma once

#include <cstdint>
#include <optional>

#include "framework/tensor.h"
#include "layers/context.h"

namespace keel {

struct TokenLoss {
  double ce = 0.0;      // mean cross-entropy, nats/token
  double z_loss = 0.0;  // z_coef * mean(lse^2), the term added to the loss
  double log_z = 0.0;   // mean(lse)
};

class VocabParallelLoss {
 public:
  // Row statistics for ctx.dims' micro-batch, on the execution context's device.
  VocabParallelLoss(const LayerContext& ctx, double z_coef);

  // logits[N, V_local] (this rank's vocabulary shard, act dtype), targets[N] (device memory).
  // loss_weight: the weight backward() will be given, when known. Then, when this rank holds the
  // whole vocabulary (tp = 1), the loss's gradient is computed in the same pass over the logits
  // and written over them (ExecContext::xent_fused), and backward() must get the same weight.
  // Enqueues the loss and reads nothing back: sums (=, device memory, 3 f64) receives the three
  // sums finish() turns into a TokenLoss once the caller has them on the host, so the caller
  // reads them together with its own statistics (Note [forward stats] in layers/gpt.h).
  void forward(kernels::ActOut logits, const int32_t* targets, int64_t N,
               std::optional<float> loss_weight, double* sums);
  // The loss of a forward over N rows from its sums, read back to the host.
  TokenLoss finish(const double sums[3], int64_t N) const;
  // logits (=) d(loss_weight * (ce + z_loss)) / d(logits) of the last forward, in place.
  void backward(kernels::ActOut logits, const int32_t* targets, int64_t N, float loss_weight);
  // The logits no longer hold a forward's fused gradient (a forward without targets).
  void reset() { fused_weight_.reset(); }

 private:
  const LayerContext& ctx_;
  double z_coef_;
  Tensor row_max_, lse_, tl_;          // [N] each
  std::optional<float> fused_weight_;  // set: the logits hold the loss gradient for this weight
};

}  // namespace keel
