// Dense matrix products: the one place BLAS is called (OpenBLAS sgemm/dgemm on CPU; cuBLASLt in
// the CUDA backend). Row-major throughout. T is float or double (double for gradient checks).
#pragma once

#include <cstdint>
#include <string>

namespace keel::kernels {

// C[M, N] = alpha * op(A) @ op(B) + beta * C, row-major; op(X) = X or X^T.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Linear layer (weights stored [out, in] as in PyTorch and llm.c).
// forward:  out[N, OC] = inp[N, IC] @ weight[OC, IC]^T + bias[OC]   (=; bias may be null)
template <typename T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int64_t N, int64_t IC,
                    int64_t OC);

// backward: dinp[N, IC] (= or += per accumulate_dinp; skipped when null) = dout @ weight
//           dweight[OC, IC] += dout^T @ inp;  dbias[OC] += column sums of dout (skipped if null)
template <typename T>
void linear_backward(T* dinp, bool accumulate_dinp, T* dweight, T* dbias, const T* dout,
                     const T* inp, const T* weight, int64_t N, int64_t IC, int64_t OC);

// out[c] += sum_n x[n * ld + c] for c < C; fixed summation order (deterministic).
template <typename T>
void column_sum_add(T* out, const T* x, int64_t N, int64_t C, int64_t ld);

}  // namespace keel::kernels

namespace keel::kernels {
// Threads used by BLAS and the OpenMP kernels of this process (one shared OpenMP pool).
void set_num_threads(int n);
int num_threads();
// The most threads the BLAS can serve at once (OpenBLAS sizes its buffer pool for MAX_THREADS
// concurrent callers when it is built; keel's per-head attention calls sgemm from every OpenMP
// thread, and past that limit OpenBLAS spins or aborts). 0 when the library does not say.
int max_threads();
// Flush-to-zero and denormals-are-zero (x86 MXCSR) on the calling thread and every thread of the
// OpenMP pool (which BLAS shares; threads created later inherit the mode). Arithmetic on
// denormal floats takes a slow microcode path on x86, and a saturated softmax (exactly what an
// unstable run produces) fills attention's probabilities and their gradients with them. false:
// IEEE denormals again. Returns false, changing nothing, on CPUs without these modes.
bool set_flush_denormals(bool on);
// "" when the BLAS picked kernels that suit this CPU; otherwise one line saying what it picked and
// the OPENBLAS_CORETYPE that fixes it. OpenBLAS older than the CPU falls back to its generic SSE3
// "Prescott" kernels, about 4.7x slower for sgemm on an AVX-512 Xeon (docs/performance.md, "BLAS
// and threads").
std::string blas_kernel_warning();
// dst[n] (=) = host_src[n]: the batch's token ids (or targets) from the host into the model's
// buffer. On the CPU a memcpy; the CUDA form (cuda/ops.h) is a host-to-device copy on the stream.
void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n);
}  // namespace keel::kernels
