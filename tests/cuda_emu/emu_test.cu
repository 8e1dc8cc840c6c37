// The CUDA emulator's own tests: that its threads, barriers and shuffles behave as CUDA defines,
// and that each mistake it promises to catch (README.md here) is caught. CUDA source, translated
// like the backend's kernels (translate.py); built only into keel_cuda_emu_tests.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mma.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "framework/kernels/cuda/device.h"

namespace {

// ---- kernels ----

__global__ void ids_kernel(int* out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int per_block = blockDim.x * blockDim.y * blockDim.z;
  out[b * per_block + t] = b * 10000 + t;
}

__global__ void shuffle_kernel(int* xor_out, int* idx_out, int* down_out, int* seg_out) {
  const int lane = threadIdx.x % 32, i = threadIdx.x;
  xor_out[i] = __shfl_xor_sync(0xffffffffu, 100 + lane, 5);
  idx_out[i] = __shfl_sync(0xffffffffu, 100 + lane, 7);
  down_out[i] = __shfl_down_sync(0xffffffffu, 100 + lane, 3);
  seg_out[i] = __shfl_sync(0xffffffffu, 100 + lane, 1, 8);  // lane 1 of each 8-lane segment
}

// Tree sum over the block through shared memory: needs every barrier.
__global__ void block_sum_kernel(const float* x, float* out) {
  __shared__ float s[256];
  s[threadIdx.x] = x[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  for (int h = 128; h > 0; h /= 2) {
    if (static_cast<int>(threadIdx.x) < h) s[threadIdx.x] += s[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

// Reads a neighbour's shared value without a barrier: a race.
__global__ void racy_kernel(float* out) {
  extern __shared__ float s[];
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// Reads the value the previous thread writes, without a barrier: a race in the other direction.
__global__ void racy_backward_kernel(float* out) {
  extern __shared__ float s[];
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  const unsigned prev = threadIdx.x == 0 ? blockDim.x - 1 : threadIdx.x - 1;
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[prev];
}

// Lane 0 waits at __syncthreads while lanes 1-31 wait for it at a shuffle: hangs a GPU.
__global__ void deadlock_kernel(float* out) {
  if (threadIdx.x == 0) __syncthreads();
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Half the block waits at one __syncthreads, half at another.
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
    out[threadIdx.x] = 1.0f;
  } else {
    __syncthreads();
    out[threadIdx.x] = 2.0f;
  }
}

// A full-warp shuffle in a 16-thread block: the mask names lanes that do not exist.
__global__ void partial_warp_shuffle_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

template <typename T>
__global__ void big_shared_kernel(T* out) {
  extern __shared__ float big[];
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

__global__ void read_kernel(const float* in, float* out, int i) { out[0] = in[i]; }

__global__ void fill_kernel(float* out, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = v;
}
__global__ void add_one_kernel(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] + 1.0f;
}

// Stand-ins for kernels ptxas compiled with many registers or with launch bounds (the test gives
// them resources through keel_emu::set_kernel_resources).
__global__ void register_heavy_kernel(float* out) { out[threadIdx.x] = 1.0f; }
__global__ void bounded_kernel(float* out) { out[threadIdx.x] = 2.0f; }

__global__ void shared_poison_kernel(float* out) {
  extern __shared__ float s[];
  out[threadIdx.x] = s[threadIdx.x];
}

// Accumulates into static shared memory it never initialised: NaN on the emulator, garbage on a
// GPU.
__global__ void uninitialised_static_shared_kernel(float* out) {
  __shared__ float acc[2];
  if (threadIdx.x == 0) acc[0] += 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = acc[0];
}

// Half the warp returns; the rest exchange among themselves with the full mask (CUDA: exited
// lanes named in the mask do not take part).
__global__ void exited_lanes_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);
}

// C = A B for one 16 x 16 x 16 tile: A row-major, B column-major, C row-major.
__global__ void wmma_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, b, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

__global__ void atomic_kernel(int* counter, float* maxv) {
  atomicAdd(counter, 1);
  atomicMax(reinterpret_cast<int*>(maxv), __float_as_int(static_cast<float>(threadIdx.x)));
}

// ---- helpers ----

template <typename T>
T* device_alloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> to_host(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// The error of the last launch and what the emulator printed about it: at the launch, or (a
// fault while it runs, which deferred execution reports at the next synchronisation, as a GPU
// does) at the synchronisation after it.
struct LaunchResult {
  cudaError_t error;
  std::string message;
};
template <typename Launch>
LaunchResult launch_and_capture(Launch launch) {
  ::testing::internal::CaptureStderr();
  launch();
  const cudaError_t sync = cudaDeviceSynchronize();
  LaunchResult r;
  r.error = cudaGetLastError();
  if (r.error == cudaSuccess) r.error = sync;
  r.message = ::testing::internal::GetCapturedStderr();
  return r;
}

// Non-blocking streams for a test, destroyed with it.
class Streams {
 public:
  explicit Streams(int n) : s_(static_cast<size_t>(n)) {
    for (cudaStream_t& s : s_) EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), 0);
  }
  ~Streams() {
    for (cudaStream_t s : s_) cudaStreamDestroy(s);
  }
  cudaStream_t operator[](int i) const { return s_[static_cast<size_t>(i)]; }

 private:
  std::vector<cudaStream_t> s_;
};

// Runs the test's device work deferred (Note [cuda-emu-deferred] in emu.h) while it lives.
class Deferred {
 public:
  Deferred() : before_(keel_emu::set_deferred(true)) {}
  ~Deferred() {
    cudaDeviceSynchronize();
    keel_emu::set_deferred(before_);
  }

 private:
  bool before_;
};

// ---- semantics ----

TEST(CudaEmulator, BuiltInVariablesNumberEveryThreadOfEveryBlock) {
  const dim3 grid(3, 2, 2), block(4, 2, 3);
  const int n = 3 * 2 * 2 * 24;
  int* out = device_alloc<int>(n);
  ids_kernel<<<grid, block>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = to_host(out, n);
  for (int i = 0; i < n; ++i) EXPECT_EQ(h[i], (i / 24) * 10000 + i % 24) << i;
  cudaFree(out);
}

TEST(CudaEmulator, ShufflesFollowCudaSemantics) {
  const int n = 64;  // two warps
  int *x = device_alloc<int>(n), *idx = device_alloc<int>(n), *down = device_alloc<int>(n),
      *seg = device_alloc<int>(n);
  shuffle_kernel<<<1, n>>>(x, idx, down, seg);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto hx = to_host(x, n), hi = to_host(idx, n), hd = to_host(down, n), hs = to_host(seg, n);
  for (int i = 0; i < n; ++i) {
    const int lane = i % 32;
    EXPECT_EQ(hx[i], 100 + (lane ^ 5)) << i;
    EXPECT_EQ(hi[i], 107) << i;
    EXPECT_EQ(hd[i], 100 + (lane + 3 < 32 ? lane + 3 : lane)) << i;  // past the end: own value
    EXPECT_EQ(hs[i], 100 + lane / 8 * 8 + 1) << i;
  }
  cudaFree(x);
  cudaFree(idx);
  cudaFree(down);
  cudaFree(seg);
}

TEST(CudaEmulator, BarriersOrderSharedMemoryAcrossTheBlock) {
  const int blocks = 3;
  std::vector<float> x(blocks * 256);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 256 + 1);
  float* dx = device_alloc<float>(x.size());
  float* out = device_alloc<float>(blocks);
  cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
  block_sum_kernel<<<blocks, 256>>>(dx, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (float v : to_host(out, blocks)) EXPECT_EQ(v, 256.0f * 257.0f / 2.0f);
  cudaFree(dx);
  cudaFree(out);
}

TEST(CudaEmulator, ExitedLanesDoNotHoldUpAWarpExchange) {
  int* out = device_alloc<int>(16);
  exited_lanes_kernel<<<1, 32>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = to_host(out, 16);
  for (int l = 0; l < 16; ++l) EXPECT_EQ(h[l], l ^ 1) << l;
  cudaFree(out);
}

TEST(CudaEmulator, WmmaMultipliesATileAndChecksAlignment) {
  std::vector<__nv_bfloat16> a(256), b(256);
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2bfloat16_rn(static_cast<float>(i % 7) - 3.0f);
    b[i] = __float2bfloat16_rn(static_cast<float>(i % 5) - 2.0f);
  }
  auto* da = device_alloc<__nv_bfloat16>(256 + 16);
  auto* db = device_alloc<__nv_bfloat16>(256);
  float* dc = device_alloc<float>(256);
  cudaMemcpy(da, a.data(), 512, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), 512, cudaMemcpyHostToDevice);
  wmma_kernel<<<1, 32>>>(da, db, dc);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> c = to_host(dc, 256);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float want = 0.0f;  // B column-major: element (k, j) at b[k + 16 j]
      for (int k = 0; k < 16; ++k) {
        want += __bfloat162float(a[i * 16 + k]) * __bfloat162float(b[k + 16 * j]);
      }
      EXPECT_EQ(c[i * 16 + j], want) << i << "," << j;
    }
  }
  // 8 elements (16 bytes) in: not the 256-bit alignment WMMA's loads need.
  const LaunchResult r = launch_and_capture([&] { wmma_kernel<<<1, 32>>>(da + 8, db, dc); });
  EXPECT_EQ(r.error, cudaErrorLaunchFailure);
  EXPECT_NE(r.message.find("not 256-bit aligned"), std::string::npos) << r.message;
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

TEST(CudaEmulator, AtomicsSeeEveryThread) {
  int* counter = device_alloc<int>(1);
  float* maxv = device_alloc<float>(1);
  cudaMemset(counter, 0, sizeof(int));
  cudaMemset(maxv, 0, sizeof(float));
  atomic_kernel<<<4, 128>>>(counter, maxv);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(to_host(counter, 1)[0], 512);
  EXPECT_EQ(to_host(maxv, 1)[0], 127.0f);
  cudaFree(counter);
  cudaFree(maxv);
}

// ---- what it catches ----

TEST(CudaEmulator, AMissingBarrierShowsAsPoisonedSharedMemory) {
  float* out = device_alloc<float>(64);
  racy_kernel<<<1, 64, 64 * sizeof(float)>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // In either thread order some thread runs to its end before its neighbour writes: it reads the
  // NaN the block started with.
  int nan = 0;
  for (float v : to_host(out, 64)) nan += std::isnan(v);
  EXPECT_GE(nan, 1);
  cudaFree(out);
}

// Odd blocks run their threads in descending order (Note [cuda-emu-order] in runtime.cc): a
// thread reading what a lower thread wrote without a barrier reads NaN there.
TEST(CudaEmulator, ARaceInEitherDirectionShowsInOneOfTwoBlocks) {
  float* out = device_alloc<float>(128);
  racy_backward_kernel<<<2, 64, 64 * sizeof(float)>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> h = to_host(out, 128);
  // One block ran ascending (thread 4 wrote before thread 5 read), the other descending.
  const float a = h[5], b = h[64 + 5];
  EXPECT_TRUE((a == 4.0f && std::isnan(b)) || (std::isnan(a) && b == 4.0f)) << a << " " << b;
  cudaFree(out);
}

TEST(CudaEmulator, ABarrierAndAShuffleWaitingForEachOtherIsADeadlock) {
  float* out = device_alloc<float>(32);
  const LaunchResult r = launch_and_capture([&] { deadlock_kernel<<<1, 32>>>(out); });
  EXPECT_EQ(r.error, cudaErrorLaunchFailure);
  EXPECT_NE(r.message.find("kernel deadlock_kernel block (0,0,0)"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("deadlock: 1 thread(s) at __syncthreads"), std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("waits for lanes 0x1"), std::string::npos) << r.message;
  cudaFree(out);
}

TEST(CudaEmulator, DivergentBarriersAreAFault) {
  float* out = device_alloc<float>(32);
  const LaunchResult r = launch_and_capture([&] { divergent_barrier_kernel<<<1, 32>>>(out); });
  EXPECT_EQ(r.error, cudaErrorLaunchFailure);
  EXPECT_NE(r.message.find("divergent __syncthreads"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("emu_test.cu"), std::string::npos) << r.message;
  cudaFree(out);
}

TEST(CudaEmulator, AShuffleMaskNamingMissingLanesIsAFault) {
  float* out = device_alloc<float>(16);
  const LaunchResult r = launch_and_capture([&] { partial_warp_shuffle_kernel<<<1, 16>>>(out); });
  EXPECT_EQ(r.error, cudaErrorLaunchFailure);
  EXPECT_NE(r.message.find("only lanes of the block (0xffff)"), std::string::npos) << r.message;
  cudaFree(out);
}

TEST(CudaEmulator, BadLaunchConfigurationsFailAtTheLaunch) {
  float* out = device_alloc<float>(2048);
  LaunchResult r = launch_and_capture([&] { big_shared_kernel<float><<<1, 2048>>>(out); });
  EXPECT_EQ(r.error, cudaErrorInvalidConfiguration);
  EXPECT_NE(r.message.find("not 1 to 1024 threads"), std::string::npos) << r.message;
  r = launch_and_capture([&] { big_shared_kernel<float><<<dim3(1, 70000), 32>>>(out); });
  EXPECT_EQ(r.error, cudaErrorInvalidConfiguration);
  cudaStream_t gone = nullptr;
  cudaStreamCreate(&gone);
  cudaStreamDestroy(gone);
  r = launch_and_capture([&] { big_shared_kernel<float><<<1, 32, 0, gone>>>(out); });
  EXPECT_EQ(r.error, cudaErrorInvalidConfiguration);
  EXPECT_NE(r.message.find("does not exist"), std::string::npos) << r.message;
  cudaFree(out);
}

// Note [cuda-emu-resources]: a block needing more registers than an SM has, or more threads than
// the kernel's __launch_bounds__, is refused as a GPU refuses it; a kernel of the backend missing
// from ptxas's tables is a launch error rather than an unchecked launch.
TEST(CudaEmulator, LaunchesAreHeldToPtxasRegistersAndLaunchBounds) {
  float* out = device_alloc<float>(1024);
  keel_emu::set_kernel_resources("emu_test", "register_heavy_kernel", 128, 0);
  register_heavy_kernel<<<1, 512>>>(out);  // 16 warps x 4096 registers: the whole SM
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(to_host(out, 512)[511], 1.0f);
  LaunchResult r = launch_and_capture([&] { register_heavy_kernel<<<1, 544>>>(out); });
  EXPECT_EQ(r.error, cudaErrorLaunchOutOfResources);
  EXPECT_NE(r.message.find("544 threads per block at 128 registers each (ptxas, sm_90) need 69632 "
                           "registers, above the 65536 of an SM"),
            std::string::npos)
      << r.message;

  keel_emu::set_kernel_resources("emu_test", "bounded_kernel", 32, 256);
  bounded_kernel<<<2, 256>>>(out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  r = launch_and_capture([&] { bounded_kernel<<<1, 288>>>(out); });
  EXPECT_EQ(r.error, cudaErrorLaunchOutOfResources);
  EXPECT_NE(r.message.find("288 threads per block, above the kernel's __launch_bounds__ of 256"),
            std::string::npos)
      << r.message;

  // A kernel of framework/kernels/cuda/ that ptxas's tables do not have.
  const keel_emu::LaunchConfig cfg{
      "missing_kernel", "/src/framework/kernels/cuda/missing.cu", nullptr, dim3(1), dim3(32), 0,
      nullptr};
  r = launch_and_capture([&] {
    keel_emu::run_grid(
        cfg, [](const void*) {}, nullptr);
  });
  EXPECT_EQ(r.error, cudaErrorLaunchOutOfResources);
  EXPECT_NE(r.message.find("no ptxas resources for missing_kernel of missing.cu"),
            std::string::npos)
      << r.message;
  cudaFree(out);
}

TEST(CudaEmulator, SharedMemoryAbove48KiBNeedsTheOptIn) {
  float* out = device_alloc<float>(32);
  const size_t bytes = 64 << 10;
  LaunchResult r = launch_and_capture([&] { big_shared_kernel<float><<<1, 32, bytes>>>(out); });
  EXPECT_EQ(r.error, cudaErrorInvalidConfiguration);
  EXPECT_NE(r.message.find("cudaFuncAttributeMaxDynamicSharedMemorySize"), std::string::npos)
      << r.message;
  ASSERT_EQ(
      cudaFuncSetAttribute(big_shared_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes)),
      cudaSuccess);
  big_shared_kernel<float><<<1, 32, bytes>>>(out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(to_host(out, 32)[31], 1.0f);
  // Above what an sm_90 block can have, even with the opt-in.
  r = launch_and_capture([&] {
    cudaFuncSetAttribute(big_shared_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         300 << 10);
  });
  EXPECT_EQ(r.error, cudaErrorInvalidValue);
  cudaFree(out);
}

TEST(CudaEmulator, StaticSharedMemoryStartsEveryBlockAsNaN) {
  float* out = device_alloc<float>(3);
  uninitialised_static_shared_kernel<<<3, 32>>>(out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (float v : to_host(out, 3)) EXPECT_TRUE(std::isnan(v));
  cudaFree(out);
}

TEST(CudaEmulator, UnwrittenMemoryReadsAsNaN) {
  float* in = device_alloc<float>(16);
  float* out = device_alloc<float>(32);
  read_kernel<<<1, 1>>>(in, out, 3);
  shared_poison_kernel<<<1, 32, 32 * sizeof(float)>>>(out + 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> h = to_host(out, 32);
  for (float v : h) EXPECT_TRUE(std::isnan(v));
  cudaFree(in);
  cudaFree(out);
}

TEST(CudaEmulatorDeathTest, ReadingPastAnAllocationFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float* in = device_alloc<float>(1024);  // 4 KiB: its end is the protected page
  float* out = device_alloc<float>(1);
  read_kernel<<<1, 1>>>(in, out, 1023);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_DEATH(
      {
        read_kernel<<<1, 1>>>(in, out, 1024);
        cudaDeviceSynchronize();
      },
      "");
  cudaFree(in);
  EXPECT_DEATH(
      {
        read_kernel<<<1, 1>>>(in, out, 0);  // after cudaFree
        cudaDeviceSynchronize();
      },
      "");
  cudaFree(out);
}

TEST(CudaEmulatorDeathTest, WritingPastDynamicSharedMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float* out = device_alloc<float>(64);
  // 64 threads write s[threadIdx.x] into 16 floats of dynamic shared memory.
  EXPECT_DEATH(
      {
        racy_kernel<<<1, 64, 16 * sizeof(float)>>>(out);
        cudaDeviceSynchronize();
      },
      "");
  cudaFree(out);
}

TEST(CudaEmulator, ABlockTheCachingAllocatorHandsOutAgainReadsAsNaN) {
  keel::kernels::cuda::Allocator alloc(0);
  auto* p = static_cast<float*>(alloc.allocate(4096));
  cudaMemset(p, 0, 4096);
  alloc.deallocate(p);
  auto* q = static_cast<float*>(alloc.allocate(4096));
  ASSERT_EQ(q, p) << "the cache did not hand the block out again";
  for (float v : to_host(q, 1024)) EXPECT_TRUE(std::isnan(v));
  alloc.deallocate(q);
}

// ---- deferred execution (Note [cuda-emu-deferred] in emu.h) ----

// A host read of a pinned buffer an async copy fills, without the synchronisation: the copy has
// not run. The synchronisation, or a query (a GPU progresses on its own), runs it.
TEST(CudaEmulatorDeferred, AHostReadWithoutItsSynchronisationSeesTheOldValue) {
  const Deferred deferred;
  const Streams streams(1);
  cudaStream_t s = streams[0];
  float* d = device_alloc<float>(64);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 64 * sizeof(float)), cudaSuccess);
  for (int i = 0; i < 64; ++i) pinned[i] = -1.0f;
  fill_kernel<<<1, 64, 0, s>>>(d, 2.0f, 64);
  cudaMemcpyAsync(pinned, d, 64 * sizeof(float), cudaMemcpyDeviceToHost, s);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(pinned[63], -1.0f) << "the copy ran before anything waited for it";
  cudaEvent_t e = nullptr;
  cudaEventCreate(&e);
  cudaEventRecord(e, s);
  EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
  EXPECT_EQ(pinned[63], 2.0f);

  fill_kernel<<<1, 64, 0, s>>>(d, 3.0f, 64);
  cudaMemcpyAsync(pinned, d, 64 * sizeof(float), cudaMemcpyDeviceToHost, s);
  EXPECT_EQ(pinned[0], 2.0f);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(pinned[0], 3.0f);
  cudaEventDestroy(e);
  cudaFreeHost(pinned);
  cudaFree(d);
}

// An async copy reads its source when it runs, so a host write into a staging buffer before the
// copy's synchronisation lands in the copy.
TEST(CudaEmulatorDeferred, AnAsyncCopyReadsItsHostSourceWhenItRuns) {
  const Deferred deferred;
  float* d = device_alloc<float>(1);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(float)), cudaSuccess);
  *pinned = 1.0f;
  cudaMemcpyAsync(d, pinned, sizeof(float), cudaMemcpyHostToDevice, nullptr);
  *pinned = 7.0f;  // the bug: the staging buffer is reused before the copy is known to be done
  EXPECT_EQ(to_host(d, 1)[0], 7.0f);
  cudaFreeHost(pinned);
  cudaFree(d);
}

// A stream that uses another stream's result without waiting on an event recorded after it reads
// what was there before; with the wait, the other stream's work runs first.
TEST(CudaEmulatorDeferred, AStreamThatSkipsTheEventWaitReadsStaleData) {
  const Deferred deferred;
  const Streams streams(2);
  cudaStream_t a = streams[0], b = streams[1];
  float* x = device_alloc<float>(32);
  float* y = device_alloc<float>(32);
  fill_kernel<<<1, 32, 0, a>>>(x, 3.0f, 32);
  add_one_kernel<<<1, 32, 0, b>>>(x, y, 32);  // no cudaStreamWaitEvent
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  EXPECT_TRUE(std::isnan(to_host(y, 32)[0]));

  cudaEvent_t e = nullptr;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  fill_kernel<<<1, 32, 0, a>>>(x, 5.0f, 32);
  cudaEventRecord(e, a);
  fill_kernel<<<1, 32, 0, a>>>(x, 9.0f, 32);  // after the record: b must not wait for it
  cudaStreamWaitEvent(b, e, 0);
  add_one_kernel<<<1, 32, 0, b>>>(x, y, 32);
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  float yb = 0.0f;
  std::memcpy(&yb, y, sizeof(float));  // emulated device memory is host memory
  EXPECT_EQ(yb, 6.0f);
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  EXPECT_EQ(to_host(x, 32)[31], 9.0f);
  cudaEventDestroy(e);
  cudaFree(x);
  cudaFree(y);
}

// The caching allocator's blocks are ordered on its stream (Note [cuda-stream-order] in device.h):
// a block another stream still reads must be synchronised before it is freed, or the new owner's
// work (here the reuse poison) overtakes the read.
TEST(CudaEmulatorDeferred, ABlockFreedWhileAnotherStreamReadsItIsPoisonedFirst) {
  const Deferred deferred;
  const Streams streams(2);
  cudaStream_t compute = streams[0], comm = streams[1];
  keel::kernels::cuda::Allocator alloc(0, compute);
  float* out = device_alloc<float>(1024);
  for (const bool synchronise_first : {false, true}) {
    auto* p = static_cast<float*>(alloc.allocate(4096));
    fill_kernel<<<4, 256, 0, compute>>>(p, 1.0f, 1024);
    cudaEvent_t e = nullptr;
    cudaEventCreate(&e);
    cudaEventRecord(e, compute);
    cudaStreamWaitEvent(comm, e, 0);
    add_one_kernel<<<4, 256, 0, comm>>>(p, out, 1024);  // the other stream reads the block
    if (synchronise_first) cudaStreamSynchronize(comm);
    alloc.deallocate(p);
    auto* q = static_cast<float*>(alloc.allocate(4096));
    ASSERT_EQ(q, p);
    ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(comm), cudaSuccess);
    const float v = to_host(out, 1024)[1023];
    if (synchronise_first) {
      EXPECT_EQ(v, 2.0f);
    } else {
      EXPECT_TRUE(std::isnan(v)) << v;
    }
    alloc.deallocate(q);
    cudaEventDestroy(e);
  }
  cudaFree(out);
}

// A deferred kernel's fault is not the launch's error: the synchronisation that runs it reports
// it, as a GPU reports a kernel's fault at the next synchronisation.
TEST(CudaEmulatorDeferred, AFaultIsReportedByTheSynchronisationThatRunsIt) {
  const Deferred deferred;
  float* out = device_alloc<float>(32);
  ::testing::internal::CaptureStderr();
  deadlock_kernel<<<1, 32>>>(out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("kernel deadlock_kernel"),
            std::string::npos);
  cudaGetLastError();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // reported once
  cudaFree(out);
}

TEST(CudaEmulator, CublasLtRejectsALeadingDimensionShorterThanAColumn) {
  cublasLtMatrixLayout_t layout = nullptr;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 8, 4, 4), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("ld=4 < rows=8"), std::string::npos);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 8, 4, 8), CUBLAS_STATUS_SUCCESS);
  cublasLtMatrixLayoutDestroy(layout);
}

}  // namespace
