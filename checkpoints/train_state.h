// TrainState: the one owner of everything a resume needs (Note [run state]). The trainer holds
// it and changes it step by step; checkpoints save and load it; the spike guard (next) rewinds it.
// It depends on framework/, parallel/ and layers/ only, never on launch/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/data/sampler.h"
#include "framework/optim/optimizer.h"
#include "layers/params.h"
#include "parallel/zero_partition.h"

namespace keel {

// Note [run state]: a run resumes bit for bit from exactly these:
//   - the parameters (ParamStore, this rank's TP slices);
//   - AdamW's m and v (over this rank's ZeRO-1 slice of the arena, or all of it) and its step t;
//   - the sampler state (the next global sample index: Note [layout-independent data order]);
//   - the optimizer step count;
//   - the data fingerprints the run was trained on (Note [data fingerprint]);
//   - the spike guard's state: the data ranges it skipped (empty until the guard is built).
// Gradients and activations are not state: every step recomputes them from these. The learning
// rate is a function of (config, step).

// Training samples [first_sample, first_sample + n) that the spike guard skipped at `step`.
struct SkippedRange {
  uint64_t first_sample = 0;
  uint64_t n = 0;
  int64_t step = 0;
  bool operator==(const SkippedRange&) const = default;
};

// The spike guard's state (launch/train/spike_guard.h): saved in every checkpoint so that a resumed
// run decides exactly as the uninterrupted one would, and never replays skipped data.
struct GuardState {
  std::vector<SkippedRange> skipped;
  std::vector<double> loss_history;  // the last spike.window healthy steps' values, oldest first
  std::vector<double> grad_history;
  int64_t streak = 0;                // consecutive anomalous steps up to now
  int64_t streak_first = 0;          // the first step of that streak
  uint64_t streak_first_sample = 0;  // the first training sample of that step
  std::vector<int64_t> rewinds;      // the steps at which the guard rewound
  int64_t cooldown_from = -1;        // learning-rate cool-down after this step; -1: none
  bool operator==(const GuardState&) const = default;
};

// The first training sample of a step of `global_batch` samples that would start at
// `next_sample`: past every range the spike guard skipped that the step would overlap (repeatedly,
// as moving past one may reach another). Skipped data is never read again, even after a rewind
// to before it.
uint64_t first_unskipped_sample(uint64_t next_sample, uint64_t global_batch,
                                const std::vector<SkippedRange>& skipped);

// One parameter as the state walker shows it: its registry entry (logical name, global shape,
// shard dim, this rank's slice and arena offset), the arena elements of its values on this rank,
// and the part of them whose AdamW moments this rank holds (all of them without ZeRO-1; the
// intersection with this rank's partition with it; possibly empty).
struct StateParam {
  int id = 0;
  const ParamInfo* info = nullptr;
  ArenaSlice values;   // arena coordinates
  ArenaSlice moments;  // arena coordinates, inside `values`
};

class TrainState {
 public:
  // `optimizer`'s moments cover partition.mine() of `params`' arena.
  TrainState(ParamStore& params, AdamW& optimizer, ZeroPartition partition);

  int64_t step = 0;  // optimizer steps taken
  SamplerState sampler;
  uint64_t train_fingerprint = 0;
  uint64_t val_fingerprint = 0;  // 0 without a validation split
  GuardState guard;

  ParamStore& params() const { return params_; }
  AdamW& optimizer() const { return optimizer_; }
  const ZeroPartition& partition() const { return partition_; }

  // Every parameter in registration order: the checkpoint's tensor list.
  const std::vector<StateParam>& tensors() const { return tensors_; }

  // Host copies through the tensors' device-neutral copies (never raw arena pointers).
  // values: [p.values.n]; m, v: [p.moments.n], either may be null (that moment is left alone).
  void read_values(const StateParam& p, float* values) const;
  void write_values(const StateParam& p, const float* values) const;
  void read_moments(const StateParam& p, float* m, float* v) const;
  void write_moments(const StateParam& p, const float* m, const float* v) const;

 private:
  ParamStore& params_;
  AdamW& optimizer_;
  ZeroPartition partition_;
  std::vector<StateParam> tensors_;
};

}  // namespace keel
