// Communicator over an MPI communicator on host buffers (the CPU backend's transport).
#pragma once

#include <mpi.h>

#include <string>

#include "parallel/communicator.h"
#include "parallel/watchdog.h"

namespace keel {

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed on destruction). `name` labels watchdog messages.
  MpiCommunicator(MPI_Comm comm, std::string name, Watchdog* watchdog);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(float* data, int64_t n, ReduceOp op) override;
  void all_reduce(double* data, int64_t n, ReduceOp op) override;
  void all_gather(const float* send, float* recv, int64_t n) override;
  void reduce_scatter(const float* send, float* recv, int64_t n) override;
  void broadcast(float* data, int64_t n, int root) override;
  void barrier() override;
  std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override;

 private:
  MPI_Comm comm_;
  std::string name_;
  Watchdog* watchdog_;
  int rank_ = 0, size_ = 1;
};

}  // namespace keel
