// CPU embedding lookups and their gradient scatters (deterministic: channel blocks own rows).
#include "framework/kernels/embedding.h"

#include <algorithm>

namespace keel::kernels {

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, int64_t N, const T* wte, int64_t v_begin,
                       int64_t V_local, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
    T* o = out + n * C;
    if (row >= 0 && row < V_local) {
      std::copy(wte + row * C, wte + (row + 1) * C, o);
    } else {
      std::fill(o, o + C, T(0));
    }
  }
}

template <typename T>
void embedding_backward(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t v_begin,
                        int64_t V_local, int64_t C) {
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = static_cast<int64_t>(tokens[n]) - v_begin;
      if (row < 0 || row >= V_local) continue;
      T* d = dwte + row * C;
      const T* g = dout + n * C;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

template <typename T>
void position_forward(T* out, const T* wpe, int64_t B, int64_t T_, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const T* p = wpe + (bt % T_) * C;
    T* o = out + bt * C;
    for (int64_t c = 0; c < C; ++c) o[c] += p[c];
  }
}

template <typename T>
void position_backward(T* dwpe, const T* dout, int64_t B, int64_t T_, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    T* d = dwpe + t * C;
    for (int64_t b = 0; b < B; ++b) {
      const T* g = dout + (b * T_ + t) * C;
      for (int64_t c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

#define KEEL_INSTANTIATE(T)                                                                    \
  template void embedding_forward<T>(T*, const int32_t*, int64_t, const T*, int64_t, int64_t,  \
                                     int64_t);                                                 \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                      int64_t);                                                \
  template void position_forward<T>(T*, const T*, int64_t, int64_t, int64_t);                  \
  template void position_backward<T>(T*, const T*, int64_t, int64_t, int64_t);
KEEL_INSTANTIATE(float)
KEEL_INSTANTIATE(double)
#undef KEEL_INSTANTIATE

}  // namespace keel::kernels
