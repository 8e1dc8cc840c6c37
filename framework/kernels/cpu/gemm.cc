// CPU GEMM through the OpenMP build of OpenBLAS. Called outside an OpenMP region it uses the
// whole thread pool; inside one (per-head attention) OpenBLAS runs single-threaded per call.
#include "framework/kernels/gemm.h"

#include <cblas.h>
#include <strings.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace keel::kernels {

namespace {
inline CBLAS_TRANSPOSE tr(bool t) { return t ? CblasTrans : CblasNoTrans; }
}  // namespace

template <>
void gemm<float>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                  int64_t lda, const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, tr(ta), tr(tb), M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <typename T>
void column_sum_add(T* out, const T* x, int64_t N, int64_t C, int64_t ld) {
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* row = x + n * ld;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += row[c];
    }
    for (int64_t c = c0; c < c1; ++c) out[c] += acc[c - c0];
  }
}

template <typename T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int64_t IC,
                    int64_t OC) {
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::copy(bias, bias + OC, out + n * OC);
  }
  gemm<T>(false, true, N, OC, IC, T(1), inp, IC, weight, IC, bias ? T(1) : T(0), out, OC);
}

template <typename T>
void linear_backward(T* dinp, bool accumulate_dinp, T* dweight, T* dbias, const T* dout,
                     const T* inp, const T* weight, int64_t N, int64_t IC, int64_t OC) {
  if (dinp) {
    gemm<T>(false, false, N, IC, OC, T(1), dout, OC, weight, IC, accumulate_dinp ? T(1) : T(0),
            dinp, IC);
  }
  if (dweight) gemm<T>(true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dweight, IC);
  if (dbias) column_sum_add<T>(dbias, dout, N, OC, OC);
}

#define KEEL_INSTANTIATE(T)                                                                     \
  template void column_sum_add<T>(T*, const T*, int64_t, int64_t, int64_t);                     \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t); \
  template void linear_backward<T>(T*, bool, T*, T*, const T*, const T*, const T*, int64_t,     \
                                   int64_t, int64_t);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels

#include <omp.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace keel::kernels {
bool set_flush_denormals(bool on) {
#if defined(__SSE__)
  constexpr unsigned kFtzDaz = 0x8040;  // MXCSR bits 15 (flush to zero) and 6 (denormals are zero)
  const auto apply = [on] {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(on ? (csr | kFtzDaz) : (csr & ~kFtzDaz));
  };
  apply();
#pragma omp parallel
  apply();
  return true;
#else
  (void)on;
  return false;
#endif
}

void set_num_threads(int n) {
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}
int num_threads() { return omp_get_max_threads(); }
void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) {
  if (n > 0) std::memcpy(dst, host_src, static_cast<size_t>(n) * sizeof(int32_t));
}
std::string blas_kernel_warning() {
  const char* core = openblas_get_corename();
  const std::string name = core != nullptr ? core : "";
  if (name.empty() || strcasecmp(name.c_str(), "prescott") != 0) return "";
#if defined(__x86_64__)
  const char* fix = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                    : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                      : nullptr;
  if (fix == nullptr) return "";  // an SSE3-class CPU: Prescott is the right choice
  return std::string("OpenBLAS chose its generic Prescott kernels for this CPU (sgemm several ") +
         "times slower than it can be): set OPENBLAS_CORETYPE=" + fix +
         " in the job's environment (mpirun -x OPENBLAS_CORETYPE=" + fix + ")";
#else
  return "";
#endif
}

int max_threads() {
  const char* config = openblas_get_config();
  const char* at = config != nullptr ? std::strstr(config, "MAX_THREADS=") : nullptr;
  return at != nullptr ? std::atoi(at + std::strlen("MAX_THREADS=")) : 0;
}
}  // namespace keel::kernels
