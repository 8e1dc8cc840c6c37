// NCCL implementation of Communicator (see nccl_communicator.h, Note [nccl errors]).
#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/ops.h"

namespace keel {

static_assert(NcclCommunicator::kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
static_assert(NcclCommunicator::kNoColor == NCCL_SPLIT_NOCOLOR);

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

namespace {

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

// Marks a host wait as a collective in flight for the watchdog (as MpiCommunicator does).
class Guard {
 public:
  Guard(Watchdog* w, const char* op, const std::string& group) : w_(w) {
    if (w_) w_->begin(op, group.c_str());
  }
  ~Guard() {
    if (w_) w_->end();
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  Watchdog* w_;
};

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

// Note [nccl non-blocking]: a config for a non-blocking communicator.
ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// Polls a communicator no other thread knows yet (being made) until it settles; its final state.
ncclResult_t settle_new(ncclComm_t comm) {
  Backoff backoff;
  for (;;) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &async);
    if (rc != ncclSuccess) return rc;
    if (async != ncclInProgress) return async;
    backoff.pause();
  }
}

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

NcclCommunicator::UniqueId NcclCommunicator::make_unique_id() {
  ncclUniqueId id;
  const ncclResult_t rc = ncclGetUniqueId(&id);
  KEEL_CHECK(rc == ncclSuccess, kComm, "ncclGetUniqueId failed: ", ncclGetErrorString(rc), " (",
             ncclGetLastError(nullptr), ")");
  UniqueId out;
  std::copy(id.internal, id.internal + NCCL_UNIQUE_ID_BYTES, out.begin());
  return out;
}

NcclCommunicator::NcclCommunicator(const UniqueId& id, int rank, int size, std::string name,
                                   kernels::cuda::Context& ctx, Watchdog* watchdog,
                                   std::shared_ptr<NcclLaunchOrder> order)
    : name_(std::move(name)),
      ctx_(ctx),
      watchdog_(watchdog),
      rank_(rank),
      size_(size),
      order_(order ? std::move(order) : std::make_shared<NcclLaunchOrder>()) {
  KEEL_CHECK(size >= 1 && rank >= 0 && rank < size, kInternal, "NcclCommunicator ", name_,
             ": rank ", rank, " of ", size);
  KEEL_CUDA_CHECK(cudaSetDevice(ctx_.device()), "NcclCommunicator ", name_, " device ",
                  ctx_.device());
  ncclUniqueId nid;
  std::copy(id.begin(), id.end(), nid.internal);
  {
    // Under the watchdog: the bootstrap waits for every rank (Note [nccl non-blocking]: polled).
    Guard g(watchdog_, "ncclCommInitRank", name_);
    ncclComm_t comm = nullptr;
    ncclConfig_t config = non_blocking_config();
    ncclResult_t rc = ncclCommInitRankConfig(&comm, size_, nid, rank_, &config);
    if (rc == ncclInProgress) rc = settle_new(comm);
    if (rc != ncclSuccess) {
      // NCCL's words, then the half-made communicator goes (no destructor runs for this object).
      const char* words = ncclGetLastError(comm);
      const std::string last = words != nullptr ? words : "";
      if (comm != nullptr) ncclCommAbort(comm);
      fail(rc, "ncclCommInitRankConfig", -1, last);
    }
    comm_ = comm;
  }
  finish_setup();
}

NcclCommunicator::NcclCommunicator(Adopt, ncclComm* comm, int rank, int size, std::string name,
                                   kernels::cuda::Context& ctx, Watchdog* watchdog,
                                   std::shared_ptr<NcclLaunchOrder> order)
    : name_(std::move(name)),
      ctx_(ctx),
      watchdog_(watchdog),
      rank_(rank),
      size_(size),
      comm_(comm),
      order_(std::move(order)) {
  finish_setup();
}

void NcclCommunicator::finish_setup() {
  try {
    barrier_word_ = ctx_.alloc(sizeof(float));
    ctx_.fill_bytes(barrier_word_.data(), 0, sizeof(float));
    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking),
                    "NcclCommunicator ", name_, " communication stream");
  } catch (...) {
    ncclCommAbort(comm_);  // no destructor runs for a half-built object
    comm_ = nullptr;
    throw;
  }
  // A collective that outlives parallel.timeout_s: the watchdog aborts this communicator (the
  // blocked NCCL call returns) before it ends the job (Note [abort hooks] in watchdog.h).
  if (watchdog_ != nullptr) abort_hook_ = watchdog_->add_abort_hook([this] { abort(); });
}

bool NcclCommunicator::split_supported() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  // The header is new enough; the library loaded at run time must be too.
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess && version >= NCCL_VERSION(2, 18, 0);
#else
  return false;
#endif
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::split(int color, int key, std::string name) {
  KEEL_CHECK(split_supported(), kConfig, "splitting the ", name_, " NCCL communicator into the ",
             name, " group needs ncclCommSplit (NCCL >= 2.18; built against ", NCCL_MAJOR, ".",
             NCCL_MINOR, ")");
  KEEL_CHECK(color >= 0 || color == kNoColor, kInternal, "split of ", name_, ": color ", color);
  throw_if_aborted("ncclCommSplit", -1);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  ncclComm_t child = nullptr;
  int status = ncclSuccess;
  std::string last;
  {
    // Collective over this communicator's ranks: under the watchdog, as the bootstrap is.
    Guard g(watchdog_, "ncclCommSplit", name_);
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load() && comm_ != nullptr) {
      ncclConfig_t config = non_blocking_config();  // Note [nccl non-blocking]
      status = ncclCommSplit(comm_, color, key, &child, &config);
      if (status != ncclSuccess && status != ncclInProgress) {
        const char* words = ncclGetLastError(comm_);
        if (words != nullptr) last = words;
      }
    }
  }
  throw_if_aborted("ncclCommSplit", -1);
  if (status == ncclInProgress) {
    settle("ncclCommSplit", -1);
    Guard g(watchdog_, "ncclCommSplit", name_);
    status = child != nullptr ? settle_new(child) : ncclSuccess;
    if (status != ncclSuccess && child != nullptr) {
      const char* words = ncclGetLastError(child);
      if (words != nullptr) last = words;
      ncclCommAbort(child);
      child = nullptr;
    }
  }
  if (status != ncclSuccess) fail(status, "ncclCommSplit", -1, last);
  if (child == nullptr) return nullptr;  // kNoColor
  int rank = 0, size = 1;
  ncclResult_t rc = ncclCommUserRank(child, &rank);
  if (rc == ncclSuccess) rc = ncclCommCount(child, &size);
  if (rc != ncclSuccess) {
    ncclCommAbort(child);
    fail(rc, "ncclCommUserRank/ncclCommCount", -1, "of the split-off " + name + " group");
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(Adopt{}, child, rank, size, std::move(name), ctx_, watchdog_, order_));
#else
  (void)key;
  return nullptr;  // unreachable: split_supported() is false
#endif
}

NcclCommunicator::~NcclCommunicator() {
  if (watchdog_ != nullptr && abort_hook_ >= 0) watchdog_->remove_abort_hook(abort_hook_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load() && comm_ != nullptr) {
      // ncclCommDestroy waits for the node's other ranks (an intra-node barrier before NCCL stops
      // its proxy threads); ncclCommAbort does not. Destroying is right only when every rank is
      // shutting down cleanly: not after a failed call (peers may never finish what they started
      // with this rank), not while an exception unwinds the trainer (an error on this rank alone:
      // the peers are still training and would never arrive, and the error's message would wait
      // behind them), and not after any other communicator of this process failed.
      if (failed_ || any_failed_.load() || std::uncaught_exceptions() > 0) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
      comm_ = nullptr;
    }
  }
  // Aborted or destroyed, NCCL's kernels on it have stopped or finished: the stream drains.
  if (comm_stream_ != nullptr) {
    cudaStreamSynchronize(comm_stream_);
    cudaStreamDestroy(comm_stream_);
  }
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
  Guard g(watchdog_, op, name_);
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
    Guard g(watchdog_, call, name_);
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
  Guard g(watchdog_, call, name_);
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
    Guard g(watchdog_, "ncclGroupEnd", name_);
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
