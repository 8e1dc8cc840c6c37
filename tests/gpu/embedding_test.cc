// The CUDA token and position embeddings (framework/kernels/cuda/embedding.cu). The token
// backward (Note [embedding-backward-segments]) on long runs of one token: against a
// double-precision host sum at the fp32 error bound of the kernel's summation order, bitwise
// against the CPU where a run fits one segment, and bitwise equal to itself run to run. The
// forward and position kernels' 16-byte packs and their fallback, bitwise against the CPU.
#include "framework/kernels/embedding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/kernels/cuda/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;

class EmbeddingTest : public GpuTest {
 protected:
  // dwte after cuda::embedding_backward from dwte0, for fp32 or bf16 dout (both held as floats
  // here, the bf16 ones already rounded).
  std::vector<float> run(const std::vector<int32_t>& tokens, const std::vector<float>& dout,
                         const std::vector<float>& dwte0, int64_t v_begin, int64_t V_local,
                         int64_t C, bool bf16) {
    const int64_t N = static_cast<int64_t>(tokens.size());
    DeviceBuffer d_tok = cuda::upload(ctx(), tokens), d_dwte = cuda::upload(ctx(), dwte0);
    if (bf16) {
      DeviceBuffer d_dout = cuda::upload(ctx(), to_bf16(dout));
      cuda::embedding_backward(ctx(), d_dwte.as<float>(), d_dout.as<Bf16>(), d_tok.as<int32_t>(), N,
                               v_begin, V_local, C);
    } else {
      DeviceBuffer d_dout = cuda::upload(ctx(), dout);
      cuda::embedding_backward(ctx(), d_dwte.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(),
                               N, v_begin, V_local, C);
    }
    return get<float>(d_dwte, dwte0.size());
  }
};

// The exact sum in double, and the fp32 error bound of the kernel's order: a term passes through
// at most R additions in its segment and one per later segment of its run (R in [8, 64] rows, so
// at most 64 + run / 8), each adding at most u = 2^-24 of the running sum of |terms|:
// |err| <= gamma_depth * (|dwte0| + sum |dout|), gamma_k = k u / (1 - k u). A missing or doubled
// row moves an element by |dout| (about 0.5 here), far past it.
::testing::AssertionResult within_fp32_bound(const std::vector<float>& gpu,
                                             const std::vector<int32_t>& tokens,
                                             const std::vector<float>& dout,
                                             const std::vector<float>& dwte0, int64_t v_begin,
                                             int64_t V_local, int64_t C) {
  const int64_t N = static_cast<int64_t>(tokens.size());
  std::vector<double> exact(dwte0.begin(), dwte0.end()), abs_sum(dwte0.size());
  std::vector<int64_t> run(V_local, 0);
  for (size_t i = 0; i < dwte0.size(); ++i) abs_sum[i] = std::abs(dwte0[i]);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t row = tokens[n] - v_begin;
    if (row < 0 || row >= V_local) continue;
    ++run[row];
    for (int64_t c = 0; c < C; ++c) {
      exact[row * C + c] += dout[n * C + c];
      abs_sum[row * C + c] += std::abs(dout[n * C + c]);
    }
  }
  const double u = std::ldexp(1.0, -24);
  int64_t bad = 0;
  double worst = 0.0;
  std::ostringstream first;
  for (int64_t row = 0; row < V_local; ++row) {
    const double k = 64.0 + std::ceil(static_cast<double>(run[row]) / 8.0);
    const double gamma = k * u / (1.0 - k * u);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = row * C + c;
      const double err = std::abs(gpu[i] - exact[i]), bound = gamma * abs_sum[i];
      if (!(err <= bound)) {
        if (bad < 5)
          first << " [row " << row << " col " << c << "] gpu=" << gpu[i] << " exact=" << exact[i];
        ++bad;
      }
      if (bound > 0) worst = std::max(worst, err / bound);
    }
  }
  if (bad > 0) {
    return ::testing::AssertionFailure()
           << bad << " elements outside the fp32 bound:" << first.str();
  }
  return ::testing::AssertionSuccess() << "worst error " << worst << " of the bound";
}

struct LongRunCase {
  const char* name;
  int64_t N, vocab, v_begin, V_local, C;  // tokens uniform in [0, vocab)
};

// Runs of about N / vocab rows, at the smallest segments (C = 96: R = 8, 512 windows) and the
// largest (C = 1024 or 640: R = 64), with tokens outside the shard (sorted last, skipped), and one
// token repeated N times (one run over every window: pass 2 adds 4096 / R partials).
TEST_F(EmbeddingTest, LongRunsMatchDoubleSumWithinFp32Bound) {
  const LongRunCase cases[] = {
      {"3 tokens, C=96", 4096, 3, 0, 3, 96},
      {"3 tokens, C=1024", 4096, 3, 0, 3, 1024},
      {"5 tokens, shard [1, 4), C=96", 4096, 5, 1, 3, 96},
      {"1 token, C=96", 4096, 1, 0, 1, 96},
      {"1 token, C=640", 4096, 1, 0, 1, 640},
  };
  uint32_t seed = 300;
  for (const LongRunCase& k : cases) {
    SCOPED_TRACE(k.name);
    std::mt19937 gen(seed++);
    std::vector<int32_t> tokens(k.N);
    for (auto& t : tokens) t = static_cast<int32_t>(gen() % k.vocab);
    const auto dout = random_vec(k.N * k.C, -1, 1, seed++);
    const auto dwte0 = random_vec(k.V_local * k.C, -1, 1, seed++);
    const auto first = run(tokens, dout, dwte0, k.v_begin, k.V_local, k.C, false);
    EXPECT_TRUE(within_fp32_bound(first, tokens, dout, dwte0, k.v_begin, k.V_local, k.C));
    // A fixed order: a second call gives the same bits.
    EXPECT_TRUE(identical(run(tokens, dout, dwte0, k.v_begin, k.V_local, k.C, false), first));
    const auto dout_bf16 = bf16_rounded(dout);
    const auto bf = run(tokens, dout_bf16, dwte0, k.v_begin, k.V_local, k.C, true);
    EXPECT_TRUE(within_fp32_bound(bf, tokens, dout_bf16, dwte0, k.v_begin, k.V_local, k.C));
    EXPECT_TRUE(identical(run(tokens, dout_bf16, dwte0, k.v_begin, k.V_local, k.C, true), bf));
  }
}

// Run lengths on both sides of every segment length (8 to 64 rows) and their multiples, shuffled,
// with out-of-shard tokens: within the fp32 bound, and a run of at most 8 rows (one segment at
// every R) is the CPU's exact order, so those rows equal the CPU's bit for bit.
TEST_F(EmbeddingTest, RunsAcrossSegmentBoundariesMatch) {
  const std::vector<int64_t> lengths = {1,  2,  7,  8,   9,   15,  16,  17,  31,  32,  33,
                                        63, 64, 65, 127, 128, 129, 130, 191, 192, 193, 300};
  const int64_t v_begin = 2, V_local = static_cast<int64_t>(lengths.size());
  std::vector<int32_t> tokens;
  for (int64_t k = 0; k < V_local; ++k) {
    tokens.insert(tokens.end(), lengths[k], static_cast<int32_t>(v_begin + k));
  }
  tokens.insert(tokens.end(), 40, 0);                                        // below the shard
  tokens.insert(tokens.end(), 40, static_cast<int32_t>(v_begin + V_local));  // above it
  std::shuffle(tokens.begin(), tokens.end(), std::mt19937(320));
  const int64_t N = static_cast<int64_t>(tokens.size());
  uint32_t seed = 321;
  for (const int64_t C : {96, 2048}) {  // R = 8 and R = 64 at this N
    SCOPED_TRACE("C=" + std::to_string(C));
    const auto dout = random_vec(N * C, -1, 1, seed++);
    const auto dwte0 = random_vec(V_local * C, -1, 1, seed++);
    const auto gpu = run(tokens, dout, dwte0, v_begin, V_local, C, false);
    EXPECT_TRUE(within_fp32_bound(gpu, tokens, dout, dwte0, v_begin, V_local, C));
    std::vector<float> cpu = dwte0;
    kernels::embedding_backward<float>(cpu.data(), dout.data(), tokens.data(), N, v_begin, V_local,
                                       C);
    std::vector<float> short_gpu, short_cpu;
    for (int64_t k = 0; k < V_local; ++k) {
      if (lengths[k] > 8) continue;
      short_gpu.insert(short_gpu.end(), gpu.begin() + k * C, gpu.begin() + (k + 1) * C);
      short_cpu.insert(short_cpu.end(), cpu.begin() + k * C, cpu.begin() + (k + 1) * C);
    }
    EXPECT_TRUE(identical(short_gpu, short_cpu)) << "runs of at most 8 rows";
    EXPECT_TRUE(matches(gpu, cpu, f32_rtol(300))) << "all rows against the CPU";
  }
}

// The forward, position forward and position backward step over 16-byte packs of a row when C is
// a multiple of the pack and the buffers are aligned (Note [vector-access]), else one element at a
// time: both equal the CPU bit for bit (copies, one addition, the CPU's order over b), for C a
// multiple of 8, C = 4k + 3, and every buffer one element off.
TEST_F(EmbeddingTest, ForwardAndPositionsMatchCpuExactlyAtOddWidthsAndOffsets) {
  const int64_t B = 3, T = 11, N = B * T, v_begin = 4, V_local = 20;
  std::mt19937 gen(340);
  std::vector<int32_t> tokens(N);
  for (auto& t : tokens) t = static_cast<int32_t>(gen() % 30);  // some outside [4, 24)
  uint32_t seed = 341;
  for (const int64_t C : {int64_t{96}, int64_t{4 * 20 + 3}}) {
    for (const int64_t off : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " off=" + std::to_string(off));
      const auto wte = bf16_rounded(random_vec(V_local * C, -1, 1, seed++));
      const auto wpe = bf16_rounded(random_vec(T * C, -1, 1, seed++));
      const auto dout = bf16_rounded(random_vec(N * C, -1, 1, seed++));
      const auto dwpe0 = random_vec(T * C, -1, 1, seed++);
      std::vector<float> out(N * C), dwpe = dwpe0;
      kernels::embedding_forward<float>(out.data(), tokens.data(), N, wte.data(), v_begin, V_local,
                                        C);
      kernels::position_forward<float>(out.data(), wpe.data(), B, T, C);
      kernels::position_backward<float>(dwpe.data(), dout.data(), B, T, C);
      // Buffers with `off` elements of NaN in front, the kernels given the rest.
      const auto at = [&](const auto& v) {
        using E = typename std::decay_t<decltype(v)>::value_type;
        std::vector<E> padded(v.size() + off);
        for (int64_t i = 0; i < off; ++i) padded[i] = padded[off];
        std::copy(v.begin(), v.end(), padded.begin() + off);
        return cuda::upload(ctx(), padded);
      };
      const auto tail = [&](std::vector<float> v) {
        return std::vector<float>(v.begin() + off, v.end());
      };
      DeviceBuffer d_tok = cuda::upload(ctx(), tokens);
      {
        DeviceBuffer d_wte = at(wte), d_wpe = at(wpe), d_dout = at(dout), d_dwpe = at(dwpe0);
        DeviceBuffer d_out = at(std::vector<float>(N * C, std::nanf("")));
        cuda::embedding_forward(ctx(), d_out.as<float>() + off, d_tok.as<int32_t>(), N,
                                d_wte.as<float>() + off, v_begin, V_local, C);
        cuda::position_forward(ctx(), d_out.as<float>() + off, d_wpe.as<float>() + off, B, T, C);
        cuda::position_backward(ctx(), d_dwpe.as<float>() + off, d_dout.as<float>() + off, B, T, C);
        EXPECT_TRUE(identical(tail(get<float>(d_out, off + N * C)), out)) << "fp32 forward";
        EXPECT_TRUE(identical(tail(get<float>(d_dwpe, off + T * C)), dwpe)) << "fp32 dwpe";
      }
      {
        std::vector<float> out_bf16 = out;  // embedding rows are exact; the position sum rounds
        for (float& x : out_bf16) x = round_bf16(x);
        DeviceBuffer d_wte = at(to_bf16(wte)), d_wpe = at(to_bf16(wpe)), d_dout = at(to_bf16(dout));
        DeviceBuffer d_dwpe = at(dwpe0), d_out = at(std::vector<Bf16>(N * C));
        cuda::embedding_forward(ctx(), d_out.as<Bf16>() + off, d_tok.as<int32_t>(), N,
                                d_wte.as<Bf16>() + off, v_begin, V_local, C);
        cuda::position_forward(ctx(), d_out.as<Bf16>() + off, d_wpe.as<Bf16>() + off, B, T, C);
        cuda::position_backward(ctx(), d_dwpe.as<float>() + off, d_dout.as<Bf16>() + off, B, T, C);
        EXPECT_TRUE(identical(tail(from_bf16(get<Bf16>(d_out, off + N * C))), out_bf16))
            << "bf16 forward";
        EXPECT_TRUE(identical(tail(get<float>(d_dwpe, off + T * C)), dwpe)) << "bf16 dwpe";
      }
    }
  }
}

}  // namespace
}  // namespace keel::gpu_test
