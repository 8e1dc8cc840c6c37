// Grouped-query and multi-query attention (model.n_kv_heads; Note [gqa layouts] in
// layers/attention.h):
//   - the CPU attention kernel with Hkv k/v heads computes, in double, what multi-head attention
//     computes on k/v heads repeated over each group (forward; dq; dk and dv summed over the
//     group) to 1e-12;
//   - (a whole GPT with 4 query heads on 2 and 1 k/v heads against finite differences: the
//     KvHeads cases of tests/layers/model_grad_test.cc);
//   - n_kv_heads = n_heads builds the model n_kv_heads = 0 builds: the same parameters and bit for
//     bit the same loss and gradients;
//   - the memory estimate counts the smaller k/v: its parameter term equals the arena a
//     grouped-query model allocates exactly (one process, and TP rank 0 of the sharded and
//     replicated layouts), and the heap that model allocates is within 5% of the estimate, as in
//     tests/layers/memory_estimate_test.cc;
//   - the parameter shapes, and the config errors (a non-divisor, a TP layout that neither shards
//     nor replicates the k/v heads, grouped-query attention on CUDA) name both numbers.
#include <gtest/gtest.h>
#include <malloc.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/config/keel.pb.h"
#include "framework/error.h"
#include "framework/kernels/attention.h"
#include "layers/gpt.h"
#include "layers/memory_estimate.h"

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

// ---- a whole model (its finite-difference gradients: the KvHeads cases of
// tests/layers/model_grad_test.cc) ----

constexpr int64_t kB = 2;

struct GqaCase {
  const char* name;
  int kv_heads;
  config::QkNorm qk = config::NONE;
  config::QkNormScope scope = config::HEAD_SHARED;
  config::Position position = config::LEARNED;
  bool bias = true;
};

config::KeelConfig tiny_config(const GqaCase& c) {
  config::KeelConfig cfg;
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(32);
  m->set_seq_len(8);
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(4);
  m->set_n_kv_heads(c.kv_heads);
  m->set_d_ff(32);
  m->set_qk_norm(c.qk);
  m->set_qk_norm_scope(c.scope);
  m->set_tie_embeddings(true);
  m->set_norm(config::RMSNORM);
  m->set_init_std(0.3f);
  m->set_position(c.position);
  m->set_rope_theta(100.0);
  m->set_mlp(config::GELU);
  m->set_bias(c.bias);
  cfg.mutable_loss()->set_z_loss(1e-2);
  return cfg;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch random_batch(const ModelDims& d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.V - 1));
  Batch b;
  b.tokens.resize(kB * d.T);
  b.targets.resize(kB * d.T);
  for (auto& t : b.tokens) t = tok(rng);
  for (auto& t : b.targets) t = tok(rng);
  return b;
}

constexpr config::Position kRope = config::ROPE;
// ---- n_kv_heads = n_heads is multi-head attention, bit for bit ----

TEST(Gqa, KvHeadsEqualToHeadsIsMultiHeadBitForBit) {
  for (const GqaCase& c :
       {GqaCase{"none", 0},
        GqaCase{"rms_projection_rope", 0, config::RMS, config::PROJECTION, kRope},
        GqaCase{"l2_head", 0, config::L2, config::HEAD}}) {
    std::unique_ptr<Communicator> tp_holder, dp_holder;
    const Topology topo = Topology::single(tp_holder, dp_holder);
    GqaCase same = c;
    same.kv_heads = 4;
    GPT a(tiny_config(c), topo, kB), b(tiny_config(same), topo, kB);
    EXPECT_FALSE(b.dims().gqa());
    ASSERT_EQ(a.params().size(), b.params().size());
    for (int id = 0; id < a.params().size(); ++id) {
      EXPECT_EQ(a.params().info(id).spec.name, b.params().info(id).spec.name);
      EXPECT_EQ(a.params().info(id).spec.logical, b.params().info(id).spec.logical);
    }
    ASSERT_EQ(a.params().total_elems(), b.params().total_elems());
    a.init(42);
    b.init(42);
    const Batch batch = random_batch(a.dims(), 5);
    a.params().zero_grads();
    b.params().zero_grads();
    const LossStats la = a.forward(batch.tokens.data(), batch.targets.data(), kB);
    const LossStats lb = b.forward(batch.tokens.data(), batch.targets.data(), kB);
    a.backward(1.0f);
    b.backward(1.0f);
    EXPECT_EQ(std::memcmp(&la.ce, &lb.ce, sizeof(double)), 0) << c.name;
    EXPECT_EQ(std::memcmp(&la.z_loss, &lb.z_loss, sizeof(double)), 0) << c.name;
    EXPECT_EQ(std::memcmp(a.params().grads().f32(), b.params().grads().f32(),
                          a.params().total_elems() * sizeof(float)),
              0)
        << c.name;
  }
}

TEST(Gqa, ParameterShapes) {
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  const Topology topo = Topology::single(tp_holder, dp_holder);
  GPT model(tiny_config({"mqa", 1, config::RMS, config::HEAD}), topo, kB);
  const ParamStore& ps = model.params();
  auto shape = [&](const std::string& name) {
    const int id = ps.find("blocks.0.attn." + name);
    EXPECT_GE(id, 0) << name;
    return id >= 0 ? ps.info(id).spec.logical : Shape{};
  };
  EXPECT_EQ(shape("q.weight"), (Shape{4, 8, 32}));
  EXPECT_EQ(shape("kv.weight"), (Shape{2, 1, 8, 32}));
  EXPECT_EQ(shape("q.bias"), (Shape{4, 8}));
  EXPECT_EQ(shape("kv.bias"), (Shape{2, 1, 8}));
  EXPECT_EQ(shape("q_norm.weight"), (Shape{4, 8}));
  EXPECT_EQ(shape("k_norm.weight"), (Shape{1, 8}));
  EXPECT_LT(ps.find("blocks.0.attn.qkv.weight"), 0);
}

// ---- the memory estimate ----

double heap_bytes() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<double>(mi.uordblks) + static_cast<double>(mi.hblkhd);
}

TEST(Gqa, MemoryEstimateCountsTheSmallerKv) {
  struct Case {
    int kv_heads, tp;
    const char* qk;
    const char* scope;
  };
  // Sharded (kv % tp == 0) and replicated (tp % kv == 0) layouts; TP rank 0 of each, laid out
  // in this process (the model's constructor allocates but does not communicate).
  const Case cases[] = {{1, 1, "RMS", "HEAD"},       {2, 1, "LAYER", "PROJECTION"},
                        {2, 2, "RMS", "HEAD"},       {1, 2, "LAYER", "HEAD"},
                        {2, 4, "RMS", "PROJECTION"}, {1, 4, "L2", "HEAD"}};
  const int64_t micro = 8;
  for (const Case& c : cases) {
    const config::KeelConfig cfg = load_config(
        "",
        {"model.seq_len=32", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
         "train.global_batch=8", "model.vocab_size=300",
         "model.n_kv_heads=" + std::to_string(c.kv_heads), "parallel.tp=" + std::to_string(c.tp),
         std::string("model.qk_norm=") + c.qk, std::string("model.qk_norm_scope=") + c.scope});
    const std::string name = "kv " + std::to_string(c.kv_heads) + " tp " + std::to_string(c.tp);
    std::unique_ptr<Communicator> tp_holder, dp_holder;
    Topology topo = Topology::single(tp_holder, dp_holder);
    topo.tp = c.tp;
    topo.world_size = c.tp;
    const int threads = omp_get_max_threads();
    const MemoryEstimate e = estimate_memory(cfg, c.tp, 1, micro, threads);
    const double before = heap_bytes();
    auto model = std::make_unique<GPT>(cfg, topo, micro);
    const double allocated = heap_bytes() - before;
    EXPECT_EQ(e.parameters, static_cast<double>(model->params().total_elems()) * 4.0) << name;
    const double trainer_batch = 2.0 * micro * cfg.model().seq_len() * 4.0;
    const double expected = e.parameters + e.gradients + e.activations - trainer_batch;
    EXPECT_NEAR(allocated, expected, 0.05 * expected + 64 * 1024) << name;
    // Fewer k/v heads than query heads on a rank: less than multi-head attention's estimate.
    config::KeelConfig mha = cfg;
    mha.mutable_model()->set_n_kv_heads(0);
    const MemoryEstimate m = estimate_memory(mha, c.tp, 1, micro, threads);
    if (model->dims().Hkvl < model->dims().Hl) {
      EXPECT_LT(e.parameters, m.parameters) << name;
      EXPECT_LT(e.activations, m.activations) << name;
    }
  }
}

// ---- config errors ----

std::string config_error(const std::vector<std::string>& sets, ErrorKind want) {
  try {
    load_config("", sets);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), want) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

TEST(Gqa, ConfigErrorsNameBothNumbers) {
  std::string m = config_error({"model.n_heads=4", "model.n_kv_heads=3"}, ErrorKind::kConfig);
  EXPECT_NE(m.find("model.n_kv_heads=3"), std::string::npos) << m;
  EXPECT_NE(m.find("model.n_heads=4"), std::string::npos) << m;
  m = config_error({"model.n_heads=4", "model.n_kv_heads=8"}, ErrorKind::kConfig);
  EXPECT_NE(m.find("model.n_kv_heads=8"), std::string::npos) << m;
  // 12 heads on 6 k/v heads under TP4: 6 is neither a multiple nor a divisor of 4.
  m = config_error({"model.d_model=96", "model.n_heads=12", "model.n_kv_heads=6", "parallel.tp=4",
                    "model.d_ff=128"},
                   ErrorKind::kLayout);
  EXPECT_NE(m.find("model.n_kv_heads=6"), std::string::npos) << m;
  EXPECT_NE(m.find("parallel.tp=4"), std::string::npos) << m;
  // Accepted: 0, n_heads, 1 and a divisor; the sharded and the replicated layouts; on the GPU
  // too (both CUDA attention paths take k/v heads shared by groups of query heads).
  for (const auto& sets :
       std::vector<std::vector<std::string>>{{"model.n_kv_heads=0"},
                                             {"model.n_kv_heads=4"},
                                             {"model.n_kv_heads=1", "parallel.tp=4"},
                                             {"model.n_kv_heads=2", "parallel.tp=2"},
                                             {"model.n_kv_heads=2", "parallel.tp=4"},
                                             {"model.n_kv_heads=2", "train.device=CUDA"}}) {
    EXPECT_NO_THROW(load_config("", sets)) << sets[0];
  }
}

}  // namespace
}  // namespace keel
