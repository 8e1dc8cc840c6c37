// Shared pieces of the CUDA backend tests: a fixture that skips (with the reason) where there is
// no GPU, random inputs, NaN-poisoned device outputs, and comparisons with stated error bounds.
//
// Error bounds. |gpu - cpu| <= rtol * (|cpu| + rms(cpu)): relative to each element, with a floor
// at the array's typical magnitude so elements that cancel to near zero are not held to a
// relative bound their inputs cannot give. rtol per dtype and reduction length K:
//   fp32: 1e-5 * max(1, sqrt(K / 1024))  (two fp32 summation orders differ by ~eps * sqrt(K))
//   bf16 outputs: 1e-2                    (one bf16 rounding is 2^-9 = 0.2% relative)
//   bf16 inputs, fp32 accumulation and output: 1e-4 * max(1, sqrt(K / 1024)) (tensor cores)
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"

namespace keel::gpu_test {

namespace cuda = kernels::cuda;

inline double f32_rtol(int64_t K) {
  return 1e-5 * std::max(1.0, std::sqrt(static_cast<double>(K) / 1024.0));
}
constexpr double kBf16Rtol = 1e-2;
inline double bf16_in_f32_out_rtol(int64_t K) {
  return 1e-4 * std::max(1.0, std::sqrt(static_cast<double>(K) / 1024.0));
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
    }
    ctx_ = std::make_unique<cuda::Context>(0);
  }
  cuda::Context& ctx() { return *ctx_; }

  // A device buffer of n elements of T filled with NaN (0xFF bytes), so an element the kernel
  // should write but does not fails the comparison.
  template <typename T>
  cuda::DeviceBuffer poisoned(size_t n) {
    cuda::DeviceBuffer b = ctx_->alloc(n * sizeof(T));
    ctx_->fill_bytes(b.data(), 0xFF, n * sizeof(T));
    return b;
  }
  template <typename T>
  std::vector<T> get(const cuda::DeviceBuffer& b, size_t n) {
    return cuda::download<T>(*ctx_, b.data(), n);
  }

 private:
  std::unique_ptr<cuda::Context> ctx_;
};

// Uniform in [lo, hi), away from zero by construction of the range when lo > 0; a fixed seed.
inline std::vector<float> random_vec(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = dist(gen);
    } while (x == 0.0f);  // never an exact zero (a zero input hides a missing term)
  }
  return v;
}

inline std::vector<Bf16> to_bf16(const std::vector<float>& v) {
  std::vector<Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = keel::to_bf16(v[i]);
  return out;
}
inline std::vector<float> from_bf16(const std::vector<Bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = keel::from_bf16(v[i]);
  return out;
}
// Values rounded to bf16 and back: the inputs a bf16 kernel sees, for the fp32 CPU reference.
inline std::vector<float> bf16_rounded(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

// gpu vs cpu reference with the bound in the file comment; reports the count of failures and the
// first few with their indices. NaN (an unwritten, poisoned element) always fails.
inline ::testing::AssertionResult matches(const std::vector<float>& gpu,
                                          const std::vector<float>& cpu, double rtol) {
  if (gpu.size() != cpu.size()) {
    return ::testing::AssertionFailure() << "size " << gpu.size() << " != " << cpu.size();
  }
  double ss = 0.0;
  for (float r : cpu) ss += static_cast<double>(r) * r;
  const double rms = cpu.empty() ? 0.0 : std::sqrt(ss / static_cast<double>(cpu.size()));
  size_t bad = 0;
  double worst = 0.0;
  std::ostringstream first;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double g = gpu[i], r = cpu[i];
    const double bound = rtol * (std::abs(r) + rms);
    const double err = std::abs(g - r);
    if (!(err <= bound)) {
      if (bad < 5) first << " [" << i << "] gpu=" << g << " cpu=" << r;
      ++bad;
    }
    if (std::isfinite(err) && bound > 0) worst = std::max(worst, err / bound);
  }
  if (bad > 0) {
    return ::testing::AssertionFailure() << bad << " of " << cpu.size() << " elements outside rtol "
                                         << rtol << " (rms " << rms << "):" << first.str();
  }
  return ::testing::AssertionSuccess() << "worst error " << worst << " of the bound";
}

inline ::testing::AssertionResult identical(const std::vector<float>& gpu,
                                            const std::vector<float>& cpu) {
  return matches(gpu, cpu, 0.0);
}

}  // namespace keel::gpu_test
