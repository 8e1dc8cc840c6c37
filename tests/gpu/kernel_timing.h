// Device time per kernel from CUPTI's Activity API, for keel-gpu-train-bench --kernel-table
// (tests/gpu/README.md). Built only into the real GPU's benchmark, where CMake finds libcupti
// (KEEL_HAVE_CUPTI); the CUDA emulator has no CUPTI. The records go to kernel_table.h, which
// groups and prints them.
//
//   kernel_timing::Recorder rec;  // registers CUPTI's buffer callbacks (once a process)
//   rec.start();                  // records kernels, copies and memsets from here
//   ...                           // the measured steps
//   auto records = rec.stop();    // synchronises the device, flushes, stops recording
//
// Every CUPTI call is checked; a failure throws keel::Error (kInternal) naming the call, CUPTI's
// result string and, where one helps, a hint. Records CUPTI dropped (no buffer) or could not
// parse make stop() throw too: a table missing launches would mislead. One Recorder at a time.
#pragma once

#include <vector>

#include "tests/gpu/kernel_table.h"

namespace keel::kernel_timing {

class Recorder {
 public:
  Recorder();
  ~Recorder();  // stops recording if still on (errors then are printed, not thrown)
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // Drops anything recorded before and enables CONCURRENT_KERNEL (which, unlike KERNEL, keeps
  // kernels concurrent), MEMCPY and MEMSET activity.
  void start();
  // cudaDeviceSynchronize, a forced flush of CUPTI's buffers (every record delivered to the
  // completion callback), the kinds disabled; the records since start().
  std::vector<kernel_table::Record> stop();

 private:
  bool recording_ = false;
};

}  // namespace keel::kernel_timing
