// Communicator over an MPI communicator on host buffers (the CPU backend's transport).
#pragma once

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "framework/kernels/cuda/bf16.h"
#include "parallel/communicator.h"
#include "parallel/watchdog.h"

namespace keel {

class MpiCommunicator final : public Communicator {
 public:
  // MPI counts are int: a collective over more elements than this is issued as several MPI calls
  // of at most this many elements each (per rank's block for all-gather and reduce-scatter).
  // Half of INT_MAX leaves headroom for implementations that add counts internally.
  static constexpr int64_t kDefaultMaxCount = INT_MAX / 2;

  // Takes ownership of `comm` (freed on destruction) and sets MPI_ERRORS_RETURN on it, so a failed
  // call throws kComm naming the call, the group and the step instead of aborting inside MPI.
  // `name` labels error and watchdog messages. `max_count` (1 .. INT_MAX) is the chunk size
  // above; only tests pass a smaller one, to run the chunked paths on small buffers.
  MpiCommunicator(MPI_Comm comm, std::string name, Watchdog* watchdog,
                  int64_t max_count = kDefaultMaxCount);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t max_count() const { return max_count_; }
  void all_reduce(float* data, int64_t n, ReduceOp op) override;
  void all_reduce(double* data, int64_t n, ReduceOp op) override;
  // Host buffers rounded into a bf16 copy, summed by MPI as MPI_UINT16_T with the bf16 sum
  // (parallel/mpi_bf16.h), widened back.
  void all_reduce_bf16(float* data, int64_t n) override;
  void all_reduce_bf16(Bf16* data, int64_t n) override;
  void all_gather(const float* send, float* recv, int64_t n) override;
  void reduce_scatter(const float* send, float* recv, int64_t n) override;
  void broadcast(float* data, int64_t n, int root) override;
  void all_gather_bytes(const void* send, void* recv, int64_t bytes) override;
  void broadcast_bytes(void* data, int64_t bytes, int root) override;
  void barrier() override;
  std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override;

 private:
  void sum_bf16(Bf16* data, int64_t n);  // the MPI calls of both all_reduce_bf16, uncounted
  template <typename T>
  void all_reduce_chunked(T* data, int64_t n, ReduceOp op, MPI_Datatype type);
  template <typename T>
  void all_gather_chunked(const T* send, T* recv, int64_t n, MPI_Datatype type);
  template <typename T>
  void broadcast_chunked(T* data, int64_t n, int root, MPI_Datatype type);

  MPI_Comm comm_;
  std::string name_;
  Watchdog* watchdog_;
  int64_t max_count_;
  int rank_ = 0, size_ = 1;
  std::vector<Bf16> wire_;  // all_reduce_bf16(float*)'s bf16 copy
};

}  // namespace keel
