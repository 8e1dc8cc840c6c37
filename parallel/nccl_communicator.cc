// NCCL implementation of Communicator (see nccl_communicator.h, Note [nccl errors]): the
// collectives, groups and non-blocking requests, the host's waits for them, and the error and abort
// paths. Joining, splitting and leaving a group are in nccl_setup.cc.
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/ops.h"
#include "parallel/nccl_internal.h"

namespace keel {

static_assert(NcclCommunicator::kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
static_assert(NcclCommunicator::kNoColor == NCCL_SPLIT_NOCOLOR);

using nccl_internal::Backoff;

namespace {

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

}  // namespace

// A non-blocking all-reduce: an event recorded after it on the communicator's stream.
class NcclRequest final : public CommRequest {
 public:
  // The all-reduce is already enqueued: if this throws, nobody waits for it, so the communicator
  // is marked failed (its destructor aborts instead of waiting on peers).
  NcclRequest(NcclCommunicator& comm, int64_t n, cudaStream_t stream) : comm_(comm), n_(n) {
    cudaError_t rc = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (rc != cudaSuccess) {
      comm_.failed_ = true;
      KEEL_CUDA_CHECK(rc, "iall_reduce over ", comm_.name(), " n=", n_);
    }
    rc = cudaEventRecord(event_, stream);
    if (rc != cudaSuccess) {
      cudaEventDestroy(event_);
      comm_.failed_ = true;
      KEEL_CUDA_CHECK(rc, "iall_reduce over ", comm_.name(), " n=", n_);
    }
  }
  ~NcclRequest() override {
    if (!done_) {
      try {
        wait();
      } catch (const Error&) {
        // Destroyed while unwinding from an earlier error: that error is the one reported.
      }
    }
    cudaEventDestroy(event_);
  }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;

  void wait() override {
    if (done_) return;
    comm_.wait_until([this] { return cudaEventQuery(event_); }, "all_reduce (non-blocking)", n_);
    done_ = true;
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear the runtime's record of it
      comm_.throw_if_aborted("all_reduce (non-blocking)", n_);
      comm_.check_async_error("all_reduce (non-blocking)", n_);
      return false;
    }
    if (rc != cudaSuccess) comm_.failed_ = true;
    KEEL_CUDA_CHECK(rc, "all_reduce (non-blocking) over the ", comm_.name(), " group n=", n_);
    comm_.throw_if_aborted("all_reduce (non-blocking)", n_);  // drained by an abort: partial
    done_ = true;
    return true;
  }

 private:
  NcclCommunicator& comm_;
  int64_t n_;
  cudaEvent_t event_ = nullptr;
  bool done_ = false;
};

std::string NcclCommunicator::error_message(int status, const char* call, const std::string& group,
                                            int rank, int size, int64_t n, long long step,
                                            const std::string& detail) {
  const auto rc = static_cast<ncclResult_t>(status);
  const std::string elements =
      n < 0 ? std::string() : detail::concat(", ", n, n == 1 ? " element" : " elements");
  return detail::concat(call, " over the ", group, " group (rank ", rank, " of ", size, elements,
                        ")", step > 0 ? detail::concat(" at step ", step) : std::string(),
                        " failed: ", ncclGetErrorString(rc), detail.empty() ? "" : " (", detail,
                        detail.empty() ? "" : ")");
}

void NcclCommunicator::abort() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true) || comm_ == nullptr) return;
  ncclCommAbort(comm_);
}

void NcclCommunicator::fail(int status, const char* call, int64_t n, const std::string& detail) {
  failed_ = true;
  any_failed_ = true;
  const long long step = watchdog_ ? watchdog_->step() : 0;
  throw Error(ErrorKind::kComm, error_message(status, call, name_, rank_, size_, n, step, detail),
              __FILE__, __LINE__);
}

void NcclCommunicator::check(int status, const char* call, int64_t n) {
  if (status == ncclSuccess) return;
  // ncclGetLastError holds NCCL's own words (which peer, which transport) for the failed call.
  const char* last = ncclGetLastError(comm_);
  fail(status, call, n, last != nullptr ? last : "");
}

void NcclCommunicator::throw_if_aborted(const char* op, int64_t n) {
  if (!aborted_.load()) return;
  const long long step = watchdog_ ? watchdog_->step() : 0;
  KEEL_FAIL(kComm, op, " over the ", name_, " group (rank ", rank_, " of ", size_,
            n < 0 ? std::string() : detail::concat(", ", n, " elements"), ")",
            step > 0 ? detail::concat(" at step ", step) : std::string(),
            " failed: the communicator was aborted (ncclCommAbort)");
}

bool NcclCommunicator::poll_async(int* async_out, std::string* last, int64_t n) {
  ncclResult_t rc = ncclSuccess, async = ncclSuccess;
  {
    // Held for one poll only, so abort() (the watchdog's hook) gets it between polls.
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load() || comm_ == nullptr) return false;
    rc = ncclCommGetAsyncError(comm_, &async);
    if (rc == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      const char* words = ncclGetLastError(comm_);
      if (words != nullptr) *last = words;
    }
  }
  if (rc != ncclSuccess) fail(rc, "ncclCommGetAsyncError", n, "");
  *async_out = async;
  return true;
}

void NcclCommunicator::check_async_error(const char* op, int64_t n) {
  int polled = ncclSuccess;
  std::string last;  // NCCL's words, copied before the abort frees the communicator
  if (!poll_async(&polled, &last, n)) return;
  const auto async = static_cast<ncclResult_t>(polled);
  if (async == ncclSuccess || async == ncclInProgress) return;
  const std::string detail = detail::concat("asynchronous NCCL error; communicator aborted",
                                            last.empty() ? std::string() : ": " + last);
  abort();
  fail(async, op, n, detail);
}

template <typename Query>
void NcclCommunicator::wait_until(Query done, const char* op, int64_t n) {
  WatchdogScope g(watchdog_, op, name_);
  Backoff backoff;
  for (;;) {
    const cudaError_t rc = done();
    if (rc == cudaSuccess) {
      // ncclCommAbort stops NCCL's kernels and the stream drains: "complete" then holds a
      // partial result, so an abort still throws.
      throw_if_aborted(op, n);
      return;
    }
    if (rc != cudaErrorNotReady) {
      failed_ = true;
      KEEL_CUDA_CHECK(rc, op, " over the ", name_, " group (rank ", rank_, " of ", size_,
                      n < 0 ? std::string() : detail::concat(", ", n, " elements"), ")");
    }
    cudaGetLastError();  // "not ready" is not an error: clear the runtime's record of it
    throw_if_aborted(op, n);
    check_async_error(op, n);
    backoff.pause();
  }
}

template <typename Enqueue>
void NcclCommunicator::enqueue(Enqueue enqueue, CUstream_st* stream, const char* call,
                               const char* op, int64_t n) {
  int status = ncclSuccess;
  std::string last;  // NCCL's words, copied while the communicator is alive
  cudaError_t ordered = cudaSuccess;
  {
    // Under the watchdog too: a blocking communicator's first collective of an algorithm sets up
    // its connections inside the call (NCCL_RUNTIME_CONNECT), waiting for every peer.
    WatchdogScope g(watchdog_, call, name_);
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load() && comm_ != nullptr) {
      // Note [nccl launch order]: after the previous collective of the shared order when it ran
      // on another stream; then this one is the previous.
      ordered = order_->before(stream);
      if (ordered == cudaSuccess) {
        status = enqueue(comm_);
        if (status != ncclSuccess && status != ncclInProgress) {
          const char* words = ncclGetLastError(comm_);
          if (words != nullptr) last = words;
        }
      }
    }
  }
  if (ordered != cudaSuccess) failed_ = true;
  KEEL_CUDA_CHECK(ordered, call, " over the ", name_, " group: ordering it after the previous ",
                  "collective (Note [nccl launch order]), n=", n);
  throw_if_aborted(op, n);
  if (status == ncclInProgress) {
    settle(call, n);  // Note [nccl non-blocking]: enqueued once it settles
    status = ncclSuccess;
  }
  if (status != ncclSuccess) fail(status, call, n, last);
  // Grouped collectives launch at ncclGroupEnd: end_group() records the order then.
  if (in_group()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load()) ordered = order_->after(stream);
  }
  if (ordered != cudaSuccess) failed_ = true;
  KEEL_CUDA_CHECK(ordered, call, " over the ", name_, " group: ordering what follows after it ",
                  "(Note [nccl launch order]), n=", n);
}

void NcclCommunicator::settle(const char* call, int64_t n) {
  WatchdogScope g(watchdog_, call, name_);
  Backoff backoff;
  for (;;) {
    int polled = ncclSuccess;
    std::string last;
    if (!poll_async(&polled, &last, n)) break;
    const auto async = static_cast<ncclResult_t>(polled);
    if (async == ncclSuccess) return;
    if (async != ncclInProgress) {
      check_async_error(call, n);  // aborts and throws naming the call
      fail(async, call, n, last);
    }
    backoff.pause();
  }
  throw_if_aborted(call, n);
}

void NcclCommunicator::begin_group() {
  throw_if_aborted("ncclGroupStart", -1);
  check(ncclGroupStart(), "ncclGroupStart", -1);
}

void NcclCommunicator::end_group() {
  int status = ncclSuccess;
  std::string last;
  cudaError_t ordered = cudaSuccess;
  {
    // ncclGroupEnd launches the group's collectives (and may set up connections, as a first
    // collective does: under the watchdog).
    WatchdogScope g(watchdog_, "ncclGroupEnd", name_);
    std::lock_guard<std::mutex> lock(mu_);
    status = ncclGroupEnd();
    if (status != ncclSuccess && status != ncclInProgress && comm_ != nullptr) {
      const char* words = ncclGetLastError(comm_);
      if (words != nullptr) last = words;
    }
  }
  throw_if_aborted("group", -1);
  if (status == ncclInProgress) {
    settle("ncclGroupEnd", -1);  // Note [nccl non-blocking]
    status = ncclSuccess;
  }
  if (status != ncclSuccess) fail(status, "ncclGroupEnd", -1, last);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load()) ordered = order_->after(ctx_.stream());  // Note [nccl launch order]
  }
  if (ordered != cudaSuccess) failed_ = true;
  KEEL_CUDA_CHECK(ordered, "ncclGroupEnd over the ", name_,
                  " group: ordering it (Note [nccl launch order])");
  wait_stream("group", -1);
}

void NcclCommunicator::wait_stream(const char* op, int64_t n) {
  if (in_group()) return;  // Note [collective groups]: end_group() waits once
  CUstream_st* stream = ctx_.stream();
  wait_until([stream] { return cudaStreamQuery(stream); }, op, n);
}

void NcclCommunicator::all_reduce(float* data, int64_t n, ReduceOp op) {
  throw_if_aborted("all_reduce", n);
  if (n == 0) return;
  if (size_ > 1) count(n * static_cast<int64_t>(sizeof(float)));
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, nccl_op(op), c,
                             ctx_.stream());
      },
      ctx_.stream(), "ncclAllReduce", "all_reduce", n);
  wait_stream("all_reduce", n);
}

void NcclCommunicator::all_reduce(double* data, int64_t n, ReduceOp op) {
  throw_if_aborted("all_reduce", n);
  if (n == 0) return;
  if (size_ > 1) count(n * static_cast<int64_t>(sizeof(double)));
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllReduce(data, data, static_cast<size_t>(n), ncclDouble, nccl_op(op), c,
                             ctx_.stream());
      },
      ctx_.stream(), "ncclAllReduce", "all_reduce", n);
  wait_stream("all_reduce", n);
}

void NcclCommunicator::enqueue_bf16_sum(Bf16* data, int64_t n) {
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllReduce(data, data, static_cast<size_t>(n), ncclBfloat16, ncclSum, c,
                             ctx_.stream());
      },
      ctx_.stream(), "ncclAllReduce (bf16)", "all_reduce (bf16)", n);
}

void NcclCommunicator::all_reduce_bf16(Bf16* data, int64_t n) {
  throw_if_aborted("all_reduce (bf16)", n);
  if (size_ == 1 || n == 0) return;
  count(n * static_cast<int64_t>(sizeof(Bf16)));
  enqueue_bf16_sum(data, n);
  wait_stream("all_reduce (bf16)", n);
}

void NcclCommunicator::all_reduce_bf16(float* data, int64_t n) {
  throw_if_aborted("all_reduce (bf16)", n);
  if (size_ == 1 || n == 0) return;  // Note [bf16 wire]: nothing moves, nothing rounds
  // The widening pass would be enqueued before the grouped sum it reads.
  KEEL_CHECK(!in_group(), kInternal, "all_reduce_bf16 of fp32 memory over the ", name_,
             " group inside a collective group (Note [collective groups])");
  count(n * static_cast<int64_t>(sizeof(Bf16)));
  // The wire buffer grows on the first step only; the caching allocator orders a replaced
  // block's reuse on ctx's stream, after the collective that reads it (Note [cuda-stream-order]).
  const size_t bytes = static_cast<size_t>(n) * sizeof(Bf16);
  if (bytes > wire_.bytes()) wire_ = ctx_.alloc(bytes);
  Bf16* w = wire_.as<Bf16>();
  kernels::cuda::to_bf16(ctx_, w, data, n);
  enqueue_bf16_sum(w, n);
  kernels::cuda::from_bf16(ctx_, data, w, n);
  wait_stream("all_reduce (bf16)", n);
}

void NcclCommunicator::all_gather(const float* send, float* recv, int64_t n) {
  throw_if_aborted("all_gather", n);
  if (size_ > 1) count(n * size_ * static_cast<int64_t>(sizeof(float)));
  if (n == 0) return;
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllGather(send, recv, static_cast<size_t>(n), ncclFloat, c, ctx_.stream());
      },
      ctx_.stream(), "ncclAllGather", "all_gather", n);
  wait_stream("all_gather", n);
}

void NcclCommunicator::reduce_scatter(const float* send, float* recv, int64_t n) {
  throw_if_aborted("reduce_scatter", n);
  if (size_ > 1) count(n * size_ * static_cast<int64_t>(sizeof(float)));
  if (n == 0) return;
  enqueue(
      [&](ncclComm_t c) {
        return ncclReduceScatter(send, recv, static_cast<size_t>(n), ncclFloat, ncclSum, c,
                                 ctx_.stream());
      },
      ctx_.stream(), "ncclReduceScatter", "reduce_scatter", n);
  wait_stream("reduce_scatter", n);
}

void NcclCommunicator::broadcast(float* data, int64_t n, int root) {
  throw_if_aborted("broadcast", n);
  if (n == 0) return;
  KEEL_CHECK(root >= 0 && root < size_, kInternal, "broadcast over the ", name_, " group: root ",
             root, " of ", size_);
  if (size_ > 1) count(n * static_cast<int64_t>(sizeof(float)));
  enqueue(
      [&](ncclComm_t c) {
        return ncclBroadcast(data, data, static_cast<size_t>(n), ncclFloat, root, c, ctx_.stream());
      },
      ctx_.stream(), "ncclBroadcast", "broadcast", n);
  wait_stream("broadcast", n);
}

void NcclCommunicator::all_gather_bytes(const void* send, void* recv, int64_t bytes) {
  throw_if_aborted("all_gather (bytes)", bytes);
  if (size_ > 1) count(bytes * size_);
  if (bytes == 0) return;
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, c, ctx_.stream());
      },
      ctx_.stream(), "ncclAllGather", "all_gather (bytes)", bytes);
  wait_stream("all_gather (bytes)", bytes);
}

void NcclCommunicator::broadcast_bytes(void* data, int64_t bytes, int root) {
  throw_if_aborted("broadcast (bytes)", bytes);
  if (bytes == 0) return;
  KEEL_CHECK(root >= 0 && root < size_, kInternal, "broadcast over the ", name_, " group: root ",
             root, " of ", size_);
  if (size_ > 1) count(bytes);
  enqueue(
      [&](ncclComm_t c) {
        return ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, root, c,
                             ctx_.stream());
      },
      ctx_.stream(), "ncclBroadcast", "broadcast (bytes)", bytes);
  wait_stream("broadcast (bytes)", bytes);
}

void NcclCommunicator::barrier() {
  throw_if_aborted("barrier", 1);
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllReduce(barrier_word_.data(), barrier_word_.data(), 1, ncclFloat, ncclSum, c,
                             ctx_.stream());
      },
      ctx_.stream(), "ncclAllReduce (barrier)", "barrier", 1);
  wait_stream("barrier", 1);
}

std::unique_ptr<CommRequest> NcclCommunicator::iall_reduce(float* data, int64_t n) {
  throw_if_aborted("all_reduce (non-blocking)", n);
  KEEL_CHECK(!in_group(), kInternal, "iall_reduce over the ", name_,
             " group inside a collective group (Note [collective groups])");
  if (n == 0) return std::make_unique<DoneRequest>();
  if (size_ > 1) count(n * static_cast<int64_t>(sizeof(float)));
  // Note [nccl comm stream]: the bucket's gradients are complete once everything enqueued on
  // ctx's stream so far has run; the communication stream waits for that, and no later kernel
  // on ctx's stream touches the bucket (backward moves on to earlier layers; the optimizer is
  // enqueued only after the host waited for the request).
  cudaEvent_t ready = nullptr;
  KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "iall_reduce over ",
                  name_, " n=", n);
  cudaError_t rc = cudaEventRecord(ready, ctx_.stream());
  if (rc == cudaSuccess) rc = cudaStreamWaitEvent(comm_stream_, ready, 0);
  cudaEventDestroy(ready);  // released once the wait it orders has been satisfied
  KEEL_CUDA_CHECK(rc, "iall_reduce over ", name_, ": ordering the communication stream, n=", n);
  enqueue(
      [&](ncclComm_t c) {
        return ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, c,
                             comm_stream_);
      },
      comm_stream_, "ncclAllReduce (non-blocking)", "all_reduce (non-blocking)", n);
  return std::make_unique<NcclRequest>(*this, n, comm_stream_);
}

}  // namespace keel
