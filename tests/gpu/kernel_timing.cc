// CUPTI's asynchronous activity buffers (cupti_activity.h, and the CUPTI samples'
// activity_trace_async): CUPTI asks for an empty buffer through the request callback and hands
// it back full (or at a flush) through the completion callback, possibly on a thread of its own,
// where the records are read with cuptiActivityGetNextRecord until CUPTI_ERROR_MAX_LIMIT_REACHED,
// the dropped count is read, and the buffer is freed. Callbacks registered before any kind is
// enabled; the device synchronised before the forced flush so every record is complete.
#include "tests/gpu/kernel_timing.h"

#include <cuda_runtime.h>
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

#include "framework/error.h"

namespace keel::kernel_timing {
namespace {

// 4 MiB a buffer: a 124M step is about 830 launches of some 200 bytes of record each.
constexpr size_t kBufferBytes = size_t{4} << 20;
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

std::string result_string(CUptiResult r) {
  const char* s = nullptr;
  if (cuptiGetResultString(r, &s) != CUPTI_SUCCESS || s == nullptr) {
    return "CUPTI result " + std::to_string(static_cast<int>(r));
  }
  return s;
}

const char* hint(CUptiResult r) {
  switch (r) {
    case CUPTI_ERROR_INSUFFICIENT_PRIVILEGES:
    case CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES:
      return " (profiling is restricted to administrators on this machine: "
             "https://developer.nvidia.com/CUPTI_ERROR_INSUFFICIENT_PRIVILEGES)";
    case CUPTI_ERROR_NOT_COMPATIBLE:
      return " (libcupti does not match the driver: a CUPTI newer than the driver supports, "
             "or another profiler attached)";
    case CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
      return " (another CUPTI client, e.g. Nsight Systems, is attached)";
    case CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED:
      return " (CUPTI does not support this virtualised GPU)";
    default:
      return "";
  }
}

void check(CUptiResult r, const char* call) {
  KEEL_CHECK(r == CUPTI_SUCCESS, kInternal, "CUPTI: ", call, " failed: ", result_string(r),
             hint(r));
}

#define KEEL_CUPTI(call) check((call), #call)

const char* copy_direction(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "PtoP";
    default:
      return "other";
  }
}

// What the completion callback (on CUPTI's thread, or in the flush) hands to stop().
struct Sink {
  std::mutex mu;
  std::vector<kernel_table::Record> records;
  size_t dropped = 0;
  size_t incomplete_buffers = 0;  // a record CUPTI_ERROR_INVALID_KIND ended the buffer early
  std::string error;              // the first failure inside a callback (they cannot throw)
};

Sink& sink() {
  static Sink s;
  return s;
}

void note_error(const std::string& what) {
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.error.empty()) s.error = what;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  // Records are ACTIVITY_RECORD_ALIGNMENT (8)-aligned; kBufferBytes is a multiple of it.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
  if (*buffer == nullptr) {
    note_error("could not allocate a " + std::to_string(kBufferBytes) +
               "-byte activity buffer (CUPTI drops records)");
  }
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream_id, uint8_t* buffer,
                               size_t /*size*/, size_t valid_size) {
  std::vector<kernel_table::Record> got;
  bool incomplete = false;
  std::string error;
  if (buffer != nullptr && valid_size > 0) {
    CUpti_Activity* record = nullptr;
    for (;;) {
      const CUptiResult r = cuptiActivityGetNextRecord(buffer, valid_size, &record);
      if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;  // the buffer's end
      if (r == CUPTI_ERROR_INVALID_KIND) {            // incomplete or invalid: stop here
        incomplete = true;
        break;
      }
      if (r != CUPTI_SUCCESS) {
        error = "CUPTI: cuptiActivityGetNextRecord failed: " + result_string(r);
        break;
      }
      kernel_table::Record out;
      switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
          out.kind = kernel_table::Record::Kind::kKernel;
          out.name = k->name != nullptr ? k->name : "(unnamed kernel)";
          out.start_ns = k->start;
          out.end_ns = k->end;
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
          out.kind = kernel_table::Record::Kind::kMemcpy;
          out.name = copy_direction(m->copyKind);
          out.start_ns = m->start;
          out.end_ns = m->end;
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
          out.kind = kernel_table::Record::Kind::kMemset;
          out.start_ns = m->start;
          out.end_ns = m->end;
          break;
        }
        default:
          continue;  // a kind not asked for
      }
      got.push_back(std::move(out));
    }
  }
  size_t dropped = 0;
  const CUptiResult r = cuptiActivityGetNumDroppedRecords(context, stream_id, &dropped);
  if (r != CUPTI_SUCCESS && error.empty()) {
    error = "CUPTI: cuptiActivityGetNumDroppedRecords failed: " + result_string(r);
  }
  std::free(buffer);  // CUPTI has given it up; ours (buffer_requested's aligned_alloc)
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& rec : got) s.records.push_back(std::move(rec));
  s.dropped += dropped;
  s.incomplete_buffers += incomplete ? 1 : 0;
  if (s.error.empty()) s.error = error;
}

bool registered = false;  // the callbacks, once a process (CUPTI keeps them)

}  // namespace

Recorder::Recorder() {
  if (!registered) {
    KEEL_CUPTI(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    registered = true;
  }
}

Recorder::~Recorder() {
  if (!recording_) return;
  for (const CUpti_ActivityKind kind : kKinds) {
    const CUptiResult r = cuptiActivityDisable(kind);
    if (r != CUPTI_SUCCESS) {
      std::fprintf(stderr, "kernel_timing: cuptiActivityDisable(%d) failed: %s\n",
                   static_cast<int>(kind), result_string(r).c_str());
    }
  }
}

void Recorder::start() {
  KEEL_CHECK(!recording_, kInternal, "kernel_timing::Recorder::start: already recording");
  {
    Sink& s = sink();
    std::lock_guard<std::mutex> lock(s.mu);
    s.records.clear();
    s.dropped = 0;
    s.incomplete_buffers = 0;
    s.error.clear();
  }
  for (const CUpti_ActivityKind kind : kKinds) KEEL_CUPTI(cuptiActivityEnable(kind));
  recording_ = true;
}

std::vector<kernel_table::Record> Recorder::stop() {
  KEEL_CHECK(recording_, kInternal, "kernel_timing::Recorder::stop: not recording");
  const cudaError_t sync = cudaDeviceSynchronize();
  KEEL_CHECK(sync == cudaSuccess, kInternal,
             "kernel_timing: cudaDeviceSynchronize before the CUPTI flush failed: ",
             cudaGetErrorString(sync));
  // Forced: every buffer, complete or not, goes to buffer_completed before this returns.
  KEEL_CUPTI(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  recording_ = false;
  for (const CUpti_ActivityKind kind : kKinds) KEEL_CUPTI(cuptiActivityDisable(kind));
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mu);
  KEEL_CHECK(s.error.empty(), kInternal, "kernel_timing: ", s.error);
  KEEL_CHECK(s.dropped == 0, kInternal, "kernel_timing: CUPTI dropped ", s.dropped,
             " activity records (no buffer space): the table would miss launches");
  KEEL_CHECK(s.incomplete_buffers == 0, kInternal, "kernel_timing: ", s.incomplete_buffers,
             " activity buffer(s) ended in an incomplete record after the device was "
             "synchronised");
  return std::exchange(s.records, {});
}

}  // namespace keel::kernel_timing
