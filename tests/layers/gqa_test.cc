// Grouped-query and multi-query attention (issue 29 section 1): the CPU attention kernel with Hkv
// k/v heads computes, in double, what multi-head attention computes on k/v heads repeated over
// each group (forward; dq; dk and dv summed over the group; dscale) to 1e-12, on strided rows and
// more than one row block.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "framework/kernels/attention.h"

namespace keel {
namespace {

// ---- the kernel against multi-head attention on repeated k/v heads ----

TEST(GqaKernel, MatchesMultiHeadOnRepeatedKvHeads) {
  const int64_t B = 2, T = 70, H = 4, D = 5;  // T > 64: more than one row block
  std::mt19937 rng(3);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t Hkv : {1, 2}) {
    const int64_t G = H / Hkv, BT = B * T;
    // Strided rows (ld > heads * D) so a stride error shows.
    const int64_t ldq = H * D + 3, ldkv = Hkv * D + 2, ldo = H * D + 1, ldm = H * D;
    auto rnd = [&](int64_t n) {
      std::vector<double> v(n);
      for (auto& x : v) x = nd(rng);
      return v;
    };
    const std::vector<double> q = rnd(BT * ldq), k = rnd(BT * ldkv), v = rnd(BT * ldkv);
    const std::vector<double> dout = rnd(BT * ldo);
    const std::vector<double> scale = {0.4, 0.5, 0.3, 0.6};
    // Multi-head inputs: k/v head h / G copied to head h.
    std::vector<double> km(BT * ldm), vm(BT * ldm);
    for (int64_t r = 0; r < BT; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) {
          km[r * ldm + h * D + d] = k[r * ldkv + (h / G) * D + d];
          vm[r * ldm + h * D + d] = v[r * ldkv + (h / G) * D + d];
        }
      }
    }
    kernels::AttentionShape g{B, T, H, D, ldq, ldkv, ldkv, ldo, 2, Hkv};
    kernels::AttentionShape m{B, T, H, D, ldq, ldm, ldm, ldo, 2};
    std::vector<double> out_g(BT * ldo), out_m(BT * ldo), p_g(B * H * T * T), p_m(B * H * T * T);
    double max_g = 0, max_m = 0;
    kernels::attention_forward<double>(g, out_g.data(), p_g.data(), q.data(), k.data(), v.data(),
                                       scale.data(), &max_g);
    kernels::attention_forward<double>(m, out_m.data(), p_m.data(), q.data(), km.data(), vm.data(),
                                       scale.data(), &max_m);
    double worst = 0;
    for (int64_t r = 0; r < BT; ++r) {
      for (int64_t c = 0; c < H * D; ++c) {
        worst = std::max(worst, std::abs(out_g[r * ldo + c] - out_m[r * ldo + c]));
      }
    }
    EXPECT_LE(worst, 1e-12) << "forward, Hkv " << Hkv;
    EXPECT_NEAR(max_g, max_m, 1e-12);

    std::vector<double> ws_g(kernels::attention_workspace_elems(g, 2));
    std::vector<double> ws_m(kernels::attention_workspace_elems(m, 2));
    std::vector<double> dq_g(BT * ldq), dk_g(BT * ldkv), dv_g(BT * ldkv), ds_g(H, 0.0);
    std::vector<double> dq_m(BT * ldq), dk_m(BT * ldm), dv_m(BT * ldm), ds_m(H, 0.0);
    kernels::attention_backward<double>(g, dq_g.data(), dk_g.data(), dv_g.data(), ds_g.data(),
                                        dout.data(), p_g.data(), q.data(), k.data(), v.data(),
                                        scale.data(), ws_g.data());
    kernels::attention_backward<double>(m, dq_m.data(), dk_m.data(), dv_m.data(), ds_m.data(),
                                        dout.data(), p_m.data(), q.data(), km.data(), vm.data(),
                                        scale.data(), ws_m.data());
    double wq = 0, wk = 0, wv = 0, grad_scale = 0;
    for (int64_t r = 0; r < BT; ++r) {
      for (int64_t c = 0; c < H * D; ++c) {
        wq = std::max(wq, std::abs(dq_g[r * ldq + c] - dq_m[r * ldq + c]));
      }
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        for (int64_t d = 0; d < D; ++d) {
          double sk = 0, sv = 0;  // the group's multi-head gradients, summed
          for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
            sk += dk_m[r * ldm + h * D + d];
            sv += dv_m[r * ldm + h * D + d];
          }
          wk = std::max(wk, std::abs(dk_g[r * ldkv + hk * D + d] - sk));
          wv = std::max(wv, std::abs(dv_g[r * ldkv + hk * D + d] - sv));
          grad_scale = std::max({grad_scale, std::abs(sk), std::abs(sv)});
        }
      }
    }
    EXPECT_GT(grad_scale, 1e-2);
    EXPECT_LE(wq, 1e-12) << "dq, Hkv " << Hkv;
    EXPECT_LE(wk, 1e-12) << "dk, Hkv " << Hkv;
    EXPECT_LE(wv, 1e-12) << "dv, Hkv " << Hkv;
    for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(ds_g[h], ds_m[h], 1e-12) << "dscale " << h;
  }
}

}  // namespace
}  // namespace keel
