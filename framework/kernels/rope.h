// Rotary position embedding (RoPE, Su et al. 2021) for q and k, in the "rotate-half" convention
// of GPT-NeoX and of Hugging Face's Llama / OLMo / Qwen (`rotate_half`), not the interleaved
// convention of the original paper / GPT-J / Meta's Llama checkpoints.
//
// Note [rope-convention]: for a head vector x of dim D (even), the pairs are (x[i], x[i + D/2])
// for i < D/2, rotated by angle = p * inv_freq_i with inv_freq_i = theta^(-2i / D):
//   y[i]       = x[i]       * cos(angle) - x[i + D/2] * sin(angle)
//   y[i + D/2] = x[i + D/2] * cos(angle) + x[i]       * sin(angle)
// This is what HF's `q * cos + rotate_half(q) * sin` computes, so q/k projection weights export
// to those models without permuting rows. A model trained with the interleaved convention would
// need its q/k rows permuted (pair (2i, 2i+1) -> (i, i + D/2)) to export.
#pragma once

#include <cstdint>
#include <vector>

namespace keel::kernels {

// cos/sin of angle(p, i) for positions p < max_positions and pairs i < half_dim = head_dim / 2,
// computed in double and stored as float: cos[p * half_dim + i], sin[p * half_dim + i].
struct RopeTable {
  int64_t max_positions = 0;
  int64_t half_dim = 0;
  std::vector<float> cos;  // [max_positions, half_dim]
  std::vector<float> sin;  // [max_positions, half_dim]
};

// Built once at start-up (this allocates; the kernels below do not). head_dim even, theta > 0.
RopeTable make_rope_table(int64_t max_positions, int64_t head_dim, double theta);

// Real is float (training) or double (gradient checks); the table is float either way.
//
// Layout: B * T rows, row r = b * T + t starts at x + r * row_stride (in elements) and holds H
// heads of D contiguous elements (D = 2 * table.half_dim); row_stride >= H * D, so q or k inside
// a packed qkv row can be addressed by offsetting the pointer. Row (b, t) is at position
// t + pos_offset < table.max_positions. Elements of a row past H * D are neither read nor written.
//
// y = rope(x) (=). y == x (in place) is allowed; otherwise y and x must not overlap.
template <typename Real>
void rope_forward(const RopeTable& table, Real* y, const Real* x, int64_t B, int64_t T, int64_t H,
                  int64_t D, int64_t row_stride, int64_t pos_offset = 0);

// dx = rope^T(dy) (=): the same rotation with angle -> -angle (rotations are orthogonal).
// dx == dy (in place) is allowed; otherwise they must not overlap.
template <typename Real>
void rope_backward(const RopeTable& table, Real* dx, const Real* dy, int64_t B, int64_t T,
                   int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset = 0);

}  // namespace keel::kernels
