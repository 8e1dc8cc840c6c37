// The CUDA emulator's NCCL (see README.md here): the calls parallel/nccl_communicator.cc and
// nccl_setup.cc make, over MPI, so keel's NCCL communicator, its bootstrap and the trainer's NCCL
// tensor communicators run unchanged on emulated GPUs, one MPI rank each.
//
// Like NCCL, a collective is enqueued on its stream and returns at once: it starts as an MPI
// non-blocking collective, and the stream holds it as pending work (runtime.cc), so
// cudaStreamQuery / cudaEventQuery report "not ready" until it completes, and later kernels and
// copies on the stream wait for it. One difference: a collective whose buffers overlap a
// collective still pending on its stream waits for that one at the call (NCCL would enqueue it),
// because an MPI non-blocking collective reads its input when it starts. ncclCommAbort abandons a
// communicator's collectives (the stream drains), as NCCL's abort stops its kernels; a peer that
// never joins leaves them pending, which keel's watchdog sees as a hang. MPI is initialised with
// MPI_THREAD_FUNNELED, so only the thread that made the communicator drives MPI; pending work
// polled from another thread waits.
//
// Note [nccl launch order] (parallel/nccl_communicator.h) is checked here: a collective of one
// communicator that starts while a collective of another communicator, enqueued on another
// stream of this GPU, is still in flight, with nothing (no stream order, no event wait, no host
// wait that saw it complete) ordering the two, is a schedule NCCL does not promise to progress:
// a GPU may run them in either order, and GPUs that pick different orders deadlock. The
// emulator's MPI requests would progress anyway, so it reports instead: the call fails
// (ncclInvalidUsage, naming both), or with KEEL_CUDA_EMU_NCCL_ORDER=count when the communicator
// was made, it only counts (keel_emu_nccl_unordered_starts(), for the negative control in
// nccl_mpi_test.cc). "Still in flight" is the emulator's own record: a collective is complete
// once something waited for it (a stream, event or host wait, or a stream wait on an event
// recorded after it); deferred mode (KEEL_CUDA_EMU_DEFERRED=1) leaves the most in flight.
//
// Non-blocking communicators (ncclConfig_t::blocking = 0, Note [nccl non-blocking] in
// parallel/nccl_communicator.h): ncclCommInitRankConfig, ncclCommSplit and every collective
// outside a group (ncclGroupEnd for a group) return ncclInProgress, and ncclCommGetAsyncError
// reports ncclInProgress once before ncclSuccess, as NCCL's do while its threads finish a call;
// a call made on the communicator before that poll is an error (ncclInvalidUsage), as NCCL
// requires the previous call to have settled.
//
// Under the host guard (host_guard.h) MPI never sees device memory: a collective copies its input
// and output buffers into host memory when it starts (one copy of their span where they overlap,
// so NCCL's in-place forms stay in place), MPI runs on the copies, and the output is copied back
// when something sees it complete; the copies are device work (DeviceScope). Without the guard MPI
// runs on the device buffers directly, which is host memory here.
//
// A communicator of one rank needs no MPI (collectives are copies). Bootstrap for more: the
// unique id names the root's MPI_COMM_WORLD rank and a serial number; every member sends its
// world rank to the root, the root answers with the member list, and the members make their
// communicator with MPI_Comm_create_group, so only members take part, as with NCCL.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/mpi_bf16.h"
#include "tests/cuda_emu/emu.h"
#include "tests/cuda_emu/host_guard.h"

struct ncclComm {
  int rank = 0, size = 1;
  int64_t serial = 0;              // this process's number for it (Note [nccl launch order] check)
  bool order_counts_only = false;  // KEEL_CUDA_EMU_NCCL_ORDER=count when it was made
  MPI_Comm mpi = MPI_COMM_NULL;
  std::thread::id owner;  // the thread that drives MPI (MPI_THREAD_FUNNELED)
  std::shared_ptr<std::atomic<bool>> aborted = std::make_shared<std::atomic<bool>>(false);
  std::string last_error;
  // KEEL_CUDA_EMU_NCCL_ASYNC_ERROR=1 when the communicator was made: its collectives never complete
  // and report ncclRemoteError through ncclCommGetAsyncError, as a peer's failure seen by NCCL's
  // proxy thread does (the path keel's communicator polls while it waits).
  bool inject_async_error = false;
  // KEEL_CUDA_EMU_NCCL_ASYNC_ERROR=in_progress when it was made (a non-blocking communicator):
  // its collectives stay ncclInProgress for ever, as a call NCCL's threads never finish (a peer
  // that never connects) does, until ncclCommAbort.
  bool inject_in_progress = false;
  std::atomic<bool> stuck{false};
  std::atomic<ncclResult_t> async_error{ncclSuccess};
  bool nonblocking = false;  // made with ncclConfig_t::blocking = 0
};

namespace {

constexpr uint32_t kMagic = 0x6b65656cu;  // "keel"
constexpr int kBootstrapTag = 31000;      // MPI_COMM_WORLD tags: 31000 + serial % 1000

struct IdFields {
  uint32_t magic;
  int32_t root_world_rank;
  int64_t serial;
};

std::string g_last_error;
std::mutex g_error_mu;

ncclResult_t error(ncclComm* comm, ncclResult_t code, const std::string& why) {
  std::fprintf(stderr, "keel cuda emulator: NCCL: %s\n", why.c_str());
  std::lock_guard<std::mutex> lock(g_error_mu);
  g_last_error = why;
  if (comm != nullptr) comm->last_error = why;
  return code;
}

// One MPI non-blocking collective, pending on a stream.
struct Range {
  const void* p;
  size_t n;
};

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return pa < pb + bn && pb < pa + an;
}

class Collective : public keel_emu::Pending, public std::enable_shared_from_this<Collective> {
 public:
  Collective(ncclComm* comm, cudaStream_t stream, const char* call, std::vector<char> scratch,
             Range in, Range out)
      : comm_serial_(comm->serial),
        stream_(stream),
        call_(call),
        owner_(comm->owner),
        aborted_(comm->aborted),
        scratch_(std::move(scratch)),
        in_(in),
        out_(out) {}
  MPI_Request* request() { return &request_; }
  const void* scratch() const { return scratch_.data(); }

  // Under the host guard: copies the buffers to host memory (above); the pointers MPI gets are
  // then at(send), at(recv).
  void stage() {
    const keel_emu::host_guard::DeviceScope device;
    if (overlaps(in_.p, in_.n, out_.p, out_.n)) {
      const char* lo = std::min(static_cast<const char*>(in_.p), static_cast<const char*>(out_.p));
      const char* hi = std::max(static_cast<const char*>(in_.p) + in_.n,
                                static_cast<const char*>(out_.p) + out_.n);
      span_ = lo;
      staged_in_.assign(lo, hi);
    } else {
      if (in_.p != nullptr) {
        staged_in_.assign(static_cast<const char*>(in_.p), static_cast<const char*>(in_.p) + in_.n);
      }
      if (out_.p != nullptr) {
        staged_out_.assign(static_cast<const char*>(out_.p),
                           static_cast<const char*>(out_.p) + out_.n);
      }
    }
    staged_ = true;
  }
  // Where MPI reads or writes the buffer at p: its staged copy, or p itself.
  void* at(const void* p) {
    const char* c = static_cast<const char*>(p);
    if (!staged_) return const_cast<void*>(p);
    if (span_ != nullptr) return staged_in_.data() + (c - span_);
    if (c == in_.p) return staged_in_.data();
    return staged_out_.data() + (c - static_cast<const char*>(out_.p));
  }
  int64_t comm_serial() const { return comm_serial_; }
  cudaStream_t stream() const { return stream_; }
  const char* call() const { return call_; }
  // Whether something has seen it complete (or abandoned); never polls MPI.
  bool seen_done() const { return done_.load(); }

  bool test() override {
    if (done_.load()) return true;
    if (aborted_->load()) {
      // Abandoned with its communicator; MPI may still use its buffers (scratch_), so it is kept.
      static std::mutex mu;
      static std::vector<std::shared_ptr<Collective>> abandoned;
      std::lock_guard<std::mutex> lock(mu);
      abandoned.push_back(shared_from_this());
      done_ = true;
      return true;
    }
    if (std::this_thread::get_id() != owner_) return false;
    int flag = 0;
    MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    if (flag != 0 && staged_ && out_.n > 0) {
      const keel_emu::host_guard::DeviceScope device;
      std::memcpy(const_cast<void*>(out_.p), at(out_.p), out_.n);
    }
    done_ = flag != 0;
    return done_.load();
  }
  bool touches(const void* p, size_t n) const override {
    return overlaps(p, n, in_.p, in_.n) || overlaps(p, n, out_.p, out_.n);
  }

 private:
  int64_t comm_serial_;
  cudaStream_t stream_;
  const char* call_;
  std::thread::id owner_;
  std::shared_ptr<std::atomic<bool>> aborted_;
  std::vector<char> scratch_;  // a copy of an input that overlaps the output
  Range in_, out_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  std::atomic<bool> done_{false};
  // Under the host guard: the copies MPI works on (stage()); one span from span_ where in and out
  // overlap, else each buffer's own.
  bool staged_ = false;
  const char* span_ = nullptr;
  std::vector<char> staged_in_, staged_out_;
};

// A collective of a communicator with an injected error: pending until the communicator is
// aborted, as NCCL's kernels spin until ncclCommAbort stops them.
class Stuck : public keel_emu::Pending {
 public:
  Stuck(ncclComm* comm, Range in, Range out) : aborted_(comm->aborted), in_(in), out_(out) {}
  bool test() override { return aborted_->load(); }
  bool touches(const void* p, size_t n) const override {
    return overlaps(p, n, in_.p, in_.n) || overlaps(p, n, out_.p, out_.n);
  }

 private:
  std::shared_ptr<std::atomic<bool>> aborted_;
  Range in_, out_;
};

// The injected failure (ncclComm::inject_async_error): true when it took the call.
bool inject_failure(ncclComm* comm, cudaStream_t stream, Range in, Range out) {
  if (comm->inject_in_progress && comm->nonblocking) {
    keel_emu::enqueue_pending(stream, std::make_shared<Stuck>(comm, in, out));
    comm->stuck = true;
    comm->async_error = ncclInProgress;
    return true;
  }
  if (!comm->inject_async_error) return false;
  keel_emu::enqueue_pending(stream, std::make_shared<Stuck>(comm, in, out));
  {
    std::lock_guard<std::mutex> lock(g_error_mu);
    comm->last_error = "emulated: a peer's connection failed (KEEL_CUDA_EMU_NCCL_ASYNC_ERROR)";
  }
  comm->async_error = ncclRemoteError;
  return true;
}

MPI_Datatype mpi_type(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return MPI_FLOAT;
    case ncclFloat64:
      return MPI_DOUBLE;
    case ncclInt32:
      return MPI_INT32_T;
    case ncclInt64:
      return MPI_INT64_T;
    case ncclUint8:
      return MPI_UINT8_T;
    case ncclBfloat16:
      return MPI_UINT16_T;  // summed by keel's bf16 MPI operation (parallel/mpi_bf16.h)
    default:
      return MPI_DATATYPE_NULL;
  }
}
size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclFloat64:
    case ncclInt64:
      return 8;
    case ncclUint8:
      return 1;
    case ncclBfloat16:
      return 2;
    default:
      return 4;
  }
}
// NCCL's bf16 sum adds in fp32 and rounds each partial sum to bf16; only the sum is emulated.
MPI_Op mpi_op(ncclRedOp_t op, ncclDataType_t type) {
  if (type == ncclBfloat16) return op == ncclSum ? keel::bf16_sum_op() : MPI_OP_NULL;
  switch (op) {
    case ncclSum:
      return MPI_SUM;
    case ncclProd:
      return MPI_PROD;
    case ncclMax:
      return MPI_MAX;
    case ncclMin:
      return MPI_MIN;
    default:
      return MPI_OP_NULL;
  }
}

thread_local bool t_in_group_end = false;  // ncclGroupEnd is starting its collectives

// What a call on a non-blocking communicator returns once it has started: ncclInProgress until
// ncclCommGetAsyncError has been polled (an injected error stays as it is). Inside ncclGroupEnd,
// ncclSuccess: the group's end reports for it.
ncclResult_t started(ncclComm* comm) {
  if (!comm->nonblocking || t_in_group_end) return ncclSuccess;
  ncclResult_t none = ncclSuccess;
  comm->async_error.compare_exchange_strong(none, ncclInProgress);
  return ncclInProgress;
}

// Checks common to every collective; nullptr when it may proceed.
ncclResult_t check_call(ncclComm* comm, ncclDataType_t type, const char* call) {
  if (comm == nullptr)
    return error(nullptr, ncclInvalidArgument, std::string(call) + ": null comm");
  if (comm->aborted->load()) {
    return error(comm, ncclInvalidUsage, std::string(call) + " on an aborted communicator");
  }
  if (comm->async_error.load() == ncclInProgress && !t_in_group_end) {
    return error(comm, ncclInvalidUsage,
                 std::string(call) +
                     " on a non-blocking communicator whose previous call is still in progress "
                     "(poll ncclCommGetAsyncError until it settles)");
  }
  if (mpi_type(type) == MPI_DATATYPE_NULL) {
    return error(comm, ncclInvalidArgument, std::string(call) + ": data type not emulated");
  }
  if (comm->size > 1 && std::this_thread::get_id() != comm->owner) {
    return error(comm, ncclInvalidUsage,
                 std::string(call) +
                     " from a thread other than the one that made the "
                     "communicator (MPI_THREAD_FUNNELED)");
  }
  return ncclSuccess;
}

// Completes what `stream` holds before the collective (its tasks, its waits on other streams, and
// the collectives still pending on it that touch the buffers: stream order: the input may be
// their output, the output their input).
void wait_for_buffers(cudaStream_t stream, Range in, Range out) {
  keel_emu::prepare_collective(stream);  // the tasks and waits queued before it
  keel_emu::wait_stream_touching(stream, in.p, in.n);
  keel_emu::wait_stream_touching(stream, out.p, out.n);
}

// A collective of one rank: a copy, queued on the stream as NCCL's kernel would be.
ncclResult_t copy_on_stream(ncclComm* comm, cudaStream_t stream, const void* send, void* recv,
                            size_t bytes) {
  if (send != recv && bytes > 0) {
    keel_emu::submit(stream, [=] { std::memmove(recv, send, bytes); });
  }
  return started(comm);
}

// The collectives of several ranks started on this GPU, for the launch-order check; the done
// ones are dropped as it walks them.
std::mutex g_flight_mu;
std::vector<std::weak_ptr<Collective>> g_in_flight;
std::atomic<int64_t> g_unordered{0};
std::atomic<int64_t> g_comm_serial{1};

// Note [nccl launch order]: "" when `call` of `comm` on `stream` may start now; otherwise why not.
std::string unordered_with(ncclComm* comm, cudaStream_t stream, const char* call) {
  std::lock_guard<std::mutex> lock(g_flight_mu);
  std::string why;
  std::vector<std::weak_ptr<Collective>> kept;
  for (const auto& w : g_in_flight) {
    const std::shared_ptr<Collective> c = w.lock();
    if (c == nullptr || c->seen_done()) continue;
    kept.push_back(c);
    if (why.empty() && c->comm_serial() != comm->serial && c->stream() != stream) {
      why = std::string(call) + " of communicator #" + std::to_string(comm->serial) + " (rank " +
            std::to_string(comm->rank) + " of " + std::to_string(comm->size) + ") started while " +
            c->call() + " of communicator #" + std::to_string(c->comm_serial()) +
            " is in flight on another stream of this GPU, with nothing ordering the two: NCCL "
            "does not guarantee that two communicators progress concurrently (Note [nccl launch "
            "order] in parallel/nccl_communicator.h)";
    }
  }
  g_in_flight = std::move(kept);
  return why;
}

// Starts `start` (which issues one MPI non-blocking collective into the request) on `stream`.
template <typename Start>
ncclResult_t enqueue(ncclComm* comm, cudaStream_t stream, std::vector<char> scratch, Range in,
                     Range out, const char* call, Start start) {
  wait_for_buffers(stream, in, out);
  if (const std::string why = unordered_with(comm, stream, call); !why.empty()) {
    ++g_unordered;
    if (!comm->order_counts_only) return error(comm, ncclInvalidUsage, why);
  }
  auto c = std::make_shared<Collective>(comm, stream, call, std::move(scratch), in, out);
  if (keel_emu::host_guard::enabled()) c->stage();
  const int rc = start(c->at(in.p), c->at(out.p), c->scratch(), c->request());
  if (rc != MPI_SUCCESS) {
    return error(comm, ncclSystemError, std::string(call) + ": MPI error " + std::to_string(rc));
  }
  {
    std::lock_guard<std::mutex> lock(g_flight_mu);
    g_in_flight.push_back(c);
  }
  keel_emu::enqueue_pending(stream, std::move(c));
  return started(comm);
}

// ncclGroupStart/End: the collectives called inside the outermost group are kept (their
// arguments checked at the call, as NCCL does) and start at ncclGroupEnd, in call order, so a
// stream, event or host wait inside the group does not see them. Per thread, as NCCL's group is.
thread_local int t_group_depth = 0;
thread_local std::vector<std::pair<ncclComm*, std::function<ncclResult_t()>>> t_grouped;
std::atomic<int64_t> g_groups{0};         // groups that started at least one collective
std::atomic<int64_t> g_grouped_calls{0};  // collectives that started through a group

// Inside a group: keeps `call` for ncclGroupEnd and returns true.
template <typename Call>
bool grouped(ncclComm* comm, Call call) {
  if (t_group_depth == 0) return false;
  t_grouped.emplace_back(comm, std::move(call));
  return true;
}

// What a new communicator takes from the environment.
void init_from_env(ncclComm* comm) {
  comm->serial = g_comm_serial++;
  comm->owner = std::this_thread::get_id();
  const char* inject = std::getenv("KEEL_CUDA_EMU_NCCL_ASYNC_ERROR");
  comm->inject_async_error = inject != nullptr && std::strcmp(inject, "1") == 0;
  comm->inject_in_progress = inject != nullptr && std::strcmp(inject, "in_progress") == 0;
  const char* order = std::getenv("KEEL_CUDA_EMU_NCCL_ORDER");
  comm->order_counts_only = order != nullptr && std::strcmp(order, "count") == 0;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclSystemError:
      return "unhandled system error (emulated NCCL)";
    case ncclInternalError:
      return "internal error (emulated NCCL)";
    case ncclInvalidArgument:
      return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage:
      return "invalid usage (emulated NCCL)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (emulated NCCL)";
    default:
      return "error (emulated NCCL)";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_error_mu);
  return comm != nullptr ? comm->last_error.c_str() : g_last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::atomic<int64_t> serial{0};
  int initialized = 0, world_rank = 0;
  MPI_Initialized(&initialized);
  if (initialized) MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  const IdFields f{kMagic, world_rank, serial++};
  std::memset(id->internal, 0, sizeof(id->internal));
  std::memcpy(id->internal, &f, sizeof(f));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  *out = nullptr;
  IdFields f;
  std::memcpy(&f, id.internal, sizeof(f));
  if (f.magic != kMagic) return error(nullptr, ncclInvalidArgument, "not an emulator unique id");
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return error(nullptr, ncclInvalidArgument,
                 "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  }
  auto comm = std::make_unique<ncclComm>();
  comm->rank = rank;
  comm->size = nranks;
  init_from_env(comm.get());
  if (nranks > 1) {
    int initialized = 0, world_rank = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      return error(nullptr, ncclInvalidUsage, "a communicator of several ranks needs MPI");
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    const int tag = kBootstrapTag + static_cast<int>(f.serial % 1000);
    std::vector<int> members(static_cast<size_t>(nranks), -1);
    if (rank == 0) {
      if (world_rank != f.root_world_rank) {
        return error(nullptr, ncclInvalidUsage, "rank 0 is not the rank that made the id");
      }
      members[0] = world_rank;
      for (int i = 1; i < nranks; ++i) {
        int msg[2];
        MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (msg[0] < 1 || msg[0] >= nranks || members[static_cast<size_t>(msg[0])] != -1) {
          return error(nullptr, ncclInvalidUsage, "two ranks claim the same place in a comm");
        }
        members[static_cast<size_t>(msg[0])] = msg[1];
      }
      for (int i = 1; i < nranks; ++i) {
        MPI_Send(members.data(), nranks, MPI_INT, members[static_cast<size_t>(i)], tag,
                 MPI_COMM_WORLD);
      }
    } else {
      const int msg[2] = {rank, world_rank};
      MPI_Send(msg, 2, MPI_INT, f.root_world_rank, tag, MPI_COMM_WORLD);
      MPI_Recv(members.data(), nranks, MPI_INT, f.root_world_rank, tag, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
    }
    MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, nranks, members.data(), &group);
    const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &comm->mpi);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    if (rc != MPI_SUCCESS) return error(nullptr, ncclSystemError, "MPI_Comm_create_group failed");
  }
  *out = comm.release();
  return ncclSuccess;
}

// ncclCommInitRank, non-blocking when config->blocking is 0 (returns ncclInProgress).
ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  const ncclResult_t rc = ncclCommInitRank(out, nranks, id, rank);
  if (rc != ncclSuccess || config == nullptr || config->blocking != 0) return rc;
  (*out)->nonblocking = true;
  return started(*out);
}

// As NCCL's: collective over `comm`'s ranks; those of one color form a communicator ranked by
// key, ties broken by their rank in `comm` (MPI_Comm_split's order), NCCL_SPLIT_NOCOLOR takes no
// part (null). Of `config`, only `blocking` is emulated (non-blocking when 0).
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  *newcomm = nullptr;
  if (comm == nullptr) return error(nullptr, ncclInvalidArgument, "ncclCommSplit: null comm");
  if (comm->aborted->load()) {
    return error(comm, ncclInvalidUsage, "ncclCommSplit of an aborted communicator");
  }
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
    return error(comm, ncclInvalidArgument, "ncclCommSplit: negative color");
  }
  auto child = std::make_unique<ncclComm>();
  if (comm->mpi == MPI_COMM_NULL) {  // a communicator of one rank
    if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  } else {
    if (std::this_thread::get_id() != comm->owner) {
      return error(comm, ncclInvalidUsage,
                   "ncclCommSplit from another thread (MPI_THREAD_FUNNELED)");
    }
    MPI_Comm split = MPI_COMM_NULL;
    if (MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key,
                       &split) != MPI_SUCCESS) {
      return error(comm, ncclSystemError, "ncclCommSplit: MPI_Comm_split failed");
    }
    if (split == MPI_COMM_NULL) return ncclSuccess;  // NCCL_SPLIT_NOCOLOR
    MPI_Comm_rank(split, &child->rank);
    MPI_Comm_size(split, &child->size);
    if (child->size > 1) {
      child->mpi = split;
    } else {
      MPI_Comm_free(&split);  // a group of one copies, as ncclCommInitRank's does
    }
  }
  init_from_env(child.get());
  child->nonblocking = config != nullptr && config->blocking == 0;
  *newcomm = child.release();
  return started(*newcomm);
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr) return error(nullptr, ncclInvalidArgument, "ncclCommCount: null comm");
  *count = comm->size;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr) return error(nullptr, ncclInvalidArgument, "ncclCommUserRank: null comm");
  *rank = comm->rank;
  return ncclSuccess;
}

// As NCCL's (commDestroySync): waits for the other ranks before it frees anything (NCCL's is an
// intra-node barrier before its proxy threads stop), so destroying while a peer still trains
// blocks here as it would there; ncclCommAbort does not wait.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  if (comm->mpi != MPI_COMM_NULL && !comm->aborted->load()) {
    MPI_Barrier(comm->mpi);
    MPI_Comm_free(&comm->mpi);
  }
  delete comm;
  return ncclSuccess;
}

// Abandons the communicator's collectives (pending work reports complete). Safe from any thread:
// it makes no MPI call (the MPI communicator is leaked, as its requests may still be active).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  comm->aborted->store(true);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  if (comm == nullptr) return ncclInvalidArgument;
  *async = comm->async_error.load();
  if (*async == ncclInProgress && !comm->stuck.load()) {
    // Reported once, then settled (an error injected meanwhile stays).
    ncclResult_t in_progress = ncclInProgress;
    comm->async_error.compare_exchange_strong(in_progress, ncclSuccess);
  }
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t rc = check_call(comm, type, "ncclAllReduce"); rc != ncclSuccess) return rc;
  if (mpi_op(op, type) == MPI_OP_NULL) return error(comm, ncclInvalidArgument, "op not emulated");
  if (grouped(comm, [=] { return ncclAllReduce(send, recv, count, type, op, comm, stream); })) {
    return ncclSuccess;
  }
  const size_t bytes = count * type_size(type);
  if (inject_failure(comm, stream, {send, bytes}, {recv, bytes}))
    return comm->stuck ? ncclInProgress : ncclSuccess;
  if (comm->size == 1) return copy_on_stream(comm, stream, send, recv, bytes);
  return enqueue(comm, stream, {}, {send, bytes}, {recv, bytes}, "ncclAllReduce",
                 [&](const void* s, void* r, const void*, MPI_Request* req) {
                   return MPI_Iallreduce(send == recv ? MPI_IN_PLACE : s, r,
                                         static_cast<int>(count), mpi_type(type), mpi_op(op, type),
                                         comm->mpi, req);
                 });
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t rc = check_call(comm, type, "ncclBroadcast"); rc != ncclSuccess) return rc;
  if (root < 0 || root >= comm->size) return error(comm, ncclInvalidArgument, "bad root");
  if (grouped(comm, [=] { return ncclBroadcast(send, recv, count, type, root, comm, stream); })) {
    return ncclSuccess;
  }
  const size_t bytes = count * type_size(type);
  if (inject_failure(comm, stream, {send, bytes}, {recv, bytes}))
    return comm->stuck ? ncclInProgress : ncclSuccess;
  if (comm->size == 1) return copy_on_stream(comm, stream, send, recv, bytes);
  wait_for_buffers(stream, {send, bytes}, {recv, bytes});
  if (comm->rank == root && send != recv && bytes > 0) {
    const keel_emu::host_guard::DeviceScope device;  // the collective's own copy
    std::memmove(recv, send, bytes);
  }
  return enqueue(comm, stream, {}, {send, bytes}, {recv, bytes}, "ncclBroadcast",
                 [&](const void*, void* r, const void*, MPI_Request* req) {
                   return MPI_Ibcast(r, static_cast<int>(count), mpi_type(type), root, comm->mpi,
                                     req);
                 });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvcount, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t rc = check_call(comm, type, "ncclReduceScatter"); rc != ncclSuccess) {
    return rc;
  }
  if (mpi_op(op, type) == MPI_OP_NULL) return error(comm, ncclInvalidArgument, "op not emulated");
  if (grouped(comm,
              [=] { return ncclReduceScatter(send, recv, recvcount, type, op, comm, stream); })) {
    return ncclSuccess;
  }
  const size_t bytes = recvcount * type_size(type);
  const size_t all = bytes * static_cast<size_t>(comm->size);
  if (inject_failure(comm, stream, {send, all}, {recv, bytes}))
    return comm->stuck ? ncclInProgress : ncclSuccess;
  if (comm->size == 1) return copy_on_stream(comm, stream, send, recv, bytes);
  wait_for_buffers(stream, {send, all}, {recv, bytes});
  std::vector<char> copy;
  if (overlaps(send, all, recv, bytes)) {
    // NCCL defines one overlap only, in place: recv is this rank's block of send.
    if (static_cast<const char*>(recv) !=
        static_cast<const char*>(send) + bytes * static_cast<size_t>(comm->rank)) {
      return error(comm, ncclInvalidArgument,
                   "ncclReduceScatter: send and recv overlap other than in place (recv = send + "
                   "rank * recvcount)");
    }
    const keel_emu::host_guard::DeviceScope device;  // the collective's own copy
    copy.assign(static_cast<const char*>(send), static_cast<const char*>(send) + all);
  }
  const bool copied = !copy.empty();
  return enqueue(comm, stream, std::move(copy), {send, all}, {recv, bytes}, "ncclReduceScatter",
                 [&](const void* s, void* r, const void* scratch, MPI_Request* req) {
                   return MPI_Ireduce_scatter_block(copied ? scratch : s, r,
                                                    static_cast<int>(recvcount), mpi_type(type),
                                                    mpi_op(op, type), comm->mpi, req);
                 });
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  if (const ncclResult_t rc = check_call(comm, type, "ncclAllGather"); rc != ncclSuccess) return rc;
  if (grouped(comm, [=] { return ncclAllGather(send, recv, sendcount, type, comm, stream); })) {
    return ncclSuccess;
  }
  const size_t bytes = sendcount * type_size(type);
  const size_t all = bytes * static_cast<size_t>(comm->size);
  if (inject_failure(comm, stream, {send, bytes}, {recv, all}))
    return comm->stuck ? ncclInProgress : ncclSuccess;
  if (comm->size == 1) return copy_on_stream(comm, stream, send, recv, bytes);
  wait_for_buffers(stream, {send, bytes}, {recv, all});
  // In place when send is this rank's block of recv (NCCL's in-place form).
  const bool in_place = static_cast<const char*>(send) ==
                        static_cast<const char*>(recv) + bytes * static_cast<size_t>(comm->rank);
  // NCCL defines one overlap only, in place; any other is undefined there, an error here.
  if (!in_place && overlaps(send, bytes, recv, all)) {
    return error(comm, ncclInvalidArgument,
                 "ncclAllGather: send and recv overlap other than in place (send = recv + rank * "
                 "sendcount)");
  }
  return enqueue(comm, stream, {}, {send, bytes}, {recv, all}, "ncclAllGather",
                 [&](const void* s, void* r, const void* /*scratch*/, MPI_Request* req) {
                   return MPI_Iallgather(in_place ? MPI_IN_PLACE : s, static_cast<int>(sendcount),
                                         mpi_type(type), r, static_cast<int>(sendcount),
                                         mpi_type(type), comm->mpi, req);
                 });
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) {
    return error(nullptr, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  }
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<std::pair<ncclComm*, std::function<ncclResult_t()>>> calls = std::move(t_grouped);
  t_grouped.clear();
  if (!calls.empty()) ++g_groups;
  ncclResult_t first = ncclSuccess;
  t_in_group_end = true;
  for (const auto& call : calls) {
    ++g_grouped_calls;
    const ncclResult_t rc = call.second();
    if (rc != ncclSuccess && first == ncclSuccess) first = rc;
  }
  t_in_group_end = false;
  if (first != ncclSuccess) return first;
  // Non-blocking communicators: the group is in progress until each is polled.
  ncclResult_t out = ncclSuccess;
  for (const auto& call : calls) {
    if (started(call.first) == ncclInProgress) out = ncclInProgress;
  }
  return out;
}

// The emulator's own: groups that started at least one collective, and the collectives started
// through groups (nccl_mpi_test.cc).
int64_t keel_emu_nccl_groups() { return g_groups.load(); }
int64_t keel_emu_nccl_grouped_calls() { return g_grouped_calls.load(); }

// The emulator's own: how many collectives of this process started unordered with another
// communicator's (Note [nccl launch order] above), counted in both modes.
int64_t keel_emu_nccl_unordered_starts() { return g_unordered.load(); }

}  // extern "C"
