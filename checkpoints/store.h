// A directory of checkpoints (RUN/checkpoints): names, LATEST, which checkpoint is current, and
// removal (stale saves, retention, an abandoned branch). Only rank 0 changes it.
//
// Note [lineage]: "current" has one rule, used by keel-train's auto-resume, keel-ckpt and
// retention alike: lineage() lists the committed checkpoints to try, in order. A commit records in
// its manifest's parent_step the step LATEST named just before it, so a checkpoint newer than
// LATEST whose parent_step is LATEST's step is a commit whose LATEST update a crash cut off: it is
// whole and on the lineage, ahead of LATEST. Any other checkpoint newer than LATEST (a branch
// abandoned by --resume-from or a rewind whose removal was cut short, or one whose manifest does
// not read) is off_lineage(): never current, never counted by retention. Without a usable LATEST
// (missing, not a regular file, garbage, naming a missing directory) every committed checkpoint
// is on the lineage, newest first.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace keel {

class CheckpointStore {
 public:
  explicit CheckpointStore(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }
  std::string path_of(int64_t step) const;  // root/step_NNNNNNNN
  // Committed checkpoints (step_NNNNNNNN directories), newest first.
  std::vector<int64_t> steps() const;
  // The step LATEST names, when LATEST is a regular file naming a committed checkpoint.
  std::optional<int64_t> latest() const;
  void set_latest(int64_t step) const;  // atomic replace

  // The committed checkpoints to try as "current", in order (Note [lineage]): those newer than
  // LATEST whose parent_step is LATEST's step (newest first), LATEST's, then the older ones
  // newest first. Every committed checkpoint, newest first, without a usable LATEST.
  std::vector<int64_t> lineage() const;
  // Committed checkpoints newer than LATEST that lineage() leaves out, newest first; empty
  // without a usable LATEST.
  std::vector<int64_t> off_lineage() const;
  // Removes every committed checkpoint newer than `step` (a new lineage starts at `step`: after a
  // rewind, or --resume-from an older checkpoint), in an order that leaves the lineage's head as
  // it was until the last removal: off the lineage first, then the lineage from its oldest to its
  // head. A LATEST naming a removed checkpoint then names the newest one left (or is removed
  // when none is). Returns the removed steps, newest first; throws kIo naming the directory.
  std::vector<int64_t> remove_newer_than(int64_t step) const;
  // Removes step_*.tmp (and step_*.old) directories and LATEST.tmp.* files a crash left behind;
  // returns how many directories.
  int remove_stale() const;
  // Deletes the whole store: every checkpoint, LATEST and whatever a crash left (--overwrite,
  // starting a run over). Returns how many committed checkpoints it held; throws kIo naming the
  // root.
  size_t remove_all() const;
  // Of the lineage, keeps the newest `keep`, every step that is a multiple of `keep_every` (0:
  // none), every step `pinned` says to keep and LATEST's; removes the others. Checkpoints off the
  // lineage are neither counted nor removed. Returns the removed steps, newest first.
  std::vector<int64_t> retain(int keep, int keep_every,
                              const std::function<bool(int64_t)>& pinned = {}) const;

 private:
  struct Split {
    std::vector<int64_t> on, off;
  };
  Split split() const;
  // The step LATEST's text names (whether or not that checkpoint exists).
  std::optional<int64_t> latest_named() const;
  // Renames step_N to step_N.tmp (so a crash part-way leaves no half-removed checkpoint under a
  // committed name) and removes it. Throws kIo naming the directory.
  void remove_checkpoint(int64_t step) const;

  std::string root_;
};

}  // namespace keel
