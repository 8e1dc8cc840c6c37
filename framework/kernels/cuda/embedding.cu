// CUDA token and position embeddings (framework/kernels/embedding.h).
//
// The token gradient is a scatter-add with repeated rows. Atomics would make it depend on thread
// timing; instead the (row, n) pairs are sorted by row with CUB's stable radix sort and summed in
// a fixed order, Note [embedding-backward-segments] below.
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

// The forward and position kernels step over packs of W elements of a row (Note [vector-access],
// internal.h): W = pack_width when C % W == 0 and the buffers are 16-byte aligned, else 1; pack k
// is row k / row_packs, 32-bit indices (the host checks the packs' count).
template <int W, typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte,
                                         int64_t v_begin, int64_t V_local, int row_packs,
                                         int packs) {
  for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < packs;
       k += static_cast<int>(gridDim.x * blockDim.x)) {
    const int n = k / row_packs, p = k - n * row_packs;
    const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
    Pack<T, W> v;
    if (row >= 0 && row < V_local) {
      v = reinterpret_cast<const Pack<T, W>*>(wte)[row * row_packs + p];
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) v.v[j] = from_f<T>(0.0f);
    }
    reinterpret_cast<Pack<T, W>*>(out)[k] = v;
  }
}

// keys[n] = this rank's row of token n, or V_local (sorted last, skipped) when not held here.
__global__ void embedding_keys_kernel(const int32_t* tokens, int N, int64_t v_begin,
                                      int64_t V_local, int32_t* keys, int32_t* positions) {
  const int n = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (n >= N) return;
  const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
  keys[n] = (row >= 0 && row < V_local) ? static_cast<int32_t>(row) : static_cast<int32_t>(V_local);
  positions[n] = n;
}

// ---- Note [embedding-backward-segments] ----
// After the sort, a token's rows are a run of equal keys (about 10^3 rows on real text, the whole
// batch for a repeated token), too long for one thread to sum. Each run is cut into segments of R
// rows from its start (R a power of two in [8, 64], a function of N and C alone: embedding_rows),
// and the sorted array into windows of R entries; a block of kEmbCols threads (one per column)
// takes a (window, column strip).
// - Pass 1 (embedding_backward_kernel): the block sums each segment that starts in its window, in
//   increasing sorted position (n increasing): a run's first segment from the existing dwte row,
//   written back to dwte; a later segment from 0 into partial[window, C]. A window holds at most
//   one later segment's start (two would need a run to end inside the window that began before
//   it, and another to begin there and already have run R rows), so the slot is unique.
// - Pass 2 (embedding_runs_kernel): for each run longer than R (at most one starts per window),
// dwte
//   row += its later segments' partials, one at a time in segment order.
// The order is a function of the tokens and R alone: bitwise reproducible run to run; a run of at
// most R rows is the CPU's exact order (dwte + row, + row, ...), a longer one differs from it only
// in the grouping of its fp32 additions (depth at most R + run / R, not run).
constexpr int kEmbCols = 64;

// Rows per segment and window: the smallest power of two in [8, 64] at which windows x strips
// comes to about an H200's resident blocks (132 SMs x 2048 threads / 256 = 1056; ctest
// cuda_emu.StepBudget's RowReductionsFillAnH200 holds the pass to 132 blocks).
int embedding_rows_log2(int64_t N, int64_t C) {
  const int64_t strips = (C + kEmbCols - 1) / kEmbCols;
  const int64_t want = (1056 + strips - 1) / strips;  // windows
  int log_rows = 3;
  while (log_rows < 6 && N > (want << log_rows)) ++log_rows;
  return log_rows;
}

template <typename T>
__global__ void embedding_backward_kernel(float* dwte, float* partial, const T* dout,
                                          const int32_t* keys, const int32_t* positions, int N,
                                          int V_local, int C, int log_rows) {
  const int R = 1 << log_rows;
  const int c = static_cast<int>(blockIdx.y) * kEmbCols + static_cast<int>(threadIdx.x);
  if (c >= C) return;
  const int w0 = static_cast<int>(blockIdx.x) << log_rows, w1 = w0 + R < N ? w0 + R : N;
  int key = keys[w0];
  if (key >= V_local) return;  // out-of-shard tokens sort last
  int start = 0;               // the run of keys[w0] starts at the lower bound of key in [0, w0]
  for (int hi = w0; start < hi;) {
    const int mid = start + (hi - start) / 2;
    if (keys[mid] < key) {
      start = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (int i = w0; i < w1;) {
    const int k = keys[i];
    if (k >= V_local) break;
    if (k != key) {
      key = k;
      start = i;
    }
    if (((i - start) & (R - 1)) != 0) {  // inside a segment that started in an earlier window
      ++i;
      continue;
    }
    const int64_t at = static_cast<int64_t>(key) * C + c;
    const int end = i + R < N ? i + R : N;
    float acc = i == start ? dwte[at] : 0.0f;
    int j = i;
    for (; j < end && keys[j] == key; ++j)
      acc += to_f(dout[static_cast<int64_t>(positions[j]) * C + c]);
    if (i == start) {
      dwte[at] = acc;
    } else {
      partial[static_cast<int64_t>(blockIdx.x) * C + c] = acc;
    }
    i = j;  // the next segment's start: a new run, or i + R (past this window)
  }
}

__global__ void embedding_runs_kernel(float* dwte, const float* partial, const int32_t* keys, int N,
                                      int V_local, int C, int log_rows) {
  const int R = 1 << log_rows;
  const int c = static_cast<int>(blockIdx.y) * kEmbCols + static_cast<int>(threadIdx.x);
  if (c >= C) return;
  const int w0 = static_cast<int>(blockIdx.x) << log_rows, w1 = w0 + R < N ? w0 + R : N;
  for (int i = w0; i < w1; ++i) {
    const int key = keys[i];
    if (key >= V_local) return;
    if ((i > 0 && keys[i - 1] == key) || i + R >= N || keys[i + R] != key) continue;
    const int64_t at = static_cast<int64_t>(key) * C + c;
    float acc = dwte[at];
    for (int h = i + R; h < N && keys[h] == key; h += R) {
      acc += partial[static_cast<int64_t>(h >> log_rows) * C + c];
    }
    dwte[at] = acc;
    return;  // a run longer than R covers the rest of the window
  }
}

template <int W, typename T>
__global__ void position_forward_kernel(T* out, const T* wpe, int T_, int row_packs, int packs) {
  for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < packs;
       k += static_cast<int>(gridDim.x * blockDim.x)) {
    const int bt = k / row_packs, p = k - bt * row_packs;
    Pack<T, W> o = reinterpret_cast<const Pack<T, W>*>(out)[k];
    const Pack<T, W> w = reinterpret_cast<const Pack<T, W>*>(wpe)[(bt % T_) * row_packs + p];
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(to_f(o.v[j]) + to_f(w.v[j]));
    reinterpret_cast<Pack<T, W>*>(out)[k] = o;
  }
}

// dwpe[t, c] += sum_b dout[b, t, c], b in increasing order (the CPU's order).
template <int W, typename T>
__global__ void position_backward_kernel(float* dwpe, const T* dout, int B, int packs) {
  for (int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); k < packs;
       k += static_cast<int>(gridDim.x * blockDim.x)) {
    Pack<float, W> acc = reinterpret_cast<const Pack<float, W>*>(dwpe)[k];
    for (int b = 0; b < B; ++b) {
      const Pack<T, W> d = reinterpret_cast<const Pack<T, W>*>(dout)[b * packs + k];
#pragma unroll
      for (int j = 0; j < W; ++j) acc.v[j] += to_f(d.v[j]);
    }
    reinterpret_cast<Pack<float, W>*>(dwpe)[k] = acc;
  }
}

void check_embedding(int64_t N, int64_t V_local, int64_t C, const char* name) {
  KEEL_CHECK(N >= 0 && V_local >= 0 && C >= 0, kUsage, "cuda ", name, ": bad shape N=", N,
             " V_local=", V_local, " C=", C);
  KEEL_CHECK(N < 0x7fffffff && V_local < 0x7fffffff, kUsage, "cuda ", name, ": N=", N,
             " or V_local=", V_local, " exceeds the int32 sort keys");
}

// The pack width for rows of C elements over these buffers: W when C % W == 0 and all are 16-byte
// aligned, else 1; and a check that the kernel's 32-bit pack indices hold `elements`.
template <int W, typename... T>
int row_pack_width(int64_t C, int64_t elements, const char* name, const T*... p) {
  const int w = C % W == 0 && aligned16(p...) ? W : 1;
  KEEL_CHECK(elements / w <= kMaxIndex32, kUsage, "cuda ", name, ": ", elements,
             " elements past the kernel's 32-bit indices (", kMaxIndex32, " packs of ", w, ")");
  return w;
}

template <typename T>
void embedding_forward_impl(Context& ctx, T* out, const int32_t* tokens, int64_t N, const T* wte,
                            int64_t v_begin, int64_t V_local, int64_t C) {
  check_embedding(N, V_local, C, "embedding_forward");
  if (N == 0 || C == 0) return;
  constexpr int W = pack_width<T>();
  const int w = row_pack_width<W>(C, N * C, "embedding_forward", out, wte);
  const int row_packs = static_cast<int>(C / w), packs = static_cast<int>(N * C / w);
  if (w == W) {
    embedding_forward_kernel<W, T><<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(
        out, tokens, wte, v_begin, V_local, row_packs, packs);
  } else {
    embedding_forward_kernel<1, T><<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(
        out, tokens, wte, v_begin, V_local, row_packs, packs);
  }
  KEEL_CUDA_LAUNCH_CHECK("embedding_forward", "N=", N, " V_local=", V_local, " C=", C);
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

template <typename T>
void embedding_backward_impl(Context& ctx, float* dwte, const T* dout, const int32_t* tokens,
                             int64_t N, int64_t v_begin, int64_t V_local, int64_t C) {
  check_embedding(N, V_local, C, "embedding_backward");
  if (N == 0 || C == 0) return;
  KEEL_CHECK(N <= kMaxIndex32 && C <= int64_t{65535} * kEmbCols, kUsage,
             "cuda embedding_backward: N=", N, " or C=", C,
             " past the kernel's 32-bit indices or grid (N <= ", kMaxIndex32,
             ", C <= ", int64_t{65535} * kEmbCols, ")");
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
  const int log_rows = embedding_rows_log2(N, C);
  const int64_t windows = (N + (int64_t{1} << log_rows) - 1) >> log_rows;
  const size_t partial_bytes = align_up(sizeof(float) * windows * C);
  auto* base = static_cast<char*>(ctx.scratch(4 * arr + partial_bytes + align_up(sort_bytes)));
  auto* keys_in = reinterpret_cast<int32_t*>(base);
  auto* pos_in = reinterpret_cast<int32_t*>(base + arr);
  auto* keys = reinterpret_cast<int32_t*>(base + 2 * arr);
  auto* pos = reinterpret_cast<int32_t*>(base + 3 * arr);
  auto* partial = reinterpret_cast<float*>(base + 4 * arr);  // [windows, C]
  void* sort_tmp = base + 4 * arr + partial_bytes;
  embedding_keys_kernel<<<grid_for(N, kThreads, int64_t{1} << 30), kThreads, 0, ctx.stream()>>>(
      tokens, n, v_begin, V_local, keys_in, pos_in);
  KEEL_CUDA_LAUNCH_CHECK("embedding_keys", "N=", N, " V_local=", V_local);
  KEEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, keys_in, keys, pos_in, pos,
                                                  n, 0, end_bit, ctx.stream()),
                  "embedding_backward sort N=", N, " V_local=", V_local);
  const dim3 grid(static_cast<unsigned>(windows),
                  static_cast<unsigned>((C + kEmbCols - 1) / kEmbCols));
  embedding_backward_kernel<<<grid, kEmbCols, 0, ctx.stream()>>>(
      dwte, partial, dout, keys, pos, n, static_cast<int>(V_local), static_cast<int>(C), log_rows);
  KEEL_CUDA_LAUNCH_CHECK("embedding_backward", "N=", N, " V_local=", V_local, " C=", C);
  if (windows == 1) return;  // no run is longer than R
  embedding_runs_kernel<<<grid, kEmbCols, 0, ctx.stream()>>>(
      dwte, partial, keys, n, static_cast<int>(V_local), static_cast<int>(C), log_rows);
  KEEL_CUDA_LAUNCH_CHECK("embedding_backward (runs)", "N=", N, " V_local=", V_local, " C=", C);
}

template <typename T>
void position_forward_impl(Context& ctx, T* out, const T* wpe, int64_t B, int64_t T_, int64_t C) {
  KEEL_CHECK(B >= 0 && T_ >= 0 && C >= 0, kUsage, "cuda position_forward: bad shape B=", B,
             " T=", T_, " C=", C);
  if (B * T_ * C == 0) return;
  constexpr int W = pack_width<T>();
  const int w = row_pack_width<W>(C, B * T_ * C, "position_forward", out, wpe);
  const int row_packs = static_cast<int>(C / w), packs = static_cast<int>(B * T_ * C / w);
  const int t = static_cast<int>(T_);
  if (w == W) {
    position_forward_kernel<W, T>
        <<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(out, wpe, t, row_packs, packs);
  } else {
    position_forward_kernel<1, T>
        <<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(out, wpe, t, row_packs, packs);
  }
  KEEL_CUDA_LAUNCH_CHECK("position_forward", "B=", B, " T=", T_, " C=", C);
}

template <typename T>
void position_backward_impl(Context& ctx, float* dwpe, const T* dout, int64_t B, int64_t T_,
                            int64_t C) {
  KEEL_CHECK(B >= 0 && T_ >= 0 && C >= 0, kUsage, "cuda position_backward: bad shape B=", B,
             " T=", T_, " C=", C);
  if (T_ * C == 0) return;
  constexpr int W = pack_width<float, T>();
  const int w = row_pack_width<W>(C, B * T_ * C, "position_backward", dwpe, dout);
  const int packs = static_cast<int>(T_ * C / w), b = static_cast<int>(B);
  if (w == W) {
    position_backward_kernel<W, T>
        <<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(dwpe, dout, b, packs);
  } else {
    position_backward_kernel<1, T>
        <<<grid_for(packs, kThreads), kThreads, 0, ctx.stream()>>>(dwpe, dout, b, packs);
  }
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
