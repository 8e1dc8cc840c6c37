// StagingCommunicator: collectives on device buffers over a host communicator (MPI), by copying
// through host memory: device -> host, the host collective, host -> device. The fallback that
// keeps any device runnable over plain MPI, as a non-CUDA-aware MPI needs (NCCL is the fast path
// on GPUs: parallel/nccl_communicator.h), and what lets the fake protected device of the tests
// (tests/fake_device.h) run TP and DP under mpiexec: the trainer's tensor collectives reach device
// memory only through this class's copies, so one that bypassed it would fault.
//
// Semantics and byte counters are the host communicator's (Communicator in communicator.h); the
// inner communicator counts the same bytes again, as it carries them. Device memory is reached
// through the device's registered memory backend (framework/device_backend.h). The host buffers
// grow to the largest collective seen and are reused (no allocation in steady state).
#pragma once

#include <memory>
#include <vector>

#include "framework/device_backend.h"
#include "parallel/communicator.h"

namespace keel {

class StagingCommunicator final : public Communicator {
 public:
  // `host` must outlive this communicator; `device` is where the buffers passed in live.
  StagingCommunicator(Communicator& host, Device device);

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  void all_reduce(float* data, int64_t n, ReduceOp op) override;
  void all_reduce(double* data, int64_t n, ReduceOp op) override;
  void all_reduce_bf16(float* data, int64_t n) override;
  void all_reduce_bf16(Bf16* data, int64_t n) override;
  void all_gather(const float* send, float* recv, int64_t n) override;
  void reduce_scatter(const float* send, float* recv, int64_t n) override;
  void broadcast(float* data, int64_t n, int root) override;
  void all_gather_bytes(const void* send, void* recv, int64_t bytes) override;
  void broadcast_bytes(void* data, int64_t bytes, int root) override;
  void barrier() override { host_.barrier(); }
  // The copy to the host happens now; the copy back when the request is waited for. Each
  // request has its own host buffer (buckets of one backward overlap).
  std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override;

 private:
  void to_host(void* dst, const void* src, size_t bytes);
  void to_device(void* dst, const void* src, size_t bytes);
  std::vector<float>& buffer(size_t index, size_t n);

  Communicator& host_;
  std::shared_ptr<DeviceBackend> backend_;
  std::vector<std::vector<float>> buffers_;  // [0], [1]: the blocking calls' send and receive
  std::vector<double> doubles_;
  std::vector<Bf16> bf16_;
  std::vector<unsigned char> bytes_send_, bytes_recv_;  // the byte forms' host copies
};

}  // namespace keel
