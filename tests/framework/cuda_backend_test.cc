// CUDA backend against the CPU backend. Built everywhere; skips when keel was built without CUDA
// or when no GPU is present (the CPU-only development machines), runs on a GPU machine.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "framework/kernels/elementwise.h"
#if KEEL_HAVE_CUDA
#include "framework/kernels/cuda/device.h"
#endif

namespace keel {
namespace {

TEST(CudaBackend, GeluMatchesCpu) {
#if !KEEL_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (KEEL_CUDA=OFF or no nvcc)";
#else
  if (kernels::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 10000;
  std::vector<float> in(n), dout(n), out(n), dinp(n), ref(n), dref(n);
  for (int64_t i = 0; i < n; ++i) {
    in[i] = static_cast<float>(i - n / 2) * 1e-3f;
    dout[i] = std::sin(static_cast<float>(i));
  }
  ASSERT_TRUE(kernels::cuda::gelu_roundtrip(in.data(), dout.data(), out.data(), dinp.data(), n))
      << kernels::cuda::last_error();
  kernels::gelu_forward(ref.data(), in.data(), n);
  kernels::gelu_backward(dref.data(), in.data(), dout.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(out[i], ref[i], 1e-6f + 1e-5f * std::abs(ref[i])) << i;
    EXPECT_NEAR(dinp[i], dref[i], 1e-6f + 1e-5f * std::abs(dref[i])) << i;
  }
#endif
}

}  // namespace
}  // namespace keel
