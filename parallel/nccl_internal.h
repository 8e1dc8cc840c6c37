// Internal to keel's NCCL communicator, shared by nccl_communicator.cc (the collectives and the
// error paths) and nccl_setup.cc (joining, splitting and leaving a group): the launch order's
// definition, the watchdog guard around host waits and the polling backoff. Includes the CUDA
// runtime; not for use outside those two files.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/watchdog.h"

namespace keel {

// Note [nccl launch order]: the last collective enqueued by any communicator sharing this, as an
// event on its stream; a collective on another stream waits for it first.
class NcclLaunchOrder {
 public:
  NcclLaunchOrder() = default;
  ~NcclLaunchOrder() {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }
  NcclLaunchOrder(const NcclLaunchOrder&) = delete;
  NcclLaunchOrder& operator=(const NcclLaunchOrder&) = delete;

  // Before a collective is enqueued on `stream`: it waits for the previous one when that ran on
  // another stream (on the same stream, stream order serialises them already).
  cudaError_t before(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (last_ == nullptr || last_ == stream) return cudaSuccess;
    return cudaStreamWaitEvent(stream, done_, 0);
  }
  // After it was enqueued on `stream`: later collectives on other streams wait for it.
  cudaError_t after(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ == nullptr) {
      const cudaError_t rc = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
      if (rc != cudaSuccess) return rc;
    }
    // A wait already enqueued keeps the record it saw (CUDA's event semantics), so re-recording
    // is safe.
    const cudaError_t rc = cudaEventRecord(done_, stream);
    if (rc == cudaSuccess) last_ = stream;
    return rc;
  }

 private:
  std::mutex mu_;
  cudaEvent_t done_ = nullptr;
  cudaStream_t last_ = nullptr;  // the stream of the last collective; null: none yet
};

namespace nccl_internal {

// Polling: spin (yielding) for the first 2 ms, then sleep 20 us between polls so a long wait does
// not hold a core. A blocking collective's wait covers the compute queued before it as well
// (often milliseconds), and the GPU is idle from the collective's end until the host sees it and
// launches the next kernel: a sleeping poll would add its wake-up latency (20 us plus Linux's 50
// us timer slack) to every TP collective, a spinning one about a microsecond.
class Backoff {
 public:
  void pause() {
    if (std::chrono::steady_clock::now() - start_ < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace nccl_internal

}  // namespace keel
