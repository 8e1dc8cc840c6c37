// Where a run starts, and which checkpoint a rewind goes back to: the decisions rank 0 takes over
// the run's checkpoint store (checkpoints/store.h) before every rank loads one. Resumer is the
// store's reader for the trainer: it checks a checkpoint against this run (data, shapes, model
// fields), picks the one to resume from (Note [lineage]), starts a new lineage for --resume-from
// and deletes the store for --overwrite. It only decides and says; the trainer makes every rank
// learn the verdict (parallel/agree.h) and loads.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "checkpoints/store.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"

namespace keel {

// Resume's check of the model a checkpoint was written with (`then`, its stored resolved config)
// against this run's (`now`): "" when they build the same model, else the reason naming the first
// model field that differs and both values. A checkpoint's tensor shapes cannot tell these: a
// smaller vocabulary still finds its rows, RMSNORM reads a LayerNorm's gain, a post-sublayer block
// a pre-norm one's weights. model.seq_len, max_positions, rope_theta and init_std may change
// (context extension; the shape check covers the position table), as may qk_norm_scope without a
// QK-norm. A config stored before some model fields existed (an enum reads UNSPECIFIED) has its
// zero-valued fields skipped: unknown, not different.
std::string changed_model_field(const config::Model& then, const config::Model& now);

// Where a run starts (keel-train's --no-resume, --overwrite, --resume-from).
enum class ResumeMode {
  kAuto,   // from RUN/checkpoints/LATEST when there is one (falling back past corrupt ones)
  kFresh,  // from scratch; refused when the run has checkpoints unless overwrite
  kFrom,   // from the checkpoint directory `path`; exit 2 when it is unusable
};

struct ResumeOptions {
  ResumeMode mode = ResumeMode::kAuto;
  bool overwrite = false;  // with kFresh: delete the run's checkpoints
  std::string path;        // with kFrom
};

// Rank 0's verdict on where the run starts (travels to every rank as bytes: parallel/agree.h).
struct ResumeVerdict {
  bool from_checkpoint = false;  // false: a fresh start
  int64_t step = 0;              // the store's checkpoint to load (kAuto); unused with kFrom
};

class Resumer {
 public:
  // `store`: the run's checkpoints (null without a run directory). `say`: a line for the user
  // (rank 0's stdout).
  Resumer(const config::KeelConfig& cfg, const TrainState& state, const CheckpointStore* store,
          ResumeOptions opts, std::function<void(const std::string&)> say);

  // Rank 0: throws kData when the checkpoint in `dir` is corrupt; returns why it cannot be
  // loaded into this run (empty: it can).
  std::string check(const std::string& dir) const;
  // Rank 0: where the run starts. Cleans the store for it: with kAuto what is newer than the
  // chosen checkpoint (unusable, or off the lineage) goes; --overwrite deletes the store;
  // --resume-from starts a lineage. Throws (kData, kUsage, kIo) naming what is wrong.
  ResumeVerdict decide() const;
  // The checkpoint directory a verdict names.
  std::string dir_of(const ResumeVerdict& v) const;
  // Rank 0: the newest checkpoint at or before `limit` that verifies and fits this run.
  std::optional<int64_t> pick_rewind_target(int64_t limit) const;

 private:
  // Resuming from checkpoint `dir` of step `step` with --resume-from: one of the run's own
  // starts a new lineage there (newer checkpoints deleted); another run's needs an empty store
  // (or --overwrite).
  void start_lineage_at(const std::string& dir, int64_t step) const;
  std::optional<int64_t> pick_latest() const;  // kAuto

  const config::KeelConfig& cfg_;
  const TrainState& state_;
  const CheckpointStore* store_;
  ResumeOptions opts_;
  std::function<void(const std::string&)> say_;
};

}  // namespace keel
