// Sharded, atomic, verified checkpoints of the run's state (Note [run state]), loadable at any
// layout. Layout on disk (checkpoints/README.md):
//
//   RUN/checkpoints/LATEST                   "step_NNNNNNNN\n", replaced atomically after a commit
//   RUN/checkpoints/step_NNNNNNNN/manifest.pb   written last, by rank 0
//   RUN/checkpoints/step_NNNNNNNN/shard_RRRRR.bin   what world rank R owns, slice after slice
//
// Note [checkpoint commit]: every rank writes its shard into step_NNNNNNNN.tmp/ and fsyncs it, with
// an index of its slices beside it; after a barrier rank 0 merges the indexes into manifest.pb,
// fsyncs it and the directory, renames step_NNNNNNNN.tmp to step_NNNNNNNN, fsyncs the parent,
// then replaces LATEST (temporary file + rename). A crash at any point leaves the previous
// checkpoint whole and LATEST naming it (or naming nothing newer than what exists); a stale .tmp
// is removed at the next start. Who writes what: a parameter's TP slice is written by DP rank 0
// of its TP rank (a replicated parameter by TP rank 0 only), and AdamW's moments by the rank that
// holds them (under ZeRO-1, each DP rank its slice), so no byte is written twice and nothing is
// gathered to one rank.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "checkpoints/manifest.pb.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"
#include "parallel/communicator.h"

namespace keel {

inline constexpr uint32_t kCheckpointFormatVersion = 1;

// A directory of checkpoints (RUN/checkpoints): names, LATEST, listing and retention. Only rank 0
// changes it.
class CheckpointStore {
 public:
  explicit CheckpointStore(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }
  std::string path_of(int64_t step) const;  // root/step_NNNNNNNN
  // Committed checkpoints (step_NNNNNNNN directories), newest first.
  std::vector<int64_t> steps() const;
  // The step LATEST names, when it names a committed checkpoint.
  std::optional<int64_t> latest() const;
  void set_latest(int64_t step) const;  // atomic replace
  // Removes step_*.tmp (and step_*.old) directories a crash left behind; returns how many.
  int remove_stale() const;
  // Keeps the newest `keep`, every step that is a multiple of `keep_every` (0: none) and every
  // step `pinned` says to keep; removes the others. Returns the removed steps.
  std::vector<int64_t> retain(int keep, int keep_every,
                              const std::function<bool(int64_t)>& pinned = {}) const;

 private:
  std::string root_;
};

// Collective (every rank calls it): saves `state` as store.path_of(state.step) and points LATEST
// at it (Note [checkpoint commit]). Throws kIo naming the file and the OS reason; a failed save
// leaves the previous checkpoint and LATEST untouched.
// Points of a save where a test may crash a rank (debug.fault_point), through `on_phase`.
enum class SavePhase {
  kShardHalfWritten,  // this rank's shard: its first slice written, not yet fsynced
  kBeforeManifest,    // rank 0: every shard written, the manifest not yet
  kBeforeLatest,      // rank 0: step_N renamed into place, LATEST not yet replaced
};

void save_checkpoint(const TrainState& state, const config::KeelConfig& cfg, const Topology& topo,
                     const CheckpointStore& store,
                     const std::function<void(SavePhase)>& on_phase = {});

// Reads `dir`/manifest.pb. Throws kData naming the file when it is missing, unreadable, not a
// manifest, or of a format version newer than kCheckpointFormatVersion.
ckpt::Manifest read_manifest(const std::string& dir);

// Checks every shard file's size and every slice's checksum and coverage. Throws kData naming the
// file, the tensor and the reason.
void verify_checkpoint(const std::string& dir);

// Collective: loads `dir` into `state` at this rank's layout, whatever layout wrote it, reading
// only the slices that overlap what this rank holds and checking each one's checksum. Sets the
// parameters, AdamW's m, v and t, the step, the sampler state and the guard state (not the data
// fingerprints, which describe the data this run opened). Throws kData naming the file, the tensor
// and the reason (a changed shape, a missing tensor, a checksum mismatch, a short file).
ckpt::Manifest load_checkpoint(const std::string& dir, TrainState& state);

// The whole logical tensor `name` of `kind` (row-major, its global shape), assembled from every
// slice of the checkpoint in `dir` (manifest `m`) and checked. Throws kData as load_checkpoint.
std::vector<float> read_logical_tensor(const std::string& dir, const ckpt::Manifest& m,
                                       const std::string& name, ckpt::TensorKind kind);

const char* tensor_kind_name(ckpt::TensorKind kind);  // "param", "adam_m", "adam_v"

}  // namespace keel
