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

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
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
