// The CUDA backend's host side where no GPU is needed: the checked-call layer's messages, the
// allocator's size classes, and that a machine without a GPU or driver reports none and refuses
// a context with an error naming the failed call (so AUTO falls back to the CPU). Built
// everywhere; skips when keel was built without CUDA. The kernels' tests are tests/gpu/.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "framework/error.h"
#if KEEL_HAVE_CUDA
#include "framework/kernels/cuda/device.h"
#endif

namespace keel {
namespace {

#if KEEL_HAVE_CUDA
namespace cuda = kernels::cuda;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(CudaBackend, ErrorMessagesNameTheCallStatusAndShapes) {
  // cudaErrorMemoryAllocation = 2
  const std::string m = cuda::cuda_error_message(2, "cudaMalloc", "bytes=1024");
  EXPECT_TRUE(contains(m, "cudaMalloc failed")) << m;
  EXPECT_TRUE(contains(m, "cudaErrorMemoryAllocation")) << m;
  EXPECT_TRUE(contains(m, "[bytes=1024]")) << m;
  // CUBLAS_STATUS_NOT_SUPPORTED = 15
  const std::string b = cuda::cublas_error_message(15, "cublasLtMatmul", "gemm NT M=8 N=4 K=2");
  EXPECT_TRUE(contains(b, "cublasLtMatmul failed")) << b;
  EXPECT_TRUE(contains(b, "CUBLAS_STATUS_NOT_SUPPORTED")) << b;
  EXPECT_TRUE(contains(b, "gemm NT M=8 N=4 K=2")) << b;
}

TEST(CudaBackend, AllocatorSizeClasses) {
  EXPECT_EQ(cuda::Allocator::bucket_size(1), 512u);
  EXPECT_EQ(cuda::Allocator::bucket_size(512), 512u);
  EXPECT_EQ(cuda::Allocator::bucket_size(513), 640u);
  EXPECT_EQ(cuda::Allocator::bucket_size(1000), 1024u);
  EXPECT_EQ(cuda::Allocator::bucket_size((1u << 20) + 1), (1u << 20) + (1u << 18));
  size_t prev = 0;
  for (size_t n = 1; n < (size_t{1} << 26); n = n * 9 / 8 + 1) {
    const size_t b = cuda::Allocator::bucket_size(n);
    EXPECT_GE(b, n);
    EXPECT_LE(b, std::max<size_t>(512, n + n / 4)) << n;  // at most 25% waste past 512 bytes
    EXPECT_EQ(cuda::Allocator::bucket_size(b), b) << n;   // a class is its own class
    EXPECT_GE(b, prev) << n;                              // monotone
    prev = b;
  }
}

TEST(CudaBackend, WithoutAGpuNoDeviceAndContextFailsNamingTheCall) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present (tests/gpu covers it)";
  EXPECT_EQ(cuda::device_count(), 0);
  try {
    cuda::Context ctx(0);
    FAIL() << "a context was made without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_TRUE(contains(e.what(), "cudaSetDevice")) << e.what();
  }
  // Asking twice gives the same answer (the failed query leaves no state behind).
  EXPECT_EQ(cuda::device_count(), 0);
}
#else
TEST(CudaBackend, Disabled) { GTEST_SKIP() << "built without CUDA (KEEL_CUDA=OFF or no nvcc)"; }
#endif

}  // namespace
}  // namespace keel
