// The CUDA emulator's device-side half (see README.md here): force-included into the CUDA
// backend's sources when they are compiled by the host compiler for tests/cuda_emu. It maps the
// CUDA keywords to host C++ and gives kernels their built-in variables, barriers, warp shuffles
// and atomics, all backed by the emulator's scheduler (runtime.cc), which runs every CUDA thread
// of a block as a fiber on the calling host thread.
//
// Note [cuda-emu-shared]: translate.py turns every static __shared__ declaration into a reference
// into the running block's shared area (static_shared below), and `extern __shared__` into a
// pointer to its dynamic shared memory. Both are poisoned with NaN (0xFF bytes) before each block
// runs, so a kernel that reads shared memory it did not write in this block reads NaN, and their
// sum is held to the block's shared-memory limit.
#pragma once

// Every CUDA header first, while the CUDA keywords still mean what the headers expect.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __shared__
#define __shared__ __shared___left_untranslated_by_translate_py
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline

namespace keel_emu {

// The built-in variables of the running CUDA thread.
struct ThreadIds {
  uint3 thread_idx{};
  uint3 block_idx{};
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadIds& ids();

// __syncthreads at file:line. Every live thread of the block must reach the same one: threads
// waiting at different __syncthreads (divergent barriers, undefined behaviour in CUDA) are a
// fault.
void syncthreads(const char* file, int line);
// The warp exchange behind every shuffle: publishes `bits` as this lane's value, waits until every
// lane of `mask` that has not exited has published, and returns the value of lane `src` (which
// must be in `mask` and not have exited).
uint64_t warp_exchange(uint32_t mask, uint64_t bits, int src, const char* what);
int lane_id();

// Dynamic shared memory of the running block (poisoned with NaN before the block starts).
void* dynamic_shared();

// Work a stream holds that completes later (the emulated NCCL's collectives, nccl.cc): started
// at its call, complete once test() says so. Work queued on the stream after it waits for it, as
// stream order requires; cudaStreamQuery and cudaEventQuery poll it.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual bool test() = 0;  // true once complete (or abandoned); must not block
  virtual bool touches(const void* /*p*/, size_t /*n*/) const { return true; }
};
void enqueue_pending(cudaStream_t stream, std::shared_ptr<Pending> work);

// Note [cuda-emu-deferred]: device work (kernels, async copies and fills, cuBLASLt matmuls, the
// emulated cuDNN's host steps) is a task queued on its stream. By default a task runs at its call,
// once the stream's earlier work is done. With KEEL_CUDA_EMU_DEFERRED=1 (or set_deferred) it runs
// only when something needs it: a synchronisation (stream, event, device, a synchronous copy), a
// query, a later NCCL collective on its stream, or a stream that waits on an event recorded after
// it. So a host read without its synchronisation, a stream that uses another's results without
// cudaStreamWaitEvent, or a host write into a buffer an async copy has not yet read sees what was
// there before: NaN in fresh memory, deterministically rather than by timing. A fault in a
// deferred task is reported by the call that ran it (and by cudaGetLastError), as a GPU reports a
// kernel's fault at the next synchronisation.
void submit(cudaStream_t stream, std::function<void()> task);
bool deferred();
bool set_deferred(bool on);  // returns the previous setting (tests)
// Completes everything queued on `stream` (legacy default stream semantics for nullptr).
void wait_stream(cudaStream_t stream);
// Waits only for the stream's pending collectives that touch [p, p + n).
void wait_stream_touching(cudaStream_t stream, const void* p, size_t n);
// Before a collective starts on `stream` (nccl.cc): completes its queued tasks and the waits on
// other streams' events, so the collective reads its inputs as stream order defines them. The
// collectives still pending on it are left running (they are independent MPI requests).
void prepare_collective(cudaStream_t stream);
// The number of emulated GPUs: KEEL_CUDA_EMU_DEVICES (default 1). They share the host's memory.
int device_count();

struct LaunchConfig {
  const char* name;
  const char* source;  // the kernel's .cu (its ptxas resources are looked up by source and name)
  const void* kernel;
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
};
// Checks cfg as a GPU launch does (a bad configuration fails here, through cudaGetLastError),
// then queues the grid on its stream: body(arg) runs once per CUDA thread (Note
// [cuda-emu-deferred]); a fault is reported through cudaGetLastError, as a GPU's is.
void run_grid(const LaunchConfig& cfg, void (*body)(const void*), std::shared_ptr<const void> arg);

// Runs call(args...) on every thread of cfg's grid, each thread with its own copy of `args`. The
// grid owns copies of both, as a CUDA launch owns its arguments once it returns.
template <typename Call, typename Tuple>
void run_each_thread(const LaunchConfig& cfg, const Call& call, const Tuple& args) {
  struct Bound {
    Call call;
    Tuple args;
  };
  auto bound = std::make_shared<const Bound>(Bound{call, args});
  run_grid(
      cfg,
      [](const void* p) {
        const Bound& b = *static_cast<const Bound*>(p);
        Tuple mine = b.args;
        std::apply(b.call, mine);
      },
      std::shared_ptr<const void>(bound, bound.get()));
}

template <typename... Params>
class Launcher {
 public:
  Launcher(void (*kernel)(Params...), const char* name, const char* source, dim3 grid, dim3 block,
           size_t shared_bytes, cudaStream_t stream)
      : kernel_(kernel), cfg_{name,  source, reinterpret_cast<const void*>(kernel),
                              grid,  block,  shared_bytes,
                              stream} {}

  // The arguments convert to the kernel's parameter types once, at the launch, as CUDA's do; each
  // thread gets its own copy of them.
  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "kernel launched with the wrong arity");
    run_each_thread(cfg_, kernel_,
                    std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...));
  }

 private:
  void (*kernel_)(Params...);
  LaunchConfig cfg_;
};

template <typename... Params>
Launcher<Params...> launch(void (*kernel)(Params...), const char* name, const char* source,
                           dim3 grid, dim3 block, size_t shared_bytes = 0,
                           cudaStream_t stream = nullptr) {
  return Launcher<Params...>(kernel, name, source, grid, block, shared_bytes, stream);
}

// A launch of a kernel named without its template arguments (the call deduces them): `call` is a
// generic lambda that calls the kernel with its arguments. Its address is unknown, so it may not
// use more than the default 48 KiB of dynamic shared memory (run_grid says so).
class DeducedLauncher {
 public:
  DeducedLauncher(const char* name, const char* source, dim3 grid, dim3 block,
                  size_t shared_bytes = 0, cudaStream_t stream = nullptr)
      : cfg_{name, source, nullptr, grid, block, shared_bytes, stream} {}

  template <typename Call, typename... Args>
  void operator()(Call call, Args&&... args) const {
    run_each_thread(cfg_, call, std::tuple<std::decay_t<Args>...>(std::forward<Args>(args)...));
  }

 private:
  LaunchConfig cfg_;
};

inline DeducedLauncher launch_deduced(const char* name, const char* source, dim3 grid, dim3 block,
                                      size_t shared_bytes = 0, cudaStream_t stream = nullptr) {
  return DeducedLauncher(name, source, grid, block, shared_bytes, stream);
}

// Note [cuda-emu-resources]: a GPU refuses a launch whose block needs more registers than an SM
// has, or more threads than the kernel's __launch_bounds__ ("too many resources requested for
// launch"), from what ptxas compiled. The emulator holds every launch of a kernel of
// framework/kernels/cuda/ to the real sm_90 build's figures, the tables cmake/nvcc_resources.py
// writes while keel_cuda compiles (KEEL_EMU_RESOURCES_DIR): the most registers and the smallest
// bound over the kernel's instances. A kernel of that folder missing from them is a launch error.
// Entries set here (tests) stand for the kernel `name` of the .cu whose stem is `source`.
void set_kernel_resources(const char* source, const char* name, int registers, int max_threads);

// The running block's static shared variable tagged `tag` (a static local of the declaring
// function, so each declaration and template instantiation has its own): every thread of the
// block gets the same object, NaN-poisoned when the block starts.
void* block_static_shared(const void* tag, size_t bytes, size_t align);
template <typename T, size_t Align = alignof(T)>
T& static_shared(const void* tag) {
  static_assert(std::is_trivially_copyable_v<T>, "shared memory holds trivial types");
  return *static_cast<T*>(block_static_shared(tag, sizeof(T), Align));
}

template <typename T>
T* dynamic_shared_as() {
  return static_cast<T*>(dynamic_shared());
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace keel_emu

#define threadIdx (::keel_emu::ids().thread_idx)
#define blockIdx (::keel_emu::ids().block_idx)
#define blockDim (::keel_emu::ids().block_dim)
#define gridDim (::keel_emu::ids().grid_dim)

#define __syncthreads() ::keel_emu::syncthreads(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::keel_emu::warp_exchange(mask, 0, ::keel_emu::lane_id(), "__syncwarp");
}

// Lane `src` of this lane's width-wide segment; a lane outside [0, width) reads its own segment's
// lane src mod width, as CUDA defines.
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = ::keel_emu::lane_id();
  const int from = (lane / width) * width + ((src % width) + width) % width;
  return ::keel_emu::from_bits<T>(
      ::keel_emu::warp_exchange(mask, ::keel_emu::to_bits(v), from, "__shfl_sync"));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::keel_emu::lane_id();
  int from = lane ^ lane_mask;
  if (from / width > lane / width) from = lane;  // a later segment: the lane's own value (CUDA)
  return ::keel_emu::from_bits<T>(
      ::keel_emu::warp_exchange(mask, ::keel_emu::to_bits(v), from, "__shfl_xor_sync"));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::keel_emu::lane_id();
  int from = lane + static_cast<int>(delta);
  if (from / width != lane / width) from = lane;
  return ::keel_emu::from_bits<T>(
      ::keel_emu::warp_exchange(mask, ::keel_emu::to_bits(v), from, "__shfl_down_sync"));
}

// Atomics: kernel runs are serialised, but these stay real atomics, so another host thread that
// reads the memory meanwhile sees whole values.
template <typename T>
T atomicAdd(T* p, T v) {
  std::atomic_ref<T> a(*p);
  if constexpr (std::is_integral_v<T>) {
    return a.fetch_add(v);
  } else {
    T old = a.load();
    while (!a.compare_exchange_weak(old, old + v)) {
    }
    return old;
  }
}
template <typename T>
T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old > v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomicCAS(T* p, T compare, T v) {
  std::atomic_ref<T> a(*p);
  a.compare_exchange_strong(compare, v);
  return compare;
}
// cuda_runtime.h's overload for a kernel itself exists for nvcc only.
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline int __float_as_int(float x) { return ::keel_emu::from_bits<int>(::keel_emu::to_bits(x)); }
inline float __int_as_float(int x) { return ::keel_emu::from_bits<float>(::keel_emu::to_bits(x)); }
inline unsigned __float_as_uint(float x) {
  return ::keel_emu::from_bits<unsigned>(::keel_emu::to_bits(x));
}
inline float __uint_as_float(unsigned x) {
  return ::keel_emu::from_bits<float>(::keel_emu::to_bits(x));
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename T>
T __ldg(const T* p) {
  return *p;
}

// cub::DeviceRadixSort::SortPairs as the backend calls it: the size query with null temp storage,
// then a stable sort by the key bits [begin_bit, end_bit).
namespace cub {
struct DeviceRadixSort {
  template <typename K, typename V>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out,
                               const V* values_in, V* values_out, int n, int begin_bit = 0,
                               int end_bit = static_cast<int>(sizeof(K) * 8),
                               cudaStream_t stream = nullptr);
};
}  // namespace cub

namespace keel_emu {
cudaError_t sort_pairs_i32(void* temp, size_t& temp_bytes, const int32_t* keys_in,
                           int32_t* keys_out, const int32_t* values_in, int32_t* values_out, int n,
                           int begin_bit, int end_bit, cudaStream_t stream);
}  // namespace keel_emu

template <typename K, typename V>
cudaError_t cub::DeviceRadixSort::SortPairs(void* temp, size_t& temp_bytes, const K* keys_in,
                                            K* keys_out, const V* values_in, V* values_out, int n,
                                            int begin_bit, int end_bit, cudaStream_t stream) {
  static_assert(std::is_same_v<K, int32_t> && std::is_same_v<V, int32_t>,
                "the emulator sorts int32 pairs only");
  return ::keel_emu::sort_pairs_i32(temp, temp_bytes, keys_in, keys_out, values_in, values_out, n,
                                    begin_bit, end_bit, stream);
}

// ---- WMMA (nvcuda::wmma), as the backend uses it: bf16/fp32 m16n16k16 fragments ----
//
// How a fragment's elements spread over a warp's lanes is unspecified in CUDA, so each emulated
// lane holds the whole tile. Every operation is warp-collective, as CUDA requires: it starts with
// a full-warp __syncwarp (a warp that is not converged deadlocks there). Loads and stores check
// WMMA's rules (pointer 256-bit aligned, ldm a multiple of 16 bytes); a store writes, from each
// lane, only the elements whose index is the lane's modulo 32, so a lane that reads the stored
// tile before a __syncwarp sees what was there before.
namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];  // (r, c) at x[r * cols + c]
};

}  // namespace nvcuda::wmma

namespace keel_emu {

void wmma_fault(const char* what);  // stops the block with `what` (runtime.cc)

inline float wmma_to_float(float v) { return v; }
inline float wmma_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
void wmma_check(const char* op, const T* p, unsigned ldm) {
  __syncwarp();
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) wmma_fault(op);
  if ((static_cast<size_t>(ldm) * sizeof(T)) % 16 != 0) wmma_fault(op);
}

}  // namespace keel_emu

namespace nvcuda::wmma {

template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, T v) {
  __syncwarp();
  for (T& e : f.x) e = v;
}

// A or B from memory with the fragment's own layout: element (r, c) at p[r * ldm + c] (row_major)
// or p[r + c * ldm] (col_major).
template <typename Use, int M, int N, int K, typename T, typename L, typename P>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  ::keel_emu::wmma_check(
      "wmma::load_matrix_sync: pointer not 256-bit aligned or ldm not a "
      "multiple of 16 bytes",
      p, ldm);
  using F = fragment<Use, M, N, K, T, L>;
  for (int r = 0; r < F::rows; ++r) {
    for (int c = 0; c < F::cols; ++c) {
      f.x[r * F::cols + c] = std::is_same_v<L, row_major> ? p[r * ldm + c] : p[r + c * ldm];
    }
  }
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  ::keel_emu::wmma_check(
      "wmma::store_matrix_sync: pointer not 256-bit aligned or ldm not a "
      "multiple of 16 bytes",
      p, ldm);
  const int lane = ::keel_emu::lane_id();
  for (int e = lane; e < M * N; e += 32) {
    const int r = e / N, c = e % N;
    p[layout == mem_row_major ? r * ldm + c : r + c * ldm] = f.x[e];
  }
}

// d = a b + c, fp32 accumulation (each product of bf16 values is exact in fp32).
template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  __syncwarp();
  fragment<accumulator, M, N, K, float> out;
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float acc = c.x[i * N + j];
      for (int kk = 0; kk < K; ++kk) {
        acc +=
            ::keel_emu::wmma_to_float(a.x[i * K + kk]) * ::keel_emu::wmma_to_float(b.x[kk * N + j]);
      }
      out.x[i * N + j] = acc;
    }
  }
  d = out;
}

}  // namespace nvcuda::wmma
