// Communicator over NCCL on device buffers (the CUDA backend's transport). Built only when CUDA
// and NCCL are found, into its own library keel_nccl (parallel/CMakeLists.txt), so CPU-only
// binaries never link NCCL or CUDA. This header includes neither the NCCL, CUDA nor MPI headers:
// the MPI bootstrap (an ncclUniqueId made on the group's first rank and broadcast over the
// group's MPI communicator) is parallel/nccl_mpi.h, and a single-process program (the 1-rank
// tests) makes the id itself.
//
// Semantics, as MpiCommunicator's (parallel/communicator.h): the same element types and
// operations, the same byte counters (0 for a group of one), and every blocking call is complete
// when it returns. A collective is enqueued on the Context's stream, so it is ordered after the
// kernels that produced its input and before those that read its output (Note [cuda-stream-order]
// in framework/kernels/cuda/device.h), and the host then waits for the stream by polling (below).
// The non-blocking all-reduce (DP gradient buckets) runs on a communication stream of its own,
// overlapping backward (Note [nccl comm stream]); the blocking ones (TP) stay on the critical
// path by design. A group of one still calls NCCL (a device copy at most), so a 1-rank job runs
// the NCCL path.
//
// Note [nccl launch order]: NCCL does not guarantee that two communicators' collectives progress
// when they are in flight on one GPU at once (each is a kernel that spins until its peers arrive;
// two of them may not both be resident, and GPUs that run them in different orders deadlock:
// NVIDIA/nccl issues 195 and 1174; the maintainers' advice is to complete every operation of one
// communicator before launching one of the other). The trainer has two on each GPU: TP on ctx's
// stream and DP's gradient buckets on the DP communicator's own stream. Communicators that share
// a NcclLaunchOrder (the TP and DP ones split from one world communicator, nccl_mpi.h) therefore
// run their collectives one at a time on the device, in the host's order, which is the same on
// every rank (the same program issues them): a collective enqueued on a stream other than the
// previous collective's first waits (cudaStreamWaitEvent) for that one to finish. Consecutive
// buckets share the communication stream and queue behind each other; compute kernels are not
// held up, so buckets still overlap backward's compute. What it costs: a TP collective issued
// while a bucket is still reducing waits for that bucket on the device (the time the bucket
// takes beyond the compute enqueued between them), where before they ran side by side and NCCL
// merely made no promise. The CUDA emulator's NCCL fails a collective that starts while another
// communicator's collective on another stream of the GPU is still in flight with nothing
// ordering them (tests/cuda_emu/nccl.cc, README.md there).
//
// Note [nccl errors]: every NCCL call is checked; a failure throws kComm with one line naming the
// call, the group, this rank, the element count and the step ("ncclAllReduce over the
// tensor-parallel group (rank 3 of 8, 1048576 elements) at step 12 failed: ..."). While the host
// waits for a collective it polls the stream and ncclCommGetAsyncError (network errors, a peer's
// failure seen by NCCL's proxy thread); an asynchronous error aborts the communicator
// (ncclCommAbort: NCCL's kernels stop, the stream drains) and throws the same kind of line naming
// the collective waited for ("all_reduce over the ... failed: <NCCL's reason> (asynchronous NCCL
// error; communicator aborted: <NCCL's last error>)"). A communicator that saw an error is
// aborted, not destroyed, when it goes (destroying would wait for peers that may be gone), as is
// every communicator of a process where one failed, and every one destroyed while an exception
// unwinds (an error on this rank alone: its peers are still training). The enqueue and the wait
// run under the Watchdog (begin/end, as MPI collectives do), so a stalled peer ends the job within
// parallel.timeout_s.
//
// Note [nccl non-blocking]: every communicator is non-blocking (ncclConfig_t::blocking = 0, made
// by ncclCommInitRankConfig and ncclCommSplit): an NCCL call returns at once, ncclInProgress while
// NCCL finishes it on its own threads (the bootstrap, a first collective's connection set-up),
// and the host polls ncclCommGetAsyncError until it settles before the next call, holding the
// communicator's mutex only for each poll. So no NCCL call blocks while holding it, and the
// watchdog's abort hook (abort(): ncclCommAbort) ends a stalled bootstrap, connection set-up or
// enqueue as it ends a stalled kernel, instead of being abandoned behind a blocked call. The
// emulated NCCL reports ncclInProgress too, and fails a call made before the previous one settled.
//
// Abort path: abort() may be called from any thread, once or more (e.g. by the watchdog's thread
// when a collective outlives the timeout, before it ends the process): it calls ncclCommAbort,
// which makes NCCL's device kernels give up so the stream and a host thread polling it are
// released; the waiting call then throws kComm ("... aborted"), and every later call throws
// too. The poll loop and abort() share a mutex, so the handle is never used after it was freed;
// an NCCL call that blocks inside NCCL itself (connection set-up on a first collective) is not
// protected by it (Note [nccl non-blocking]: none does on a non-blocking communicator): after
// aborting, the watchdog ends the process, as it does for MPI.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "framework/kernels/cuda/device.h"
#include "parallel/communicator.h"
#include "parallel/watchdog.h"

struct ncclComm;  // ncclComm_t is ncclComm*

namespace keel {

// The collectives of every communicator sharing one of these run one at a time on the device, in
// the order they were enqueued (Note [nccl launch order]). Thread-safe; made by the communicator
// (NcclCommunicator::launch_order()).
class NcclLaunchOrder;

class NcclCommunicator final : public Communicator {
 public:
  static constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES (checked in the .cc)
  using UniqueId = std::array<char, kUniqueIdBytes>;

  // ncclGetUniqueId: called by the group's first rank only; the others receive its bytes.
  static UniqueId make_unique_id();

  // Joins the group `id` names as `rank` of `size` (ncclCommInitRank on ctx's device; blocks,
  // under the watchdog, until all `size` ranks have joined). Collectives run on ctx's stream;
  // ctx must outlive the communicator. `name` labels messages ("tensor-parallel").
  // `order`: the launch order to share (Note [nccl launch order]); null makes a new one.
  NcclCommunicator(const UniqueId& id, int rank, int size, std::string name,
                   kernels::cuda::Context& ctx, Watchdog* watchdog,
                   std::shared_ptr<NcclLaunchOrder> order = nullptr);
  // ncclCommSplit (NCCL >= 2.18): collective over this communicator's ranks, each passing its
  // color and key; the ranks of one color form a new communicator, ranked by key (ties by rank
  // here), on the same Context and watchdog and sharing this one's launch order. kNoColor takes
  // no part and returns null. Needs no unique id and no MPI: NCCL bootstraps over this
  // communicator. Throws kConfig when split_supported() is false.
  static constexpr int kNoColor = -1;  // NCCL_SPLIT_NOCOLOR (checked in the .cc)
  std::unique_ptr<NcclCommunicator> split(int color, int key, std::string name);
  // Whether keel was compiled against, and runs with, NCCL >= 2.18 (ncclCommSplit).
  static bool split_supported();
  const std::shared_ptr<NcclLaunchOrder>& launch_order() const { return order_; }
  // Groups (Note [collective groups] in communicator.h): ncclGroupStart when the outermost
  // group starts; its collectives are enqueued on ctx's stream without a host wait, and
  // ncclGroupEnd launches them together, after which the host waits for the stream once.
  // all_reduce_bf16 of fp32 memory and iall_reduce are not allowed inside (kInternal).
  //
  // ncclCommDestroy; ncclCommAbort after a failure here or in another communicator of the
  // process, or during exception unwinding; nothing after abort().
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const { return name_; }
  // All pointers are device pointers on ctx's device.
  void all_reduce(float* data, int64_t n, ReduceOp op) override;
  void all_reduce(double* data, int64_t n, ReduceOp op) override;
  // Rounded into a bf16 wire buffer on ctx's stream, summed as ncclBfloat16, widened back
  // (Note [bf16 wire] in communicator.h); a group of one returns at once.
  void all_reduce_bf16(float* data, int64_t n) override;
  // ncclBfloat16 in place on ctx's stream; a group of one returns at once.
  void all_reduce_bf16(Bf16* data, int64_t n) override;
  // In place when send == recv + rank() * n (NCCL's in-place all-gather).
  void all_gather(const float* send, float* recv, int64_t n) override;
  void reduce_scatter(const float* send, float* recv, int64_t n) override;
  void broadcast(float* data, int64_t n, int root) override;
  // As ncclUint8 (device memory, like every buffer here).
  void all_gather_bytes(const void* send, void* recv, int64_t bytes) override;
  void broadcast_bytes(void* data, int64_t bytes, int root) override;
  // An all-reduce of one float (NCCL has no barrier): every rank has reached it on the device.
  void barrier() override;
  // Enqueued at once on the communicator's own stream, ordered after everything enqueued on
  // ctx's stream so far (Note [nccl comm stream]), so it overlaps the compute enqueued after it;
  // the request's test() polls an event (and the asynchronous error), wait() blocks under the
  // watchdog. Once wait() returned, work enqueued on ctx's stream sees the sum.
  std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override;

  // The abort path (see the file comment). Thread-safe; idempotent.
  void abort() noexcept;
  bool aborted() const { return aborted_.load(); }
  // Throws kComm (after aborting) when NCCL reports an asynchronous error; `op` and `n` name the
  // collective being waited for. Called by the waits; public for a caller that polls between
  // steps.
  void check_async_error(const char* op, int64_t n);
  // One poll of the asynchronous state under mu_: false when aborted or destroyed; else *async
  // (an ncclResult_t), with NCCL's last-error words in *last when it reports an error (throws if
  // the poll fails).
  bool poll_async(int* async, std::string* last, int64_t n);

  // The one-line message of Note [nccl errors] (public so it is tested without a GPU); n < 0
  // leaves the element count out (set-up calls).
  static std::string error_message(int status, const char* call, const std::string& group, int rank,
                                   int size, int64_t n, long long step, const std::string& detail);

 private:
  friend class NcclRequest;
  // Takes over `comm` (made by ncclCommSplit) as `rank` of `size`.
  struct Adopt {};
  NcclCommunicator(Adopt, ncclComm* comm, int rank, int size, std::string name,
                   kernels::cuda::Context& ctx, Watchdog* watchdog,
                   std::shared_ptr<NcclLaunchOrder> order);
  void finish_setup();  // the barrier word, the communication stream, the abort hook
  void begin_group() override;
  void end_group() override;
  // Polls until `done()` (a stream or event query) says complete; throws on a CUDA error, an
  // asynchronous NCCL error or abort().
  template <typename Query>
  void wait_until(Query done, const char* op, int64_t n);
  void wait_stream(const char* op, int64_t n);
  void enqueue_bf16_sum(Bf16* data, int64_t n);  // ncclAllReduce of bf16 in place, uncounted
  [[noreturn]] void fail(int status, const char* call, int64_t n, const std::string& detail);
  void check(int status, const char* call, int64_t n);
  void throw_if_aborted(const char* op, int64_t n);
  // Note [nccl non-blocking]: polls ncclCommGetAsyncError until `call` is no longer in progress;
  // throws like fail() on an error, like throw_if_aborted() once aborted.
  void settle(const char* call, int64_t n);
  // Runs `enqueue(comm_)` (an NCCL collective call) under mu_, so abort() never frees the
  // communicator under it, and throws like check() on failure or like throw_if_aborted() when the
  // communicator was aborted before or during the call. (An enqueue that blocked while holding
  // mu_ would hold up abort(); the watchdog bounds every abort hook, so the job still ends.)
  // `stream` is the one the collective is enqueued on (Note [nccl launch order]).
  template <typename Enqueue>
  void enqueue(Enqueue enqueue, CUstream_st* stream, const char* call, const char* op, int64_t n);

  std::string name_;
  kernels::cuda::Context& ctx_;
  Watchdog* watchdog_;
  int rank_ = 0, size_ = 1;
  int abort_hook_ = -1;  // this communicator's abort() as a watchdog abort hook
  ncclComm* comm_ = nullptr;
  std::mutex mu_;  // guards comm_ between the poll loop and abort()
  std::atomic<bool> aborted_{false};
  bool failed_ = false;  // a call failed: the destructor aborts instead of destroying
  static inline std::atomic<bool> any_failed_{false};  // some communicator of the process failed
  kernels::cuda::DeviceBuffer barrier_word_;           // one device float for barrier()
  kernels::cuda::DeviceBuffer wire_;                   // all_reduce_bf16's bf16 copy
  // Note [nccl comm stream]: iall_reduce runs here, after an event on ctx's stream, so the DP
  // buckets reduce while backward's later kernels run on ctx's stream.
  CUstream_st* comm_stream_ = nullptr;
  std::shared_ptr<NcclLaunchOrder> order_;
};

}  // namespace keel
