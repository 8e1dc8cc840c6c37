// MPI implementation of Communicator. Counts vary as int in MPI; buffers longer than max_count
// elements (per rank's block for all-gather and reduce-scatter) are sent in chunks, which changes
// neither the result nor the bytes counted.
#include "parallel/mpi_communicator.h"

#include <algorithm>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/cuda/bf16.h"
#include "parallel/mpi_bf16.h"

namespace keel {

namespace {

// Throws kComm: "MPI_Allreduce over the tensor-parallel group at step 3 failed: <MPI's reason>".
void check(int rc, const char* what, const std::string& group, const Watchdog* w) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  const long long step = w ? w->step() : 0;
  const std::string when = step > 0 ? " at step " + std::to_string(step) : "";
  KEEL_FAIL(kComm, what, " over the ", group, " group", when, " failed: ", std::string(msg, len));
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

class MpiRequest final : public CommRequest {
 public:
  MpiRequest(std::vector<MPI_Request> reqs, Watchdog* w, const std::string& group)
      : reqs_(std::move(reqs)), w_(w), group_(group) {}
  ~MpiRequest() override {
    if (done_) return;
    try {
      wait();
    } catch (const Error&) {
      // Destroyed while unwinding from an earlier error: that error is the one reported.
    }
  }
  void wait() override {
    if (done_) return;
    WatchdogScope g(w_, "all_reduce (non-blocking)", group_);
    check(MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall", group_, w_);
    done_ = true;
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    check(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE),
          "MPI_Testall", group_, w_);
    done_ = flag != 0;
    return done_;
  }

 private:
  std::vector<MPI_Request> reqs_;
  Watchdog* w_;
  std::string group_;
  bool done_ = false;
};

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, Watchdog* watchdog,
                                 int64_t max_count)
    : comm_(comm), name_(std::move(name)), watchdog_(watchdog), max_count_(max_count) {
  KEEL_CHECK(max_count_ >= 1 && max_count_ <= INT_MAX, kInternal,
             "MpiCommunicator: max_count=", max_count_, " must be in [1, INT_MAX]");
  if (comm_ != MPI_COMM_WORLD) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", name_,
          watchdog_);
  }
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", name_, watchdog_);
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size", name_, watchdog_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

template <typename T>
void MpiCommunicator::all_reduce_chunked(T* data, int64_t n, ReduceOp op, MPI_Datatype type) {
  if (size_ == 1 || n == 0) return;
  count(n * static_cast<int64_t>(sizeof(T)));
  WatchdogScope g(watchdog_, "all_reduce", name_);
  for (int64_t off = 0; off < n; off += max_count_) {
    const int c = static_cast<int>(std::min(max_count_, n - off));
    check(MPI_Allreduce(MPI_IN_PLACE, data + off, c, type, mpi_op(op), comm_), "MPI_Allreduce",
          name_, watchdog_);
  }
}

void MpiCommunicator::all_reduce(float* data, int64_t n, ReduceOp op) {
  all_reduce_chunked(data, n, op, MPI_FLOAT);
}

void MpiCommunicator::all_reduce(double* data, int64_t n, ReduceOp op) {
  all_reduce_chunked(data, n, op, MPI_DOUBLE);
}

void MpiCommunicator::sum_bf16(Bf16* data, int64_t n) {
  WatchdogScope g(watchdog_, "all_reduce (bf16)", name_);
  for (int64_t off = 0; off < n; off += max_count_) {
    const int c = static_cast<int>(std::min(max_count_, n - off));
    check(MPI_Allreduce(MPI_IN_PLACE, data + off, c, MPI_UINT16_T, bf16_sum_op(), comm_),
          "MPI_Allreduce (bf16)", name_, watchdog_);
  }
}

void MpiCommunicator::all_reduce_bf16(Bf16* data, int64_t n) {
  if (size_ == 1 || n == 0) return;
  count(n * static_cast<int64_t>(sizeof(Bf16)));
  sum_bf16(data, n);
}

void MpiCommunicator::all_reduce_bf16(float* data, int64_t n) {
  if (size_ == 1 || n == 0) return;
  count(n * static_cast<int64_t>(sizeof(Bf16)));
  // The staging copy grows on the first step only (shapes repeat).
  if (wire_.size() < static_cast<size_t>(n)) wire_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) wire_[i] = to_bf16(data[i]);
  sum_bf16(wire_.data(), n);
  for (int64_t i = 0; i < n; ++i) data[i] = from_bf16(wire_[i]);
}

template <typename T>
void MpiCommunicator::all_gather_chunked(const T* send, T* recv, int64_t n, MPI_Datatype type) {
  if (size_ == 1) {
    // A host copy: MpiCommunicator's buffers are host memory (a device's tensors reach MPI only
    // through StagingCommunicator's host copies; SelfCommunicator's note in communicator.h).
    if (send != recv) std::copy(send, send + n, recv);
    return;
  }
  count(n * size_ * static_cast<int64_t>(sizeof(T)));
  WatchdogScope g(watchdog_, "all_gather", name_);
  if (n <= max_count_) {
    // In place when this rank's block already sits at its slot of recv (ZeRO-1 parameters).
    const void* sendbuf = send == recv + rank_ * n ? MPI_IN_PLACE : send;
    check(MPI_Allgather(sendbuf, static_cast<int>(n), type, recv, static_cast<int>(n), type, comm_),
          "MPI_Allgather", name_, watchdog_);
    return;
  }
  // Per-rank blocks beyond MPI's int counts: gather column chunks through a staging buffer. In
  // place is safe: chunk c of this rank's block is copied out before it is written back (with
  // the same values).
  std::vector<T> mine, staged;
  for (int64_t c = 0; c < n; c += max_count_) {
    const int64_t k = std::min(max_count_, n - c);
    mine.assign(send + c, send + c + k);
    staged.resize(static_cast<size_t>(k) * size_);
    check(MPI_Allgather(mine.data(), static_cast<int>(k), type, staged.data(), static_cast<int>(k),
                        type, comm_),
          "MPI_Allgather", name_, watchdog_);
    for (int r = 0; r < size_; ++r) {
      std::copy(staged.begin() + r * k, staged.begin() + (r + 1) * k, recv + r * n + c);
    }
  }
}

void MpiCommunicator::all_gather(const float* send, float* recv, int64_t n) {
  all_gather_chunked(send, recv, n, MPI_FLOAT);
}

void MpiCommunicator::all_gather_bytes(const void* send, void* recv, int64_t bytes) {
  all_gather_chunked(static_cast<const unsigned char*>(send), static_cast<unsigned char*>(recv),
                     bytes, MPI_BYTE);
}

void MpiCommunicator::reduce_scatter(const float* send, float* recv, int64_t n) {
  if (size_ == 1) {
    if (send != recv) std::copy(send, send + n, recv);  // host memory, as all_gather's
    return;
  }
  count(n * size_ * static_cast<int64_t>(sizeof(float)));
  WatchdogScope g(watchdog_, "reduce_scatter", name_);
  if (n <= max_count_) {
    check(MPI_Reduce_scatter_block(send, recv, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_),
          "MPI_Reduce_scatter_block", name_, watchdog_);
    return;
  }
  // Per-rank blocks beyond MPI's int counts: reduce column chunks through a staging buffer.
  std::vector<float> staged;
  for (int64_t c = 0; c < n; c += max_count_) {
    const int64_t k = std::min(max_count_, n - c);
    staged.resize(static_cast<size_t>(k) * size_);
    for (int r = 0; r < size_; ++r) {
      std::copy(send + r * n + c, send + r * n + c + k, staged.begin() + r * k);
    }
    check(MPI_Reduce_scatter_block(staged.data(), recv + c, static_cast<int>(k), MPI_FLOAT, MPI_SUM,
                                   comm_),
          "MPI_Reduce_scatter_block", name_, watchdog_);
  }
}

template <typename T>
void MpiCommunicator::broadcast_chunked(T* data, int64_t n, int root, MPI_Datatype type) {
  if (size_ == 1 || n == 0) return;
  count(n * static_cast<int64_t>(sizeof(T)));
  WatchdogScope g(watchdog_, "broadcast", name_);
  for (int64_t off = 0; off < n; off += max_count_) {
    const int c = static_cast<int>(std::min(max_count_, n - off));
    check(MPI_Bcast(data + off, c, type, root, comm_), "MPI_Bcast", name_, watchdog_);
  }
}

void MpiCommunicator::broadcast(float* data, int64_t n, int root) {
  broadcast_chunked(data, n, root, MPI_FLOAT);
}

void MpiCommunicator::broadcast_bytes(void* data, int64_t bytes, int root) {
  broadcast_chunked(static_cast<unsigned char*>(data), bytes, root, MPI_BYTE);
}

void MpiCommunicator::barrier() {
  if (size_ == 1) return;
  WatchdogScope g(watchdog_, "barrier", name_);
  check(MPI_Barrier(comm_), "MPI_Barrier", name_, watchdog_);
}

std::unique_ptr<CommRequest> MpiCommunicator::iall_reduce(float* data, int64_t n) {
  if (size_ == 1 || n == 0) return std::make_unique<DoneRequest>();
  count(n * static_cast<int64_t>(sizeof(float)));
  std::vector<MPI_Request> reqs;
  for (int64_t off = 0; off < n; off += max_count_) {
    const int c = static_cast<int>(std::min(max_count_, n - off));
    MPI_Request r;
    check(MPI_Iallreduce(MPI_IN_PLACE, data + off, c, MPI_FLOAT, MPI_SUM, comm_, &r),
          "MPI_Iallreduce", name_, watchdog_);
    reqs.push_back(r);
  }
  return std::make_unique<MpiRequest>(std::move(reqs), watchdog_, name_);
}

}  // namespace keel
