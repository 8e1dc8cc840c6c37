// NcclCommunicator's set-up and teardown (see nccl_communicator.h): the unique id, joining a group
// (ncclCommInitRankConfig), splitting one (ncclCommSplit), the barrier word, communication stream
// and abort hook, and leaving (ncclCommDestroy, or ncclCommAbort after a failure). Non-blocking
// communicators, polled under the watchdog (Note [nccl non-blocking]). The collectives and the
// error paths are in nccl_communicator.cc.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <string>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "parallel/nccl_communicator.h"
#include "parallel/nccl_internal.h"

namespace keel {

using nccl_internal::Backoff;

namespace {

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
    WatchdogScope g(watchdog_, "ncclCommInitRank", name_);
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
    WatchdogScope g(watchdog_, "ncclCommSplit", name_);
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
    WatchdogScope g(watchdog_, "ncclCommSplit", name_);
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

}  // namespace keel
