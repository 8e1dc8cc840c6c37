// AdamW over the flat parameter arena, the warmup + cosine learning-rate schedule and global-norm
// gradient clipping. The optimizer sees segments of the arena (offset, length, decay?) and knows
// nothing about models; its state (step, m, v) is plain data so checkpoints can save it.
#pragma once

#include <cstdint>
#include <vector>

#include "framework/config/keel.pb.h"
#include "framework/kernels/adamw.h"
#include "framework/kernels/exec_context.h"
#include "framework/tensor.h"

namespace keel {

// A parameter's run of the arena (offset, n, decay?): the table the update takes whole, one
// ExecContext::adamw_update_segments call a step (kernels/adamw.h).
using ParamSegment = kernels::AdamWSegment;

class AdamW {
 public:
  // The moments live on exec's device and the update runs through exec (which must outlive it).
  AdamW(const config::Optim& cfg, int64_t total_elems, std::vector<ParamSegment> segments,
        kernels::ExecContext& exec = kernels::cpu_exec());
  // One update with learning rate lr; grads are multiplied by grad_scale first (clipping).
  // params and grads are memory of exec's device. One adamw_update_segments call over the whole
  // table: on the CPU adamw_update per segment, as before; on a GPU a launch per 128 segments.
  void step(float* params, const float* grads, float lr, float grad_scale);
  int64_t t() const { return t_; }
  void set_t(int64_t t) { t_ = t; }  // restoring a checkpoint
  const std::vector<ParamSegment>& segments() const { return segments_; }
  Tensor& m() { return m_; }
  Tensor& v() { return v_; }
  int64_t state_bytes() const { return m_.nbytes() + v_.nbytes(); }

 private:
  config::Optim cfg_;
  std::vector<ParamSegment> segments_;
  kernels::ExecContext* exec_;
  Tensor m_, v_;
  int64_t t_ = 0;
};

// Learning rate at 0-based `step`: linear warmup over optim.warmup_steps to optim.lr, then
// optim.schedule down to the floor optim.lr * optim.min_lr_ratio, reached at total_steps:
//   COSINE    floor + (lr - floor) (1 + cos(pi p)) / 2 over p in [0, 1] from the warmup's end;
//   LINEAR    floor + (lr - floor) (1 - p);
//   WSD       lr (stable), then over the last optim.decay_steps (0: total_steps / 5) linear;
//   WSD_SQRT  the same with 1 - sqrt(p) (Haegele et al. 2024, "Scaling Laws and Compute-Optimal
//             Training Beyond Fixed Training Durations");
//   CONSTANT  lr.
float learning_rate(const config::Optim& cfg, int64_t step, int64_t total_steps);

// Multiplier that brings a gradient of global norm `norm` to at most `max_norm` (1 when within,
// or when max_norm <= 0 disables clipping).
float clip_scale(double norm, double max_norm);

}  // namespace keel
