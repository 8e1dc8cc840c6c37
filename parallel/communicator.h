// Communicator: the one interface every collective goes through (MPI on host buffers now, NCCL
// on device buffers with the CUDA backend). Every call counts the bytes it moved, so tests and
// keel-bench can check communication volume against the analytic formula.
#pragma once

#include <cstdint>
#include <memory>

namespace keel {

enum class ReduceOp { kSum, kMax };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce(float* data, int64_t n, ReduceOp op) = 0;
  virtual void all_reduce(double* data, int64_t n, ReduceOp op) = 0;
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  virtual void barrier() = 0;
  // Bytes this rank sent for collectives so far (payload bytes, ring-algorithm independent).
  int64_t bytes_moved() const { return bytes_moved_; }

 protected:
  int64_t bytes_moved_ = 0;
};

// A group of one: every collective is the identity and moves nothing. Used for tp = 1 / dp = 1
// groups and for single-process unit tests.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(float*, int64_t, ReduceOp) override {}
  void all_reduce(double*, int64_t, ReduceOp) override {}
  void broadcast(float*, int64_t, int) override {}
  void barrier() override {}
};

// Where this rank sits: world = dp x tp, TP groups are consecutive ranks. Passed by reference to
// whatever needs it; there is no global process-group state.
struct Topology {
  int world_size = 1, world_rank = 0;
  int tp = 1, tp_rank = 0;
  int dp = 1, dp_rank = 0;
  Communicator* tp_comm = nullptr;
  Communicator* dp_comm = nullptr;

  // Single process: both groups are SelfCommunicators owned by the returned holder.
  static Topology single(std::unique_ptr<Communicator>& tp_holder,
                         std::unique_ptr<Communicator>& dp_holder) {
    tp_holder = std::make_unique<SelfCommunicator>();
    dp_holder = std::make_unique<SelfCommunicator>();
    Topology t;
    t.tp_comm = tp_holder.get();
    t.dp_comm = dp_holder.get();
    return t;
  }
};

}  // namespace keel
