// Communicator: the one interface every collective goes through (MPI on host buffers now, NCCL
// on device buffers with the CUDA backend). Every call counts the bytes it moved, so tests and
// keel-bench can check communication volume against the analytic formula.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>

#include "framework/kernels/cuda/bf16.h"  // the Bf16 storage type only: no CUDA

namespace keel {

enum class ReduceOp { kSum, kMax };

// Handle of a non-blocking collective; wait() completes it (and is idempotent).
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;  // drives progress; true once complete
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place, element-wise over all ranks.
  virtual void all_reduce(float* data, int64_t n, ReduceOp op) = 0;
  virtual void all_reduce(double* data, int64_t n, ReduceOp op) = 0;
  // In-place sum of fp32 data with bf16 on the wire (Note [bf16 wire]); counts n * 2 bytes.
  virtual void all_reduce_bf16(float* data, int64_t n) = 0;
  // In-place sum of bf16 memory, each partial sum rounded to bf16 (Note [bf16 wire]); n * 2 bytes.
  virtual void all_reduce_bf16(Bf16* data, int64_t n) = 0;
  // recv[size() * n] = every rank's send[n], in rank order.
  virtual void all_gather(const float* send, float* recv, int64_t n) = 0;
  // recv[n] = sum over ranks of send[rank() * n, (rank() + 1) * n).
  virtual void reduce_scatter(const float* send, float* recv, int64_t n) = 0;
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  // Untyped forms for control values (int64 fields, enums, fingerprints; parallel/agree.h), moved
  // bit for bit: recv[size() * bytes] = every rank's send[bytes] in rank order (in place when
  // send == recv + rank() * bytes), and data[bytes] = root's data[bytes] on every rank.
  virtual void all_gather_bytes(const void* send, void* recv, int64_t bytes) = 0;
  virtual void broadcast_bytes(void* data, int64_t bytes, int root) = 0;
  // The same over int64 elements (counted as their bytes, n * 8).
  void all_gather_int64(const int64_t* send, int64_t* recv, int64_t n) {
    all_gather_bytes(send, recv, n * static_cast<int64_t>(sizeof(int64_t)));
  }
  void broadcast_int64(int64_t* data, int64_t n, int root) {
    broadcast_bytes(data, n * static_cast<int64_t>(sizeof(int64_t)), root);
  }
  virtual void barrier() = 0;
  // Non-blocking in-place sum; `data` must stay alive and untouched until wait().
  virtual std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) = 0;

  // Note [collective groups]: the blocking collectives called between group_start() and the
  // matching group_end() (nested pairs count as one group; use CommGroup) may complete only at
  // group_end(): NCCL launches them together (ncclGroupStart/End), one launch and one host wait
  // for several small all-reduces; MPI completes each at its call. So inside a group nothing may
  // read a collective's output or write its input, nor rely on one collective's result in the
  // next. all_reduce_bf16 of fp32 memory, the non-blocking all-reduce and the untyped forms are
  // not allowed inside a group on NCCL (kInternal there).
  void group_start() {
    if (group_depth_++ == 0) {
      group_first_call_ = calls_;
      begin_group();
    }
  }
  void group_end() {
    if (group_depth_ == 0) return;  // unbalanced: nothing to end
    if (--group_depth_ > 0) return;
    end_group();
    if (calls_ > group_first_call_) ++groups_;
  }
  bool in_group() const { return group_depth_ > 0; }
  // Groups that ended with at least one counted collective in them.
  int64_t groups() const { return groups_; }

  // Payload bytes of every collective this communicator ran: n * sizeof(element) for
  // all-reduce and broadcast, size() * n * sizeof for all-gather and reduce-scatter (the full
  // logical buffer), 0 for a group of one (the byte forms count bytes as the elements). Independent
  // of the algorithm MPI or NCCL picks.
  int64_t bytes_moved() const { return bytes_moved_; }
  int64_t calls() const { return calls_; }
  void reset_counters() {
    bytes_moved_ = 0;
    calls_ = 0;
    groups_ = 0;
    group_first_call_ = 0;
  }

 protected:
  // What a transport does when the outermost group starts and ends (Note [collective groups]);
  // nothing by default: each collective completes at its call.
  virtual void begin_group() {}
  virtual void end_group() {}
  void count(int64_t bytes) {
    bytes_moved_ += bytes;
    ++calls_;
  }
  int64_t bytes_moved_ = 0;
  int64_t calls_ = 0;

 private:
  int group_depth_ = 0;
  int64_t group_first_call_ = 0;
  int64_t groups_ = 0;
};

// A scope whose blocking collectives on `comm` form one group (Note [collective groups]): they
// may complete only when it closes. Its destructor ends the group (an exception unwinding through
// it ends it too, so the communicator is left outside any group).
class CommGroup {
 public:
  explicit CommGroup(Communicator& comm) : comm_(comm) { comm_.group_start(); }
  ~CommGroup() noexcept(false) {
    if (std::uncaught_exceptions() > uncaught_) {
      try {
        comm_.group_end();
      } catch (...) {
        // The error already unwinding is the one reported.
      }
    } else {
      comm_.group_end();
    }
  }
  CommGroup(const CommGroup&) = delete;
  CommGroup& operator=(const CommGroup&) = delete;

 private:
  Communicator& comm_;
  int uncaught_ = std::uncaught_exceptions();
};

// ---- Note [bf16 wire] ----
// The tensor-parallel all-reduces of activations and their gradients (parallel/tp_regions.h) may
// move bf16 instead of fp32 (parallel.tp_comm_dtype: AUTO, the default, means under
// train.precision=BF16; as Megatron-LM reduces in its bf16 activations' dtype), which halves the
// bytes on the critical path. Two forms, each rank's values summed in bf16 (each partial sum
// rounded to bf16, in whatever order the transport adds: NCCL's ring or MPI's tree, as NCCL's own
// bf16 sum does), every rank receiving the same bits:
// - all_reduce_bf16(Bf16*): bf16 memory summed in place. Under BF16 on a GPU the layers write the
//   row-parallel outputs and most column-parallel input gradients in bf16 for it
//   (ModelDims::tp_bf16_act), and the residual add reads the former, one pass widens the latter;
// - all_reduce_bf16(float*): fp32 memory rounded to bf16 (nearest even) around the sum and the
//   sums widened back in place: where the tensor is fp32 (the embedding's output, a gated MLP's
//   accumulated input gradient, a post-sublayer norm's input, FP32 precision, the CPU). On a GPU
//   that is two passes over the buffer (12 bytes of memory traffic per element) against 2 bytes
//   saved per element each time it crosses a link (2 (n - 1) / n times in a ring).
// A group of one moves nothing and leaves data unrounded, so tp = 1 computes exactly as before.

class DoneRequest final : public CommRequest {
 public:
  void wait() override {}
  bool test() override { return true; }
};

// A group of one: every collective is the identity and moves nothing. Used for tp = 1 / dp = 1
// groups and for single-process unit tests.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(float*, int64_t, ReduceOp) override {}
  void all_reduce(double*, int64_t, ReduceOp) override {}
  void all_reduce_bf16(float*, int64_t) override {}
  void all_reduce_bf16(Bf16*, int64_t) override {}
  // The gather and scatter of a group of one copy send into recv on the host: host memory only.
  // Device memory never reaches them: a device's tensors go through Topology::tp_tensors() and
  // dp_tensors(), which are device communicators (NCCL, or StagingCommunicator through the host)
  // whenever there is more than one rank, and on one rank their callers do not run (sequence
  // parallelism needs tp > 1, ZeRO-1's shards dp > 1, sharded parameters tp > 1). In place
  // (send == recv) nothing is copied. Nothing here can ask which device memory is on; the CUDA
  // emulator's host guard shows the training path keeps to this (tests/cuda_emu/host_guard.h,
  // ctests cuda_emu.HostGuardTest.*, cuda_emu.host_guard_gpu_tests, cuda_emu.host_guard_nccl).
  void all_gather(const float* send, float* recv, int64_t n) override {
    if (send != recv) std::copy(send, send + n, recv);
  }
  void reduce_scatter(const float* send, float* recv, int64_t n) override {
    if (send != recv) std::copy(send, send + n, recv);
  }
  void broadcast(float*, int64_t, int) override {}
  void all_gather_bytes(const void* send, void* recv, int64_t bytes) override {
    if (send != recv && bytes > 0) std::memmove(recv, send, static_cast<size_t>(bytes));
  }
  void broadcast_bytes(void*, int64_t, int) override {}
  void barrier() override {}
  std::unique_ptr<CommRequest> iall_reduce(float*, int64_t) override {
    return std::make_unique<DoneRequest>();
  }
};

// Where this rank sits: world = dp x tp, TP groups are consecutive ranks. Passed by reference to
// whatever needs it; there is no global process-group state.
struct Topology {
  int world_size = 1, world_rank = 0;
  int tp = 1, tp_rank = 0;
  int dp = 1, dp_rank = 0;
  // MPI groups over host memory: control, agreement and the host scalars each step logs.
  Communicator* tp_comm = nullptr;
  Communicator* dp_comm = nullptr;
  Communicator* world_comm = nullptr;  // null in single-process topologies
  // The same TP and DP groups for the model's tensors (activations, gradients, parameters), in
  // memory of the run's device: NCCL on GPUs, or the MPI groups staged through the host; null
  // means tp_comm / dp_comm themselves (the CPU). Layers and gradient sync use only these.
  Communicator* tp_tensor_comm = nullptr;
  Communicator* dp_tensor_comm = nullptr;
  Communicator& tp_tensors() const { return tp_tensor_comm ? *tp_tensor_comm : *tp_comm; }
  Communicator& dp_tensors() const { return dp_tensor_comm ? *dp_tensor_comm : *dp_comm; }

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
