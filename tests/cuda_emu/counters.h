// What the CUDA emulator counts (README.md here, "Budgets"): every kernel launch with its grid,
// every cuBLASLt matmul and cub sort (the libraries' launches), every point where the host waits
// for the device, and every device or pinned allocation. A GPU cannot be timed here, but these
// can be counted exactly, so tests hold a training step to budgets (tests/cuda_emu/budget_test.cc)
// and a regression (a launch added per parameter, a sync mid-step, an allocation in the step, a
// reduction on a handful of blocks) fails on every machine.
//
// Counting is always on and costs a lock per call; reset() starts a measurement, snapshot() reads
// it. Launches are counted at their call (before any deferred execution), refused ones too.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace keel_emu::counters {

struct Launch {
  std::string kernel;     // the kernel's name as written at its <<<>>>, or the library call
  uint64_t blocks = 0;    // grid.x * grid.y * grid.z; 0 for a library call
  uint64_t threads = 0;   // threads per block; 0 for a library call
  int64_t elements = -1;  // the work it covers where the call says (matmul: m * n * k,
                          // sort: n); -1 for kernels (their arguments are opaque here)
};

struct Snapshot {
  std::map<std::string, uint64_t> launches_by_kernel;
  uint64_t launches = 0;  // kernels and library calls
  // Host waits on the device, by call: cudaStreamSynchronize, cudaDeviceSynchronize,
  // cudaEventSynchronize, cudaMemcpy (synchronous), cudaFree (synchronises the device), and
  // cudaMemcpyAsync with a pageable host side ("pageable": a GPU stages it through a bounce
  // buffer, synchronously to the host for a download and for the source's staging of an upload).
  std::map<std::string, uint64_t> syncs_by_call;
  uint64_t syncs = 0;
  uint64_t device_allocations = 0;  // cudaMalloc
  uint64_t device_bytes = 0;
  uint64_t pinned_allocations = 0;  // cudaMallocHost
  std::vector<Launch> launch_list;  // in call order, the first 2^20 since reset()
};

// Starts a new measurement: every count to zero.
void reset();
// The counts since the last reset().
Snapshot snapshot();

// Called by the emulator (runtime.cc, cublaslt.cc).
void record_launch(const char* kernel, uint64_t blocks, uint64_t threads, int64_t elements);
void record_sync(const char* call);
void record_allocation(uint64_t bytes, bool pinned);

}  // namespace keel_emu::counters
