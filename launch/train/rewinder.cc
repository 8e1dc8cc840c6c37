// The spike guard's rewind and retention pin (see rewinder.h).
#include "launch/train/rewinder.h"

#include <algorithm>

#include "checkpoints/checkpoint.h"
#include "parallel/agree.h"

namespace keel {

Rewinder::Rewinder(const config::KeelConfig& cfg, const Topology& topo, TrainState& state,
                   const CheckpointStore* store, const Resumer& resumer, const SpikeGuard& guard)
    : cfg_(cfg), topo_(topo), state_(state), store_(store), resumer_(resumer), guard_(guard) {}

RewindOutcome Rewinder::rewind(const StepResult& r, bool halt, const std::string& halt_reason) {
  const GuardState before = state_.guard;
  const int64_t limit = before.streak_first - cfg_.spike().rewind_margin();
  RewindOutcome out;
  std::optional<int64_t> target;
  if (store_) {
    // Note [one rank decides]: rank 0 picks, every rank learns the step (or its error).
    target = agree(topo_.world_comm, 0, "pick a rewind target",
                   [&] { return resumer_.pick_rewind_target(limit); });
  }
  if (!target) {
    if (halt) {
      out = {false,
             "halt",
             "halt",
             "",
             halt_reason + "; no checkpoint to restore: halting with the state of step " +
                 std::to_string(state_.step) + " (every anomalous update skipped)" +
                 (store_ ? ", saved" : ", not saved (no run directory)") + " (exit 3)",
             -1};
    } else if (!said_cannot_rewind_) {
      said_cannot_rewind_ = true;
      out = {false,
             "cannot_rewind",
             "skip",
             "",
             store_ ? "cannot rewind: no verified checkpoint at or before step " +
                          std::to_string(limit) +
                          " (spike.rewind_margin=" + std::to_string(cfg_.spike().rewind_margin()) +
                          "); updates stay skipped while the anomalies last"
                    : std::string("cannot rewind: the run has no checkpoints (no run directory); "
                                  "updates stay skipped while the anomalies last"),
             -1};
    }
    return out;
  }
  const std::string dir = store_->path_of(*target);
  load_checkpoint(dir, state_);
  GuardState& g = state_.guard;
  // What the guard learned since the checkpoint stays: every skipped range and every rewind.
  for (const SkippedRange& sk : before.skipped) {
    if (std::find(g.skipped.begin(), g.skipped.end(), sk) == g.skipped.end()) {
      g.skipped.push_back(sk);
    }
  }
  g.rewinds = before.rewinds;
  g.rewinds.push_back(r.step);
  int64_t batches = 0;
  const uint64_t batch = static_cast<uint64_t>(cfg_.train().global_batch());
  if (!halt) {
    // Skip from the checkpoint's position to spike.skip_batches batches past where the streak
    // began; the range is part of the run state from here on.
    const uint64_t from = state_.sampler.next_sample;
    const uint64_t to =
        before.streak_first_sample + static_cast<uint64_t>(cfg_.spike().skip_batches()) * batch;
    if (to > from) {
      g.skipped.push_back({from, to - from, r.step});
      state_.sampler.next_sample = to;
      batches = static_cast<int64_t>((to - from) / batch);
    }
    if (cfg_.spike().lr_scale() < 1.0 && cfg_.spike().cooldown_steps() > 0) {
      g.cooldown_from = *target;
    }
  }
  // Checkpoints newer than the target belong to the abandoned timeline: a resume must not pick
  // them up (Note [lineage]). Oldest first and LATEST last, so that a crash part-way resumes
  // from the pre-rewind state (which the guard then rewinds again), never from a half-abandoned
  // branch.
  int discarded = 0;
  if (topo_.world_rank == 0) {
    discarded = static_cast<int>(store_->remove_newer_than(*target).size());
    store_->set_latest(*target);
  }
  const std::string where = " to " + dir + " (step " + std::to_string(*target) + ")";
  const std::string also =
      discarded ? "; discarded " + std::to_string(discarded) + " newer checkpoint(s)" : "";
  if (halt) {
    out = {true,
           "halt",
           "halt",
           dir,
           halt_reason + ": restored" + where + also + "; halting (exit 3)",
           *target};
  } else {
    out = {true,
           "rewind",
           "rewind",
           dir,
           std::string(anomaly_name(r.guard.anomaly)) + " for " + std::to_string(before.streak) +
               " steps from step " + std::to_string(before.streak_first) + ": rewound" + where +
               ", skipping " + std::to_string(batches) + " batches of data" + also + " (rewind " +
               std::to_string(g.rewinds.size()) + ")",
           *target};
  }
  return out;
}

bool Rewinder::pinned(int64_t step) const {
  // A later anomaly (at step > now) rewinds to the newest checkpoint at or before
  // (that step - rewind_margin): keep the newest at or before (now + 1 - margin) and all newer.
  if (!guard_.enabled() || !store_) return false;
  const int64_t limit = state_.step + 1 - cfg_.spike().rewind_margin();
  for (int64_t s : store_->steps()) {
    if (s <= limit) return step >= s;
  }
  return true;
}

}  // namespace keel
