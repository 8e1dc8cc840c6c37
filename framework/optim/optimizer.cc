// AdamW, schedule and clipping.
#include "framework/optim/optimizer.h"

#include <algorithm>
#include <cmath>

namespace keel {

AdamW::AdamW(const config::Optim& cfg, int64_t total_elems, std::vector<ParamSegment> segments,
             kernels::ExecContext& exec)
    : cfg_(cfg), segments_(std::move(segments)), exec_(&exec) {
  m_ = Tensor::zeros({total_elems}, DType::kF32, exec.device());
  v_ = Tensor::zeros({total_elems}, DType::kF32, exec.device());
}

void AdamW::step(float* params, const float* grads, float lr, float grad_scale) {
  ++t_;
  // weight_decay applies to the segments that decay (adamw_update_segments gives the others 0).
  const kernels::AdamWStep s{
      lr, cfg_.beta1(), cfg_.beta2(), cfg_.eps(), cfg_.weight_decay(), grad_scale, t_};
  exec_->adamw_update_segments(params, grads, m_.f32(), v_.f32(), segments_.data(),
                               static_cast<int64_t>(segments_.size()), s);
}

float learning_rate(const config::Optim& cfg, int64_t step, int64_t total_steps) {
  const double peak = cfg.lr();
  const int64_t warmup = cfg.warmup_steps();
  if (step < warmup) return static_cast<float>(peak * static_cast<double>(step + 1) / warmup);
  if (cfg.schedule() == config::CONSTANT) return static_cast<float>(peak);
  const bool wsd = cfg.schedule() == config::WSD || cfg.schedule() == config::WSD_SQRT;
  // The decay runs over [start, total_steps): after the warmup, or for WSD its last decay_steps.
  int64_t start = warmup;
  if (wsd) {
    // 0: a fifth of the run, as config validation resolves it (for configs built without it).
    const int64_t decay =
        cfg.decay_steps() > 0 ? cfg.decay_steps() : std::max<int64_t>(1, total_steps / 5);
    start = std::max(warmup, total_steps - decay);
    if (step < start) return static_cast<float>(peak);  // the stable phase
  }
  const double progress =
      std::min(1.0, static_cast<double>(step - start) / std::max<int64_t>(1, total_steps - start));
  double frac;  // of the way from the floor (0) to the peak (1)
  switch (cfg.schedule()) {
    case config::LINEAR:
    case config::WSD:
      frac = 1.0 - progress;
      break;
    case config::WSD_SQRT:
      frac = 1.0 - std::sqrt(progress);
      break;
    default:  // COSINE
      frac = 0.5 * (1.0 + std::cos(M_PI * progress));
      break;
  }
  const double min_lr = peak * cfg.min_lr_ratio();
  return static_cast<float>(min_lr + (peak - min_lr) * frac);
}

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return 1.0f;
  return static_cast<float>(max_norm / (norm + 1e-6));
}

}  // namespace keel
