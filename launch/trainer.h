// The training loop: data -> micro-batch forward/backward (gradient accumulation) -> global-norm
// clipping -> AdamW, with metrics.jsonl, periodic validation, a progress line on rank 0 and text
// sampling from the trained model. Everything a step decides comes from (config, step, global
// sample index), so two runs with the same seed are bit-identical.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "framework/config/keel.pb.h"
#include "framework/data/dataset.h"
#include "framework/data/sampler.h"
#include "framework/metrics.h"
#include "framework/optim/optimizer.h"
#include "layers/gpt.h"
#include "parallel/grad_sync.h"
#include "parallel/watchdog.h"

namespace keel {

struct StepResult {
  int64_t step = 0;        // 1-based optimizer step just taken
  double loss = 0.0;       // mean cross-entropy over the global batch, nats/token
  double z_loss = 0.0;     // z-loss term (coefficient included)
  double grad_norm = 0.0;  // global gradient norm before clipping
  float lr = 0.0f;
  float max_attn_logit = 0.0f;
  double seconds = 0.0;         // wall time of the step
  double comm_exposed_s = 0.0;  // DP gradient sync time not hidden behind backward
  double comm_window_s = 0.0;   // from the first bucket's launch to the sync's end
  double backward_s = 0.0;      // time of the last micro-batch's backward (overlap window)
};

struct TrainerOptions {
  std::string run_dir;       // empty: write no files (benchmarks, tests)
  bool progress = true;      // print progress lines (rank 0)
  bool interactive = false;  // progress redraws one terminal line instead of one line per log step
  Watchdog* watchdog = nullptr;  // told the current step, for its messages
};

class Trainer {
 public:
  Trainer(const config::KeelConfig& cfg, const Topology& topo, TrainerOptions opts);

  StepResult step();  // one optimizer step
  void run();         // train.steps steps with logging and evaluation
  double evaluate();  // mean validation cross-entropy (eval_batches batches)
  std::string sample(int64_t n_chars, uint64_t seed, float temperature = 0.8f);

  GPT& model() { return *model_; }
  const Dataset& dataset() const { return data_; }
  AdamW& optimizer() { return *opt_; }
  int64_t steps_done() const { return step_; }
  int64_t tokens_per_step() const {
    return static_cast<int64_t>(cfg_.train().global_batch()) * cfg_.model().seq_len();
  }
  int64_t micro_batch() const { return micro_; }
  int64_t accum_steps() const { return accum_; }
  const Topology& topology() const { return topo_; }
  // ZeRO-1: this rank's slice [shard_offset, shard_offset + shard_n) of the parameter arena.
  int64_t shard_offset() const { return shard_off_; }
  int64_t shard_n() const { return shard_n_; }
  const Tensor& shard_grads() const { return shard_grads_; }
  const StepResult& last() const { return last_; }
  // XXH3 fingerprints of the training and validation token streams (Note [data fingerprint]);
  // every rank's are checked equal at start-up. The validation one is 0 without a split.
  uint64_t train_fingerprint() const { return train_fp_; }
  uint64_t val_fingerprint() const { return val_fp_; }
  double last_val_loss() const { return last_val_; }
  bool evaluated() const { return evaluated_; }

 private:
  void check_same_data_on_every_rank() const;  // throws kData naming the first rank that differs
  void log_step(const StepResult& r, std::optional<double> val_loss);
  double grad_sum_squares(const float* grads, int64_t begin, int64_t end) const;

  config::KeelConfig cfg_;
  const Topology& topo_;
  TrainerOptions opts_;
  Dataset data_;
  Sampler sampler_;
  uint64_t train_fp_ = 0, val_fp_ = 0;
  std::unique_ptr<GPT> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<GradSync> grad_sync_;  // plain DP (dp > 1, zero_stage 0)
  bool zero_ = false;                    // ZeRO-1 (dp > 1, zero_stage 1)
  int64_t shard_off_ = 0, shard_n_ = 0;
  Tensor shard_grads_;               // [shard_n] reduce-scattered gradients (ZeRO-1)
  std::vector<int> tp_partial_ids_;  // gradients to all-reduce over TP each step
  int64_t micro_ = 0, accum_ = 0;
  int64_t step_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::unique_ptr<JsonlWriter> metrics_;
  StepResult last_;
  double last_val_ = 0.0;
  bool evaluated_ = false;
  double run_t0_ = 0.0;
  double window_seconds_ = 0.0;
  int64_t window_tokens_ = 0;
};

}  // namespace keel
