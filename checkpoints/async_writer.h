// The async checkpoint writer (checkpoint.async): snapshots the state, writes this rank's shard
// on a thread while training goes on, and commits as a synchronous save does (Note [async
// checkpoint]). The synchronous save is in checkpoint.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "framework/device_backend.h"

namespace keel {

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

}  // namespace keel
