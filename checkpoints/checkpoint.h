// Sharded, atomic, verified checkpoints of the run's state (Note [run state]), loadable at any
// layout. Layout on disk (checkpoints/README.md):
//
//   RUN/checkpoints/LATEST                   "step_NNNNNNNN\n", replaced atomically after a commit
//   RUN/checkpoints/step_NNNNNNNN/manifest.pb   written last, by rank 0, ending with its checksum
//                                               (checkpoints/manifest_io.h)
//   RUN/checkpoints/step_NNNNNNNN/shard_RRRRR.bin   what world rank R owns, slice after slice
//
// Note [checkpoint commit]: every rank writes its shard into step_NNNNNNNN.tmp/ and fsyncs it, with
// an index of its slices beside it; after a barrier rank 0 merges the indexes into manifest.pb,
// fsyncs it and the directory, renames step_NNNNNNNN.tmp to step_NNNNNNNN, fsyncs the parent,
// then replaces LATEST (temporary file + rename). The manifest's parent_step is the step LATEST
// named before (Note [lineage] in store.h). A crash at any point leaves the previous checkpoint
// whole and LATEST naming it (or naming nothing newer than what exists); a stale .tmp is removed
// at the next start. Who writes what: a parameter's TP slice is written by DP rank 0
// of its TP rank (a replicated parameter by TP rank 0 only), and AdamW's moments by the rank that
// holds them (under ZeRO-1, each DP rank its slice), so no byte is written twice and nothing is
// gathered to one rank.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoints/manifest.pb.h"
#include "checkpoints/manifest_io.h"
#include "checkpoints/store.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"
#include "parallel/communicator.h"

namespace keel {

// Collective (every rank calls it): saves `state` as store.path_of(state.step) and points LATEST
// at it (Note [checkpoint commit]). Throws kIo naming the file and the OS reason; a failed save
// leaves the previous checkpoint and LATEST untouched.
// Points of a save where a test may crash a rank (debug.fault_point), through `on_phase`.
enum class SavePhase {
  kShardHalfWritten,  // this rank's shard: its first slice written, not yet fsynced
  kBeforeManifest,    // rank 0: every shard written, the manifest not yet
  kBeforeLatest,      // rank 0: step_N renamed into place, LATEST not yet replaced
};

// Called at each point with the step being saved; on the async writer's thread for
// kShardHalfWritten under checkpoint.async.
using SaveHook = std::function<void(SavePhase, int64_t step)>;

// `pinned`: checkpoints retention must keep whatever the policy says (the spike guard's rewind
// targets); called on rank 0 at the commit.
using Pinned = std::function<bool(int64_t step)>;

void save_checkpoint(const TrainState& state, const config::KeelConfig& cfg, const Topology& topo,
                     const CheckpointStore& store, const SaveHook& on_phase = {},
                     const Pinned& pinned = {});

// Note [async checkpoint]: checkpoint.async splits a save in two. begin() (collective) creates
// step_N.tmp, snapshots this rank's slices into host memory through the state's device-neutral
// copies, and starts a thread that writes and fsyncs the shard and its index (file I/O only: no
// MPI, no TrainState). Training goes on. finish() (collective) joins the thread on every rank,
// agrees whether every rank's write succeeded, and rank 0 commits on the calling thread exactly
// as a synchronous save does (Note [checkpoint commit]); a failure removes step_N.tmp and throws
// kIo without touching LATEST. done_locally() lets the trainer finish as soon as every rank's
// thread is done (it all-reduces that each step), so the commit lands a step or two after begin.
class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter(const config::KeelConfig& cfg, const Topology& topo,
                        const CheckpointStore& store, SaveHook on_phase = {}, Pinned pinned = {});
  ~AsyncCheckpointWriter();  // joins the thread; an unfinished save is not committed
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Collective: snapshots `state` and starts writing it. The previous save must be finished.
  void begin(const TrainState& state);
  // Collective: waits for the write on every rank and commits; returns the step saved. Throws
  // kIo (naming the rank's file and reason, or "another rank failed") when any rank failed.
  int64_t finish();
  bool pending() const { return pending_; }                // begun and not finished
  bool done_locally() const { return done_.load(); }       // this rank's thread is done
  int64_t pending_step() const { return header_.step(); }  // while pending()
  double snapshot_seconds() const { return snapshot_s_; }  // of the last begin()
  double write_seconds() const { return write_s_; }        // of the last finished write
  // Why this rank's last write failed (empty: it did not), once finish() has thrown.
  const std::string& local_error() const { return error_; }
  int64_t snapshot_bytes() const { return snapshot_elems_ * static_cast<int64_t>(sizeof(float)); }

 private:
  static double now();
  const config::KeelConfig& cfg_;
  const Topology& topo_;
  const CheckpointStore& store_;
  SaveHook on_phase_;
  Pinned pinned_;
  ckpt::Manifest header_;  // the manifest as of begin(), without slices
  std::string tmp_;        // step_N.tmp
  // This rank's slices back to back, in host memory of the state's device (pinned on a GPU).
  std::unique_ptr<HostBuffer> snapshot_;
  Device snapshot_device_ = Device::kCpu;
  int64_t snapshot_elems_ = 0;
  std::vector<int64_t> offsets_;
  std::string error_;  // set by the thread before done_
  std::atomic<bool> done_{false};
  bool pending_ = false;
  double snapshot_s_ = 0.0;
  double write_s_ = 0.0;
  std::thread thread_;
};

// Whether a checkpoint tensor of shape `stored` loads into parameter `spec`: the same shape, or,
// for a vocab-padded parameter (spec.valid_rows > 0), one that differs only in its padded rows.
bool loadable_shape(const ParamSpec& spec, const Shape& stored);

// read_manifest(dir) and parse_manifest(bytes, path): checkpoints/manifest_io.h.

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
// slice of the checkpoint in `dir` and checked. `m` is that checkpoint's manifest as
// read_manifest(dir) returned it (validated: the slices' geometry is trusted here). Throws kData
// as load_checkpoint.
std::vector<float> read_logical_tensor(const std::string& dir, const ckpt::Manifest& m,
                                       const std::string& name, ckpt::TensorKind kind);

const char* tensor_kind_name(ckpt::TensorKind kind);  // "param", "adam_m", "adam_v"

}  // namespace keel
