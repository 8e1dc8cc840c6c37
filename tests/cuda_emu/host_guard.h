// The CUDA emulator's host guard (README.md here, "The host guard"; issue 30): device memory is
// host memory on the emulator, so host code that dereferences a device pointer (a std::copy
// through a cudaMalloc'd buffer) passes there and faults on a GPU. With the guard on, the
// emulator keeps every device allocation (cudaMalloc's, so the caching allocator's blocks too;
// not cudaMallocHost's pinned memory) PROT_NONE, so such a dereference faults here as well and
// dies with one line naming the address and the allocation.
//
// Device work opens what it touches: a thread inside a DeviceScope (a stream's task: kernels, with
// their blocks on the pool threads, async copies and fills, cuBLASLt's matmuls with their OpenMP
// threads, the sort, the emulated cuDNN's steps; a synchronous cudaMemcpy; the emulated NCCL's
// staging copies) that faults on a guarded allocation opens the whole allocation for reading and
// writing, and when the last open scope of the process closes every opened allocation is made
// PROT_NONE again. A thread outside any scope that faults on a guarded allocation is host code
// dereferencing device memory: the process prints
//
//   keel cuda emulator: host read of device memory at 0x... by f+0x.. (offset N in cudaMalloc
//   #K of B bytes at 0x..., allocated from g <- h <- ...): only device work may touch it ...
//
// to stderr (by: the faulting instruction; allocated from: cudaMalloc's callers; a function the
// binary does not export shows as the binary and an offset, for addr2line) and exits with
// kExitCode. Faults elsewhere (the guard page past an allocation's end, a
// use after cudaFree) go to the previous SIGSEGV handler, as without the guard.
//
// What it cannot see: a host access on one thread while device work on another has the same
// allocation open (the emulator's default schedule runs a task on the thread that submits it, so a
// single host thread is checked completely). Not for use with the roofline measurement
// (roofline.h), which reopens device memory after each measured task. Each task pays one fault and
// one mprotect per allocation it touches, and one mprotect per allocation at its end: opt-in,
// for the few ctests that run under it.
#pragma once

#include <cstddef>

namespace keel_emu::host_guard {

// The exit status of a process that dereferenced device memory from host code.
constexpr int kExitCode = 86;

// On from the start with KEEL_CUDA_EMU_HOST_GUARD=1, or from set_enabled(true) (tests): guards the
// allocations made from then on. Off opens and forgets the guarded ones.
void set_enabled(bool on);
bool enabled();

// cudaMalloc's and cudaFree's (runtime.cc): [begin, begin + bytes) becomes PROT_NONE, named by a
// serial number and the call stack that asked for it. No-ops when the guard is off.
void add(void* begin, size_t bytes);
void remove(void* begin);

// How many allocations are guarded now (tests).
size_t guarded();

// Device work: guarded memory the scope's thread touches is opened for it (above). Nests; cheap
// when the guard is off.
class DeviceScope {
 public:
  DeviceScope();
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  bool counted_;
};

}  // namespace keel_emu::host_guard
