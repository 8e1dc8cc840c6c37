// The parts of a checkpoint save that the synchronous save (checkpoint.cc) and the async writer
// (async_writer.cc) share: planning this rank's shard, snapshotting and writing it, and the
// collective steps around it (creating step_N.tmp, committing). Internal to checkpoints/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"

namespace keel::ckpt_save {

// One slice of this rank's shard: what it is and where its elements come from.
struct PlannedSlice {
  const StateParam* p = nullptr;
  ckpt::TensorKind kind = ckpt::PARAM;
  ckpt::Slice slice;  // geometry; file, offset and checksum are set when written
};

// This rank's slices in file order (see checkpoint.h's "who writes what").
std::vector<PlannedSlice> plan_my_shard(const TrainState& state, const Topology& topo);
// Copies one planned slice's elements out of the state (device-neutral copies) into `out`.
void copy_slice(const TrainState& state, const PlannedSlice& ps, float* out);
// Writes this rank's shard and its index into `tmp`; `data(i)` gives slice i's elements (valid
// until the next call). Touches no MPI and no TrainState: the async writer runs it on its own
// thread. Throws kIo naming the file and the OS reason.
void write_shard(const std::vector<PlannedSlice>& plan, const std::vector<std::string>& names,
                 const std::function<const float*(size_t)>& data, int rank, int64_t step,
                 const std::string& tmp, const SaveHook& on_phase);
std::vector<std::string> names_of(const std::vector<PlannedSlice>& plan);
// Everything in the manifest but the slices and files, as of now: the run's counters and every
// tensor's record (registration order x kind).
ckpt::Manifest manifest_header(const TrainState& state, const config::KeelConfig& cfg,
                               const Topology& topo);
// Collective: rank 0 (re)creates `tmp` (and the store's root); every rank learns if it failed.
void make_tmp_dir(const Topology& topo, const CheckpointStore& store, const std::string& tmp,
                  int64_t step);
// Collective: after every rank's shard (`err`: this rank's failure, empty if none), rank 0
// commits `header`; every rank learns the outcome. A failure removes `tmp` (rank 0).
void finish_save(const Topology& topo, const config::Checkpoint& policy,
                 const CheckpointStore& store, const std::string& tmp, ckpt::Manifest header,
                 std::string err, const SaveHook& on_phase, const Pinned& pinned);

}  // namespace keel::ckpt_save
