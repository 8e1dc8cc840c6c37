// Token and position embeddings. Vocab-parallel: a rank holds rows [v_begin, v_begin + V_local)
// of the logical table; tokens outside that range contribute zeros (the TP all-reduce adds them).
#pragma once

#include <cstdint>

namespace keel::kernels {

// out[n, C] = wte[tokens[n] - v_begin] or 0 when the token is not in this rank's rows (=).
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, int64_t N, const T* wte, int64_t v_begin,
                       int64_t V_local, int64_t C);
// dwte[tokens[n] - v_begin] += dout[n] for tokens in range; deterministic order.
template <typename T>
void embedding_backward(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t v_begin,
                        int64_t V_local, int64_t C);
// out[b, t, :] += wpe[t, :]
template <typename T>
void position_forward(T* out, const T* wpe, int64_t B, int64_t T_, int64_t C);
// dwpe[t, :] += sum_b dout[b, t, :]
template <typename T>
void position_backward(T* dwpe, const T* dout, int64_t B, int64_t T_, int64_t C);

}  // namespace keel::kernels
