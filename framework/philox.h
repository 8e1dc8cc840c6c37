// Counter-based Philox4x32-10 (Salmon et al. 2011) and the layout-independent parameter draw.
// Note [layout-independent init]: element i of logical tensor `name` is drawn from
// philox(key = seed, counter = (i, fnv1a64(name))), so a rank holding any slice of the tensor
// draws exactly the numbers the single-process model would; TP=1 and TP=4 build the same model.
// Header-only and free of std::vector etc. so a CUDA kernel can call the same functions.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define KEEL_HD __host__ __device__
#else
#define KEEL_HD
#endif

namespace keel {

struct Philox4 {
  uint32_t v[4];
};

KEEL_HD inline uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Ten rounds of Philox4x32 over a 128-bit counter with a 64-bit key.
KEEL_HD inline Philox4 philox4x32(uint64_t key, uint64_t counter_lo, uint64_t counter_hi) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// 64-bit FNV-1a: the stream id of a named tensor.
constexpr uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Uniform in (0, 1] from one 32-bit word (never 0, so log() is finite).
KEEL_HD inline double uniform_open0(uint32_t x) { return (static_cast<double>(x) + 1.0) * 0x1p-32; }

// Standard normal for element `index` of the stream `stream` (Box-Muller on two Philox words).
KEEL_HD inline double philox_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const Philox4 r = philox4x32(seed, index, stream);
  const double u1 = uniform_open0(r.v[0]);
  const double u2 = uniform_open0(r.v[1]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Uniform in [0, 1) for element `index` of stream `stream`.
KEEL_HD inline double philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const Philox4 r = philox4x32(seed, index, stream);
  return (static_cast<double>(r.v[0]) + static_cast<double>(r.v[1] >> 11) * 0x1p-21) * 0x1p-32;
}

}  // namespace keel
