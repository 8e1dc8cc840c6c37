// CUDA token and position embeddings (framework/kernels/embedding.h).
//
// The token gradient is a scatter-add with repeated rows. Atomics would make it depend on thread
// timing; instead the (row, n) pairs are sorted by row with CUB's stable radix sort, and each
// (row, channel) is summed by one thread over its tokens in increasing n, starting from the
// existing gradient: the CPU kernel's exact order, so the two agree bit for bit.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include "framework/error.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/common.cuh"
#include "framework/kernels/cuda/internal.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, int64_t N, const T* wte,
                                         int64_t v_begin, int64_t V_local, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * C;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
    out[i] = (row >= 0 && row < V_local) ? wte[row * C + c] : from_f<T>(0.0f);
  }
}

// keys[n] = this rank's row of token n, or V_local (sorted last, skipped) when not held here.
__global__ void embedding_keys_kernel(const int32_t* tokens, int64_t N, int64_t v_begin,
                                      int64_t V_local, int32_t* keys, int32_t* positions) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n >= N) return;
  const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
  keys[n] = (row >= 0 && row < V_local) ? static_cast<int32_t>(row) : static_cast<int32_t>(V_local);
  positions[n] = static_cast<int32_t>(n);
}

// Block (i, channel chunk): when sorted entry i starts a run of equal rows, sum the run in order.
template <typename T>
__global__ void embedding_backward_kernel(float* dwte, const T* dout, const int32_t* keys,
                                          const int32_t* positions, int64_t N, int64_t V_local,
                                          int64_t C) {
  const int64_t i = blockIdx.x;
  const int64_t c = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int32_t key = keys[i];
  if (key >= V_local || (i > 0 && keys[i - 1] == key)) return;
  float acc = dwte[key * C + c];
  for (int64_t j = i; j < N && keys[j] == key; ++j) acc += to_f(dout[positions[j] * C + c]);
  dwte[key * C + c] = acc;
}

template <typename T>
__global__ void position_forward_kernel(T* out, const T* wpe, int64_t BT, int64_t T_, int64_t C) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < BT * C;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t bt = i / C, c = i % C;
    out[i] = from_f<T>(to_f(out[i]) + to_f(wpe[(bt % T_) * C + c]));
  }
}

// dwpe[t, c] += sum_b dout[b, t, c], b in increasing order (the CPU's order).
template <typename T>
__global__ void position_backward_kernel(float* dwpe, const T* dout, int64_t B, int64_t T_,
                                         int64_t C) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < T_ * C;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / C, c = i % C;
    float acc = dwpe[i];
    for (int64_t b = 0; b < B; ++b) acc += to_f(dout[(b * T_ + t) * C + c]);
    dwpe[i] = acc;
  }
}

void check_embedding(int64_t N, int64_t V_local, int64_t C, const char* name) {
  KEEL_CHECK(N >= 0 && V_local >= 0 && C >= 0, kUsage, "cuda ", name, ": bad shape N=", N,
             " V_local=", V_local, " C=", C);
  KEEL_CHECK(N < 0x7fffffff && V_local < 0x7fffffff, kUsage, "cuda ", name, ": N=", N,
             " or V_local=", V_local, " exceeds the int32 sort keys");
}

template <typename T>
void embedding_forward_impl(Context& ctx, T* out, const int32_t* tokens, int64_t N, const T* wte,
                            int64_t v_begin, int64_t V_local, int64_t C) {
  check_embedding(N, V_local, C, "embedding_forward");
  if (N == 0 || C == 0) return;
  embedding_forward_kernel<<<grid_for(N * C, kThreads), kThreads, 0, ctx.stream()>>>(
      out, tokens, N, wte, v_begin, V_local, C);
  KEEL_CUDA_LAUNCH_CHECK("embedding_forward", "N=", N, " V_local=", V_local, " C=", C);
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

template <typename T>
void embedding_backward_impl(Context& ctx, float* dwte, const T* dout, const int32_t* tokens,
                             int64_t N, int64_t v_begin, int64_t V_local, int64_t C) {
  check_embedding(N, V_local, C, "embedding_backward");
  if (N == 0 || C == 0) return;
  const int n = static_cast<int>(N);
  int end_bit = 1;  // keys are in [0, V_local]
  while (end_bit < 31 && (int64_t{1} << end_bit) <= V_local) ++end_bit;
  size_t sort_bytes = 0;
  KEEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
                      nullptr, sort_bytes, static_cast<int32_t*>(nullptr),
                      static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                      static_cast<int32_t*>(nullptr), n, 0, end_bit, ctx.stream()),
                  "embedding_backward sort size N=", N);
  const size_t arr = align_up(sizeof(int32_t) * N);
  auto* base = static_cast<char*>(ctx.scratch(4 * arr + align_up(sort_bytes)));
  auto* keys_in = reinterpret_cast<int32_t*>(base);
  auto* pos_in = reinterpret_cast<int32_t*>(base + arr);
  auto* keys = reinterpret_cast<int32_t*>(base + 2 * arr);
  auto* pos = reinterpret_cast<int32_t*>(base + 3 * arr);
  void* sort_tmp = base + 4 * arr;
  embedding_keys_kernel<<<grid_for(N, kThreads, int64_t{1} << 30), kThreads, 0, ctx.stream()>>>(
      tokens, N, v_begin, V_local, keys_in, pos_in);
  KEEL_CUDA_LAUNCH_CHECK("embedding_keys", "N=", N, " V_local=", V_local);
  KEEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, keys_in, keys, pos_in, pos,
                                                  n, 0, end_bit, ctx.stream()),
                  "embedding_backward sort N=", N, " V_local=", V_local);
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((C + kThreads - 1) / kThreads));
  embedding_backward_kernel<<<grid, kThreads, 0, ctx.stream()>>>(dwte, dout, keys, pos, N, V_local,
                                                                 C);
  KEEL_CUDA_LAUNCH_CHECK("embedding_backward", "N=", N, " V_local=", V_local, " C=", C);
}

template <typename T>
void position_forward_impl(Context& ctx, T* out, const T* wpe, int64_t B, int64_t T_, int64_t C) {
  KEEL_CHECK(B >= 0 && T_ >= 0 && C >= 0, kUsage, "cuda position_forward: bad shape B=", B,
             " T=", T_, " C=", C);
  if (B * T_ * C == 0) return;
  position_forward_kernel<<<grid_for(B * T_ * C, kThreads), kThreads, 0, ctx.stream()>>>(
      out, wpe, B * T_, T_, C);
  KEEL_CUDA_LAUNCH_CHECK("position_forward", "B=", B, " T=", T_, " C=", C);
}

template <typename T>
void position_backward_impl(Context& ctx, float* dwpe, const T* dout, int64_t B, int64_t T_,
                            int64_t C) {
  KEEL_CHECK(B >= 0 && T_ >= 0 && C >= 0, kUsage, "cuda position_backward: bad shape B=", B,
             " T=", T_, " C=", C);
  if (T_ * C == 0) return;
  position_backward_kernel<<<grid_for(T_ * C, kThreads), kThreads, 0, ctx.stream()>>>(dwpe, dout, B,
                                                                                      T_, C);
  KEEL_CUDA_LAUNCH_CHECK("position_backward", "B=", B, " T=", T_, " C=", C);
}

}  // namespace

void embedding_forward(Context& ctx, float* out, const int32_t* tokens, int64_t N, const float* wte,
                       int64_t v_begin, int64_t V_local, int64_t C) {
  embedding_forward_impl(ctx, out, tokens, N, wte, v_begin, V_local, C);
}
void embedding_forward(Context& ctx, Bf16* out, const int32_t* tokens, int64_t N, const Bf16* wte,
                       int64_t v_begin, int64_t V_local, int64_t C) {
  embedding_forward_impl(ctx, dev(out), tokens, N, dev(wte), v_begin, V_local, C);
}
void embedding_backward(Context& ctx, float* dwte, const float* dout, const int32_t* tokens,
                        int64_t N, int64_t v_begin, int64_t V_local, int64_t C) {
  embedding_backward_impl(ctx, dwte, dout, tokens, N, v_begin, V_local, C);
}
void embedding_backward(Context& ctx, float* dwte, const Bf16* dout, const int32_t* tokens,
                        int64_t N, int64_t v_begin, int64_t V_local, int64_t C) {
  embedding_backward_impl(ctx, dwte, dev(dout), tokens, N, v_begin, V_local, C);
}
void position_forward(Context& ctx, float* out, const float* wpe, int64_t B, int64_t T, int64_t C) {
  position_forward_impl(ctx, out, wpe, B, T, C);
}
void position_forward(Context& ctx, Bf16* out, const Bf16* wpe, int64_t B, int64_t T, int64_t C) {
  position_forward_impl(ctx, dev(out), dev(wpe), B, T, C);
}
void position_backward(Context& ctx, float* dwpe, const float* dout, int64_t B, int64_t T,
                       int64_t C) {
  position_backward_impl(ctx, dwpe, dout, B, T, C);
}
void position_backward(Context& ctx, float* dwpe, const Bf16* dout, int64_t B, int64_t T,
                       int64_t C) {
  position_backward_impl(ctx, dwpe, dev(dout), B, T, C);
}

}  // namespace keel::kernels::cuda
