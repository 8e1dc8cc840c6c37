// bfloat16 as host code sees it: 16 bits in memory, the layout of CUDA's __nv_bfloat16 (the CUDA
// backend reinterprets one as the other), so host code and tests can hold, round and read bf16
// buffers without the CUDA headers. Conversions round to nearest even, as __float2bfloat16_rn.
#pragma once

#include <cstdint>
#include <cstring>

namespace keel {

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be two bytes, the layout of __nv_bfloat16");

inline Bf16 to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

inline float from_bf16(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// x rounded to the nearest bf16, as a float (what a bf16 buffer holding x reads back as).
inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

}  // namespace keel
