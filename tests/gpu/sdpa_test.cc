// cuDNN fused attention (framework/kernels/cuda/sdpa_cudnn.h) against the CPU kernel
// (framework/kernels/attention.h) in fp32 on the same bf16-rounded inputs: out, lse (against a
// float64 log-sum-exp computed here), dq, dk, dv and dscale, for D in {64, 128}, T not a multiple
// of 64, B, H > 1, different per-head scales, and q, k, v (and their gradients) both as strided
// views of one fused qkv buffer and as dense arrays, and grouped-query and multi-query attention
// (H = 4 query heads on Hkv = 4, 2, 1 k/v heads: K, V, dK, dV of Hkv heads). Outputs are poisoned
// with NaN first, and the fused rows' columns no view covers must stay untouched. The execution
// context's BF16 attention on a strided bf16 k (a TP rank's one k/v head of several) against the
// same k given densely, bit for bit, on whichever path it takes. Also the per-head scale fold's
// kernels against host arithmetic, and the refusal of shapes cuDNN cannot take. Skips without a
// GPU, and the cuDNN comparisons skip in a build without the cuDNN frontend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/attention.h"
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/cuda/sdpa_cudnn.h"
#include "tests/gpu/gpu_test_util.h"

namespace keel::gpu_test {
namespace {

using cuda::DeviceBuffer;
namespace cudnn = cuda::cudnn;

// Bounds (besides gpu_test_util.h's). cuDNN runs on q' = bf16(scale[h] * q) (Note
// [cudnn-sdpa-scale]): that rounding moves each logit by up to 2^-9 of scale * sum |q_d k_d|
// (~0.01 at D = 128 with these inputs), so even the fp32 lse gets the bf16 bound, and the
// gradients, sums that cancel, move by a few percent of their rms. On the CUDA emulator, with
// keel's fused kernel standing in for cuDNN behind the same fold (tests/cuda_emu/sdpa.cc), the
// worst elements were off by 2.5-3% of the bound's scale for dk and dv and 4-4.5% for dq (rounded
// twice: dq' and then scale * dq'; dscale sums the rounded dq'). Hence 4x and 6x the bf16 bound,
// leaving cuDNN's own rounding some room; a wrong result is off by O(1).
constexpr double kLseRtol = kBf16Rtol;
constexpr double kGradRtol = 4 * kBf16Rtol;
constexpr double kDqRtol = 6 * kBf16Rtol;

struct SdpaCase {
  int64_t B, T, H, D;
  bool fused;  // q, k, v at columns [0, HD), [HD, HD + KD), [HD + KD, HD + 2 KD) of rows of
               // HD + 2 KD + 8 (KD = Hkv D) and out in rows of HD + 8 (cuDNN needs 16-byte rows);
               // otherwise dense [B * T, HD] q and [B * T, KD] k, v arrays.
  int64_t Hkv = 0;  // k/v heads; 0: H
  int64_t kv_heads() const { return Hkv > 0 ? Hkv : H; }
};

std::string describe(const SdpaCase& c) {
  return "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " Hkv=" + std::to_string(c.kv_heads()) + " D=" + std::to_string(c.D) +
         (c.fused ? " fused" : " dense");
}

// q's rows have stride ldq, k's and v's ldkv.
struct Layout {
  int64_t ldq, ldkv, off_q, off_k, off_v, size, ldo, out_size;
};
Layout layout_of(const SdpaCase& c) {
  const int64_t N = c.B * c.T, HD = c.H * c.D, KD = c.kv_heads() * c.D;
  if (c.fused) {
    const int64_t ld = HD + 2 * KD + 8;
    return {ld, ld, 0, HD, HD + KD, N * ld, HD + 8, N * (HD + 8)};
  }
  return {HD, KD, 0, N * HD, N * (HD + KD), N * (HD + 2 * KD), HD, N * HD};
}

kernels::AttentionShape shape_of(const SdpaCase& c, const Layout& L) {
  return {c.B, c.T, c.H, c.D, L.ldq, L.ldkv, L.ldkv, L.ldo, /*threads=*/1, c.Hkv};
}

// A view of [N, width] elements with row stride ld, first element at off.
struct View {
  int64_t off, width, ld;
};

// The N rows of a view, densely.
std::vector<float> gather(const std::vector<float>& buf, int64_t N, const View& v) {
  std::vector<float> out(N * v.width);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < v.width; ++j) out[n * v.width + j] = buf[v.off + n * v.ld + j];
  }
  return out;
}

// Elements no view covers are still NaN (the poison).
::testing::AssertionResult untouched_outside(const std::vector<float>& buf, int64_t N,
                                             const std::vector<View>& views) {
  std::vector<char> covered(buf.size(), 0);
  for (const View& v : views) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < v.width; ++j) covered[v.off + n * v.ld + j] = 1;
    }
  }
  for (size_t i = 0; i < buf.size(); ++i) {
    if (!covered[i] && !std::isnan(buf[i])) {
      return ::testing::AssertionFailure() << "element " << i << " outside the views was written";
    }
  }
  return ::testing::AssertionSuccess();
}

// lse[(b * H + h) * T + t] = ln sum_{u <= t} exp(scale[h] q_t . k_u), in double (k of the k/v
// head hk = h / (H / Hkv)).
std::vector<float> reference_lse(const kernels::AttentionShape& s, const float* q, const float* k,
                                 const std::vector<float>& scale) {
  std::vector<float> lse(s.B * s.H * s.T);
  std::vector<double> x(s.T);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t hk = h / (s.H / s.kv_heads());
      for (int64_t t = 0; t < s.T; ++t) {
        double mx = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (int64_t d = 0; d < s.D; ++d) {
            dot += static_cast<double>(q[(b * s.T + t) * s.ldq + h * s.D + d]) *
                   k[(b * s.T + u) * s.ldk + hk * s.D + d];
          }
          x[u] = scale[h] * dot;
          mx = std::max(mx, x[u]);
        }
        double sum = 0.0;
        for (int64_t u = 0; u <= t; ++u) sum += std::exp(x[u] - mx);
        lse[(b * s.H + h) * s.T + t] = static_cast<float>(mx + std::log(sum));
      }
    }
  }
  return lse;
}

std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

class SdpaTest : public GpuTest {
 protected:
  void check_case(const SdpaCase& c, uint32_t seed) {
    SCOPED_TRACE(describe(c));
    const Layout L = layout_of(c);
    const int64_t N = c.B * c.T, HD = c.H * c.D, KD = c.kv_heads() * c.D;
    const kernels::AttentionShape s = shape_of(c, L);
    const View vq{L.off_q, HD, L.ldq}, vk{L.off_k, KD, L.ldkv}, vv{L.off_v, KD, L.ldkv};
    const View vout{0, HD, L.ldo};
    std::string why;
    ASSERT_TRUE(cudnn::sdpa_available(ctx(), s, &why)) << why;

    const auto qkv = bf16_rounded(random_vec(L.size, -1, 1, seed));
    const auto dout = bf16_rounded(random_vec(L.out_size, -1, 1, seed + 1));
    // Per-head scales around 1/sqrt(D), different per head: logits of magnitude up to ~4.
    std::vector<float> scale = random_vec(c.H, 0.5f, 2.0f, seed + 2);
    for (float& x : scale) x /= std::sqrt(static_cast<float>(c.D));
    const auto dscale0 = random_vec(c.H, -1, 1, seed + 3);  // dscale accumulates (+=)

    // CPU reference in fp32 on the rounded inputs.
    std::vector<float> out(L.out_size, 0.0f), probs(c.B * c.H * c.T * c.T);
    float max_logit = 0.0f;
    const float* q = qkv.data() + L.off_q;
    const float* k = qkv.data() + L.off_k;
    const float* v = qkv.data() + L.off_v;
    kernels::attention_forward<float>(s, out.data(), probs.data(), q, k, v, scale.data(),
                                      &max_logit);
    std::vector<float> dqkv(L.size, 0.0f), dscale = dscale0;
    std::vector<float> ws(kernels::attention_workspace_elems(s, 1));
    kernels::attention_backward<float>(s, dqkv.data() + L.off_q, dqkv.data() + L.off_k,
                                       dqkv.data() + L.off_v, dscale.data(), dout.data(),
                                       probs.data(), q, k, v, scale.data(), ws.data());
    const auto lse_ref = reference_lse(s, q, k, scale);

    DeviceBuffer d_qkv = cuda::upload(ctx(), to_bf16(qkv));
    DeviceBuffer d_dout = cuda::upload(ctx(), to_bf16(dout));
    DeviceBuffer d_scale = cuda::upload(ctx(), scale), d_dscale = cuda::upload(ctx(), dscale0);
    DeviceBuffer d_out = poisoned<Bf16>(L.out_size), d_lse = poisoned<float>(c.B * c.H * c.T);
    DeviceBuffer d_dqkv = poisoned<Bf16>(L.size);
    const Bf16* gq = d_qkv.as<Bf16>() + L.off_q;
    const Bf16* gk = d_qkv.as<Bf16>() + L.off_k;
    const Bf16* gv = d_qkv.as<Bf16>() + L.off_v;
    cudnn::sdpa_forward(ctx(), s, d_out.as<Bf16>(), d_lse.as<float>(), gq, gk, gv,
                        d_scale.as<float>());
    cudnn::sdpa_backward(ctx(), s, d_dqkv.as<Bf16>() + L.off_q, d_dqkv.as<Bf16>() + L.off_k,
                         d_dqkv.as<Bf16>() + L.off_v, d_dscale.as<float>(), d_dout.as<Bf16>(),
                         d_out.as<Bf16>(), d_lse.as<float>(), gq, gk, gv, d_scale.as<float>());
    const auto g_out = from_bf16(get<Bf16>(d_out, L.out_size));
    const auto g_dqkv = from_bf16(get<Bf16>(d_dqkv, L.size));
    const auto g_lse = get<float>(d_lse, c.B * c.H * c.T);
    const auto g_dscale = get<float>(d_dscale, c.H);

    EXPECT_TRUE(matches(gather(g_out, N, vout), gather(out, N, vout), kBf16Rtol)) << "out";
    EXPECT_TRUE(untouched_outside(g_out, N, {vout})) << "out";
    EXPECT_TRUE(matches(g_lse, lse_ref, kLseRtol)) << "lse";
    const std::pair<View, double> grads[] = {{vq, kDqRtol}, {vk, kGradRtol}, {vv, kGradRtol}};
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      const auto [view, rtol] = grads[i];
      EXPECT_TRUE(matches(gather(g_dqkv, N, view), gather(dqkv, N, view), rtol)) << names[i];
    }
    EXPECT_TRUE(untouched_outside(g_dqkv, N, {vq, vk, vv})) << "dqkv";
    // The increment, not the sum, against the bound: dscale0 would otherwise hide its errors.
    EXPECT_TRUE(matches(minus(g_dscale, dscale0), minus(dscale, dscale0), kDqRtol)) << "dscale";
  }
};

TEST_F(SdpaTest, ForwardAndBackwardMatchCpuOnRoundedInputs) {
  if (!cudnn::have_frontend()) GTEST_SKIP() << cudnn::library_version();
  std::cout << "[          ] " << cudnn::library_version() << "\n";
  // T = 77, 130, 45, 50: no multiple of cuDNN's 64- or 128-row tiles. H = 4 on Hkv = 4 (written
  // out), 2 and 1 (multi-query), fused and dense.
  const SdpaCase cases[] = {{2, 77, 3, 64, true},     {2, 130, 2, 128, false},
                            {3, 45, 4, 128, true},    {2, 50, 4, 64, false, 4},
                            {2, 77, 4, 64, true, 2},  {1, 50, 4, 128, false, 2},
                            {2, 45, 4, 64, false, 1}, {1, 77, 4, 64, true, 1}};
  uint32_t seed = 500;
  for (const SdpaCase& c : cases) check_case(c, seed += 10);
}

TEST_F(SdpaTest, PlansAreReusedAcrossCalls) {
  if (!cudnn::have_frontend()) GTEST_SKIP() << cudnn::library_version();
  // The same shape twice on the same inputs: the cached plan gives the same forward result.
  const SdpaCase c{2, 70, 2, 64, false};
  const Layout L = layout_of(c);
  const kernels::AttentionShape s = shape_of(c, L);
  const auto qkv = to_bf16(random_vec(L.size, -1, 1, 601));
  const std::vector<float> scale = {0.1f, 0.2f};
  DeviceBuffer d_qkv = cuda::upload(ctx(), qkv), d_scale = cuda::upload(ctx(), scale);
  std::vector<std::vector<Bf16>> outs;
  for (int rep = 0; rep < 2; ++rep) {
    DeviceBuffer d_out = poisoned<Bf16>(L.out_size), d_lse = poisoned<float>(c.B * c.H * c.T);
    cudnn::sdpa_forward(ctx(), s, d_out.as<Bf16>(), d_lse.as<float>(), d_qkv.as<Bf16>() + L.off_q,
                        d_qkv.as<Bf16>() + L.off_k, d_qkv.as<Bf16>() + L.off_v,
                        d_scale.as<float>());
    outs.push_back(get<Bf16>(d_out, L.out_size));
  }
  const auto a = from_bf16(outs[0]), b = from_bf16(outs[1]);
  EXPECT_TRUE(identical(a, b));
}

// At a training size (the dP workspace B * H * T^2 * 2 bytes is 268 MB here), two backward calls
// on the same inputs give the same dq, dk, dv and dscale, bit for bit: cuDNN 9's default backward
// accumulates dq with atomics, sdpa_cudnn.cc asks for the deterministic one. Also with 2 k/v heads
// for the 8 query heads, where cuDNN sums each dK, dV over a group of 4.
TEST_F(SdpaTest, BackwardIsBitwiseReproducibleAtTrainingSizes) {
  if (!cudnn::have_frontend()) GTEST_SKIP() << cudnn::library_version();
#if KEEL_CUDA_EMULATOR
  GTEST_SKIP() << "the emulated cuDNN is keel's own deterministic kernel, and T = 2048 takes "
                  "hours at emulation speed; this checks the real cuDNN's algorithm choice";
#endif
  for (const int64_t Hkv : {int64_t{0}, int64_t{2}}) {
    const SdpaCase c{4, 2048, 8, 64, false, Hkv};
    SCOPED_TRACE(describe(c));
    const Layout L = layout_of(c);
    const kernels::AttentionShape s = shape_of(c, L);
    const auto qkv = to_bf16(random_vec(L.size, -1, 1, 611));
    const auto dout = to_bf16(random_vec(L.out_size, -1, 1, 612));
    std::vector<float> scale(c.H, 0.125f);
    DeviceBuffer d_qkv = cuda::upload(ctx(), qkv), d_dout = cuda::upload(ctx(), dout);
    DeviceBuffer d_scale = cuda::upload(ctx(), scale);
    DeviceBuffer d_out = poisoned<Bf16>(L.out_size), d_lse = poisoned<float>(c.B * c.H * c.T);
    const Bf16* q = d_qkv.as<Bf16>() + L.off_q;
    const Bf16* k = d_qkv.as<Bf16>() + L.off_k;
    const Bf16* v = d_qkv.as<Bf16>() + L.off_v;
    cudnn::sdpa_forward(ctx(), s, d_out.as<Bf16>(), d_lse.as<float>(), q, k, v,
                        d_scale.as<float>());
    std::vector<std::vector<Bf16>> grads;
    std::vector<std::vector<float>> dscales;
    for (int rep = 0; rep < 2; ++rep) {
      DeviceBuffer d_grad = poisoned<Bf16>(L.size);
      DeviceBuffer d_dscale = cuda::upload(ctx(), std::vector<float>(c.H, 0.0f));
      cudnn::sdpa_backward(ctx(), s, d_grad.as<Bf16>() + L.off_q, d_grad.as<Bf16>() + L.off_k,
                           d_grad.as<Bf16>() + L.off_v, d_dscale.as<float>(), d_dout.as<Bf16>(),
                           d_out.as<Bf16>(), d_lse.as<float>(), q, k, v, d_scale.as<float>());
      grads.push_back(get<Bf16>(d_grad, L.size));
      dscales.push_back(get<float>(d_dscale, c.H));
    }
    EXPECT_TRUE(identical(from_bf16(grads[1]), from_bf16(grads[0]))) << "dq, dk, dv";
    EXPECT_TRUE(identical(dscales[1], dscales[0])) << "dscale";
  }
}

// A plan whose workspace is above the limit is refused with the reason (and the shape then takes
// keel's own kernel) rather than failing its allocation mid-step. Run in a child process: the
// limit is read once per Context's cuDNN state, from KEEL_CUDNN_WORKSPACE_LIMIT_MB.
void refuse_above_workspace_limit(int device) {
  setenv("KEEL_CUDNN_WORKSPACE_LIMIT_MB", "1", 1);
  cuda::Context fresh(device);
  // dP workspace 2 * 4 * 512^2 * 2 bytes = 4 MiB, above 1 MiB.
  const kernels::AttentionShape s{2, 512, 4, 64, 768, 768, 768, 256, 1};
  std::string why;
  const bool ok = cudnn::sdpa_available(fresh, s, &why);
  std::fprintf(stderr, "%s\n", why.c_str());
  std::exit(!ok && why.find("MiB of workspace, above the 1 MiB limit") != std::string::npos ? 0
                                                                                            : 1);
}

TEST_F(SdpaTest, RefusesAPlanWhoseWorkspaceIsAboveTheLimit) {
  if (!cudnn::have_frontend()) GTEST_SKIP() << cudnn::library_version();
#if KEEL_CUDA_EMULATOR
  GTEST_SKIP() << "the emulated cuDNN (tests/cuda_emu/sdpa.cc) has no workspace; this checks the "
                  "real cuDNN's deterministic backward against the limit";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(refuse_above_workspace_limit(ctx().device()), ::testing::ExitedWithCode(0),
              "deterministic backward needs");
}

TEST_F(SdpaTest, RefusesShapesCudnnCannotTakeNamingTheShape) {
  // D = 12 is not a multiple of 8; ld = 36 (H * D for D = 12, H = 3) is not either; 3 k/v heads
  // do not divide 4 query heads.
  const kernels::AttentionShape odd_d{1, 8, 3, 12, 36, 36, 36, 36, 1};
  const kernels::AttentionShape odd_ld{1, 8, 1, 64, 68, 68, 68, 64, 1};
  const kernels::AttentionShape ungrouped{1, 8, 4, 16, 64, 48, 48, 64, 1, 3};
  DeviceBuffer buf = ctx().alloc(1 << 16), lse = ctx().alloc(1 << 12), sc = ctx().alloc(64);
  Bf16* p = buf.as<Bf16>();
  for (const auto& s : {odd_d, odd_ld, ungrouped}) {
    std::string why;
    EXPECT_FALSE(cudnn::sdpa_available(ctx(), s, &why));
    EXPECT_FALSE(why.empty());
    try {
      cudnn::sdpa_forward(ctx(), s, p, lse.as<float>(), p, p, p, sc.as<float>());
      ADD_FAILURE() << "no error for D=" << s.D << " ld=" << s.ldq;
    } catch (const Error& e) {
      const std::string shape = "D=" + std::to_string(s.D) + " ldq=" + std::to_string(s.ldq);
      EXPECT_NE(std::string(e.what()).find(shape), std::string::npos) << e.what();
    }
  }
}

// The execution context's BF16 attention (cuDNN's where it takes the shape, else keel's) on a bf16
// k read in place at a stride wider than its heads, as a TP rank that holds every k/v head reads
// the one its query heads use (Note [gqa layouts]): 4 query heads on the second of two k/v heads.
// Bit for bit the results of the same k given densely in fp32, which the context rounds to the same
// bf16 values; dk lands in that head's columns of the wide rows only.
TEST_F(SdpaTest, ExecContextReadsAStridedBf16KInPlace) {
  const int64_t B = 2, T = 40, H = 4, D = 32, HD = H * D, BT = B * T, ldw = 2 * D;
  const kernels::AttentionShape dense{B, T, H, D, HD, D, D, HD, 0, 1};
  kernels::AttentionShape wide = dense;
  wide.ldk = ldw;
  cuda::CudaExec gexec(0);
  gexec.set_precision(kernels::Precision::kBf16);
  cuda::Context& c = gexec.context();  // every buffer on its stream
  const auto q = random_vec(BT * HD, -1, 1, 801), v = random_vec(BT * D, -1, 1, 803);
  const auto kw = bf16_rounded(random_vec(BT * ldw, -1, 1, 802));
  const auto dout = random_vec(BT * HD, -1, 1, 804);
  const std::vector<float> scale = {0.15f, 0.2f, 0.25f, 0.3f};
  std::vector<float> kd(BT * D);  // the second k/v head, densely
  for (int64_t n = 0; n < BT; ++n) {
    for (int64_t d = 0; d < D; ++d) kd[n * D + d] = kw[n * ldw + D + d];
  }
  DeviceBuffer d_q = cuda::upload(c, q), d_v = cuda::upload(c, v), d_dout = cuda::upload(c, dout);
  DeviceBuffer d_kd = cuda::upload(c, kd), d_kw = cuda::upload(c, to_bf16(kw));
  DeviceBuffer d_scale = cuda::upload(c, scale);
  auto nan_buffer = [&](int64_t n) {
    DeviceBuffer b = c.alloc(static_cast<size_t>(n) * sizeof(float));
    c.fill_bytes(b.data(), 0xFF, static_cast<size_t>(n) * sizeof(float));
    return b;
  };
  auto read = [&](const DeviceBuffer& b, int64_t n) {
    return cuda::download<float>(c, b.data(), static_cast<size_t>(n));
  };
  struct Result {
    std::vector<float> out, saved, max_logit, dq, dk, dv, dscale;
  };
  auto run = [&](bool strided) {
    const kernels::AttentionShape& s = strided ? wide : dense;
    const kernels::ActIn k = strided ? kernels::ActIn(d_kw.as<Bf16>() + D, DType::kBF16)
                                     : kernels::ActIn(d_kd.as<float>());
    DeviceBuffer out = nan_buffer(BT * HD), saved = nan_buffer(gexec.attention_saved_elems(s));
    DeviceBuffer mal = nan_buffer(1), dq = nan_buffer(BT * HD), dk = nan_buffer(BT * s.ldk);
    DeviceBuffer dv = nan_buffer(BT * D), dscale = cuda::upload(c, std::vector<float>(H, 0.0f));
    gexec.attention_forward(s, out.as<float>(), saved.as<float>(), d_q.as<float>(), k,
                            d_v.as<float>(), d_scale.as<float>(), mal.as<float>());
    gexec.attention_backward(s, dq.as<float>(), dk.as<float>() + (strided ? D : 0), dv.as<float>(),
                             dscale.as<float>(), d_dout.as<float>(), out.as<float>(),
                             saved.as<float>(), d_q.as<float>(), k, d_v.as<float>(),
                             d_scale.as<float>(), nullptr);
    Result r{read(out, BT * HD),   read(saved, B * H * T), read(mal, 1),   read(dq, BT * HD),
             read(dk, BT * s.ldk), read(dv, BT * D),       read(dscale, H)};
    if (strided) {  // the first head's columns untouched, the second's densely
      std::vector<float> used(BT * D);
      for (int64_t n = 0; n < BT; ++n) {
        for (int64_t d = 0; d < D; ++d) {
          EXPECT_TRUE(std::isnan(r.dk[n * ldw + d])) << "dk row " << n << " column " << d;
          used[n * D + d] = r.dk[n * ldw + D + d];
        }
      }
      r.dk = used;
    }
    return r;
  };
  const Result a = run(false), b = run(true);
  std::cout << "[          ] attention: " << gexec.attention_path() << "\n";
  EXPECT_TRUE(identical(b.out, a.out)) << "out";
  EXPECT_TRUE(identical(b.saved, a.saved)) << "log-sum-exp";
  EXPECT_TRUE(identical(b.max_logit, a.max_logit)) << "max |logit|";
  EXPECT_TRUE(identical(b.dq, a.dq)) << "dq";
  EXPECT_TRUE(identical(b.dk, a.dk)) << "dk";
  EXPECT_TRUE(identical(b.dv, a.dv)) << "dv";
  EXPECT_TRUE(identical(b.dscale, a.dscale)) << "dscale";
  for (float x : a.dk) ASSERT_TRUE(std::isfinite(x)) << "an unwritten dk element";
}

TEST_F(SdpaTest, ScaleFoldAndUnfoldMatchHostArithmetic) {
  // Fused rows (ld = 3 * H * D + 8): the fold reads q's columns only, the unfold writes dq's.
  const int64_t B = 2, T = 37, H = 3, D = 64, HD = H * D, ld = 3 * HD + 8, N = B * T;
  const kernels::AttentionShape s{B, T, H, D, ld, ld, ld, HD, 1};
  const auto q = to_bf16(random_vec(N * ld, -2, 2, 701));
  const auto dq = to_bf16(random_vec(N * ld, -1, 1, 702));
  const std::vector<float> scale = {0.125f, 0.3f, 1.7f};
  const std::vector<float> dscale0 = {0.5f, -0.25f, 2.0f};
  DeviceBuffer d_q = cuda::upload(ctx(), q), d_scale = cuda::upload(ctx(), scale);

  // fold: qs = bf16(scale[h] * q), dense rows of H * D: the same rounding as the host's.
  DeviceBuffer d_qs = poisoned<Bf16>(N * HD);
  cudnn::fold_head_scale(ctx(), s, d_qs.as<Bf16>(), d_q.as<Bf16>(), d_scale.as<float>());
  std::vector<float> qs_ref(N * HD);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < HD; ++j) {
      qs_ref[n * HD + j] = round_bf16(scale[j / D] * from_bf16(q[n * ld + j]));
    }
  }
  EXPECT_TRUE(identical(from_bf16(get<Bf16>(d_qs, N * HD)), qs_ref)) << "fold";

  // unfold: dscale[h] += sum dq' * q (fp32 partial sums against double), dq = bf16(scale * dq').
  std::vector<float> dq_ref(N * ld), dscale_inc(H, 0.0f);
  std::vector<double> sums(H, 0.0);
  for (int64_t i = 0; i < N * ld; ++i) dq_ref[i] = from_bf16(dq[i]);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < HD; ++j) {
      const float g = from_bf16(dq[n * ld + j]);
      sums[j / D] += static_cast<double>(g) * from_bf16(q[n * ld + j]);
      dq_ref[n * ld + j] = round_bf16(scale[j / D] * g);
    }
  }
  for (int64_t h = 0; h < H; ++h) dscale_inc[h] = static_cast<float>(sums[h]);
  for (bool with_dscale : {false, true}) {
    SCOPED_TRACE(with_dscale ? "with dscale" : "without dscale");
    DeviceBuffer d_dq = cuda::upload(ctx(), dq), d_dscale = cuda::upload(ctx(), dscale0);
    cudnn::unfold_head_scale_grad(ctx(), s, d_dq.as<Bf16>(),
                                  with_dscale ? d_dscale.as<float>() : nullptr, d_q.as<Bf16>(),
                                  d_scale.as<float>());
    // The whole buffer: columns of k and v (and the padding) keep their values.
    EXPECT_TRUE(identical(from_bf16(get<Bf16>(d_dq, N * ld)), dq_ref)) << "dq";
    const auto g_dscale = get<float>(d_dscale, H);
    if (with_dscale) {
      EXPECT_TRUE(matches(minus(g_dscale, dscale0), dscale_inc, f32_rtol(N * D))) << "dscale";
    } else {
      EXPECT_TRUE(identical(g_dscale, dscale0)) << "dscale must be untouched when not given";
    }
  }
}

}  // namespace
}  // namespace keel::gpu_test
