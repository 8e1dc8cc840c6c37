// ParamStore: Note [layout-independent init]. Every TP rank's slice of a sharded parameter holds
// exactly the elements of the single-process tensor (shard = slice, as Megatron tests), for a
// shard on the first, a middle and the last dimension; replicated parameters are identical on
// every rank; the arena layout is aligned and padded for ZeRO-1.
// The GPT's parameter list under the model options: RoPE drops wpe, gated MLPs add mlp.gate
// (sharded, initialised and decayed like mlp.fc), bias = false drops every bias (LayerNorm and
// LAYER QK-norm ones included), and an OLMo-2-shaped model has exactly the expected tensors.
#include "layers/params.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"

namespace keel {
namespace {

void add_specs(ParamStore& ps) {
  ps.add({"emb", {8, 6}, 0, ParamInit::kNormal, 0.02f, true});       // vocab-parallel
  ps.add({"qkv", {3, 4, 2, 6}, 1, ParamInit::kNormal, 0.5f, true});  // by heads
  ps.add({"proj", {6, 8}, 1, ParamInit::kNormal, 1.0f, true});       // row-parallel
  ps.add({"gain", {6}, -1, ParamInit::kConstant, 1.0f, false});      // replicated
  ps.add({"bias", {4, 2}, 0, ParamInit::kConstant, 0.0f, false});    // per-head, sharded
}

// Element at multi-index `idx` of a row-major tensor of shape `shape`.
int64_t flat(const Shape& shape, const std::vector<int64_t>& idx) {
  int64_t f = 0;
  for (size_t k = 0; k < shape.size(); ++k) f = f * shape[k] + idx[k];
  return f;
}

TEST(ParamStore, EveryShardIsTheSliceOfTheSingleProcessTensor) {
  ParamStore whole;
  add_specs(whole);
  whole.allocate(0, 1);
  whole.init(1234);
  for (int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      ParamStore part;
      add_specs(part);
      part.allocate(rank, tp);
      part.init(1234);
      for (int id = 0; id < part.size(); ++id) {
        const ParamInfo& info = part.info(id);
        const Shape& logical = info.spec.logical;
        const int d = info.spec.shard_dim;
        // Walk the local tensor by multi-index; shift the shard dimension by its offset.
        std::vector<int64_t> idx(info.local.size(), 0);
        for (int64_t j = 0; j < info.numel(); ++j) {
          std::vector<int64_t> g = idx;
          if (d >= 0) g[d] += info.shard_begin;
          EXPECT_EQ(part.param(id)[j], whole.param(id)[flat(logical, g)])
              << info.spec.name << " tp=" << tp << " rank=" << rank << " local element " << j;
          EXPECT_EQ(part.logical_index(id, j), flat(logical, g)) << info.spec.name;
          for (int k = static_cast<int>(idx.size()) - 1; k >= 0; --k) {
            if (++idx[k] < info.local[k]) break;
            idx[k] = 0;
          }
        }
        if (d >= 0) {
          EXPECT_EQ(info.local[d] * tp, logical[d]) << info.spec.name;
          EXPECT_EQ(info.shard_begin, rank * info.local[d]) << info.spec.name;
          EXPECT_TRUE(info.sharded()) << info.spec.name;
        } else {
          EXPECT_FALSE(info.sharded()) << info.spec.name;
        }
      }
    }
  }
}

TEST(ParamStore, DrawsDependOnSeedAndNameNotOnOrder) {
  ParamStore a, b, c;
  add_specs(a);
  a.allocate(0, 1);
  a.init(1);
  // Same tensors registered in another order: every tensor keeps its values.
  b.add({"gain", {6}, -1, ParamInit::kConstant, 1.0f, false});
  b.add({"proj", {6, 8}, 1, ParamInit::kNormal, 1.0f, true});
  b.add({"emb", {8, 6}, 0, ParamInit::kNormal, 0.02f, true});
  b.allocate(0, 1);
  b.init(1);
  for (const char* name : {"emb", "proj", "gain"}) {
    const int ia = a.find(name), ib = b.find(name);
    for (int64_t j = 0; j < a.info(ia).numel(); ++j) {
      ASSERT_EQ(a.param(ia)[j], b.param(ib)[j]) << name;
    }
  }
  add_specs(c);
  c.allocate(0, 1);
  c.init(2);
  EXPECT_NE(a.param(a.find("emb"))[0], c.param(c.find("emb"))[0]) << "another seed, other draws";
  EXPECT_NE(a.param(a.find("emb"))[0], a.param(a.find("proj"))[0]);
}

TEST(ParamStore, ArenaIsAlignedAndPaddedForZero) {
  for (int pad : {1, 2, 3, 4}) {
    ParamStore ps;
    add_specs(ps);
    ps.allocate(0, 1, pad);
    EXPECT_EQ(ps.total_elems() % (16 * pad), 0) << "pad " << pad;
    for (int id = 0; id < ps.size(); ++id) {
      EXPECT_EQ(ps.info(id).offset % 16, 0) << ps.info(id).spec.name;
      if (id > 0) {
        EXPECT_GE(ps.info(id).offset, ps.info(id - 1).offset + ps.info(id - 1).numel());
      }
    }
    EXPECT_EQ(ps.find("nope"), -1);
  }
}

TEST(ParamStore, GatherLogicalOfOneRankIsTheTensor) {
  ParamStore ps;
  add_specs(ps);
  ps.allocate(0, 1);
  ps.init(5);
  SelfCommunicator self;
  for (int id = 0; id < ps.size(); ++id) {
    const std::vector<float> g = gather_logical(ps, id, ps.param(id), self);
    ASSERT_EQ(static_cast<int64_t>(g.size()), ps.info(id).numel());
    for (size_t j = 0; j < g.size(); ++j) EXPECT_EQ(g[j], ps.param(id)[j]);
  }
}

// ---- the model's parameters under the block options -------------------------------------------

// name -> spec of every parameter of a GPT built from the defaults plus `sets`, laid out as TP
// rank 0 of `tp` (the constructor allocates but does not communicate).
std::map<std::string, ParamInfo> model_params(const std::vector<std::string>& sets, int tp = 1) {
  std::vector<std::string> all = {"model.seq_len=16", "model.d_model=64", "model.n_layers=2",
                                  "model.n_heads=4", "model.vocab_size=300"};
  all.insert(all.end(), sets.begin(), sets.end());
  const config::KeelConfig cfg = load_config("", all);
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  Topology topo = Topology::single(tp_holder, dp_holder);
  topo.tp = tp;
  topo.world_size = tp;
  GPT model(cfg, topo, 2);
  std::map<std::string, ParamInfo> out;
  const ParamStore& ps = model.params();
  for (int id = 0; id < ps.size(); ++id) {
    EXPECT_TRUE(out.emplace(ps.info(id).spec.name, ps.info(id)).second) << ps.info(id).spec.name;
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// docs/model.md ("QK-norm and z-loss"): L2 QK-norm's learned logit scale g starts at
// log2(seq_len^2 - seq_len) (Henry et al. 2020), one per head with HEAD scope, else one.
TEST(ModelParams, L2ScaleStartsAtLog2OfSeqLenSquaredMinusSeqLen) {
  for (const char* scope : {"HEAD_SHARED", "HEAD", "PROJECTION"}) {
    SCOPED_TRACE(scope);
    const config::KeelConfig cfg = load_config(
        "", {"model.seq_len=32", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
             "model.qk_norm=L2", std::string("model.qk_norm_scope=") + scope});
    std::unique_ptr<Communicator> tp_holder, dp_holder;
    const Topology topo = Topology::single(tp_holder, dp_holder);
    GPT model(cfg, topo, 2);
    model.init(7);
    ParamStore& ps = model.params();
    const int id = ps.find("blocks.1.attn.qk_scale");
    ASSERT_GE(id, 0);
    const int64_t n = ps.info(id).numel();
    EXPECT_EQ(n, std::string(scope) == "HEAD" ? 4 : 1);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_FLOAT_EQ(ps.param(id)[i], std::log2(32.0f * 32.0f - 32.0f)) << i;  // 9.9773
    }
  }
}

TEST(ModelParams, RopeHasNoPositionTableAndNothingElseChanges) {
  std::map<std::string, ParamInfo> learned = model_params({});
  const std::map<std::string, ParamInfo> rope = model_params({"model.position=ROPE"});
  ASSERT_TRUE(learned.count("wpe"));
  EXPECT_EQ(learned.at("wpe").spec.logical, (Shape{16, 64}));
  EXPECT_FALSE(rope.count("wpe"));
  learned.erase("wpe");
  ASSERT_EQ(learned.size(), rope.size());
  for (const auto& [name, info] : learned) {
    ASSERT_TRUE(rope.count(name)) << name;
    EXPECT_EQ(rope.at(name).spec.logical, info.spec.logical) << name;
  }
}

TEST(ModelParams, GatedMlpAddsAGateShardedAndDecayedLikeTheUpProjection) {
  for (const char* kind : {"SWIGLU", "GEGLU"}) {
    SCOPED_TRACE(kind);
    const auto gelu = model_params({}, 2);
    const auto gated = model_params({std::string("model.mlp=") + kind, "model.d_ff=96"}, 2);
    EXPECT_EQ(gated.size(), gelu.size() + 2 * 2);  // gate.weight and gate.bias per layer
    for (int l = 0; l < 2; ++l) {
      const std::string p = "blocks." + std::to_string(l) + ".mlp.";
      EXPECT_FALSE(gelu.count(p + "gate.weight"));
      const ParamSpec& gate = gated.at(p + "gate.weight").spec;
      const ParamSpec& up = gated.at(p + "fc.weight").spec;
      EXPECT_EQ(gate.logical, (Shape{96, 64}));
      EXPECT_EQ(up.logical, (Shape{96, 64}));
      EXPECT_EQ(gated.at(p + "proj.weight").spec.logical, (Shape{64, 96}));
      // Column-parallel like fc: TP rank 0 of 2 holds rows [0, 48).
      EXPECT_EQ(gate.shard_dim, 0);
      EXPECT_EQ(gated.at(p + "gate.weight").local, (Shape{48, 64}));
      EXPECT_TRUE(gate.decay);
      EXPECT_EQ(gate.init, ParamInit::kNormal);
      EXPECT_EQ(gate.value, up.value);
      EXPECT_EQ(gated.at(p + "gate.bias").spec.logical, (Shape{96}));
      EXPECT_EQ(gated.at(p + "gate.bias").spec.shard_dim, 0);
      EXPECT_FALSE(gated.at(p + "gate.bias").spec.decay);
    }
  }
  // d_ff 0: 8/3 x d_model rounded up to a multiple of 64 (170.7 -> 192).
  EXPECT_EQ(model_params({"model.mlp=SWIGLU"}).at("blocks.0.mlp.gate.weight").spec.logical,
            (Shape{192, 64}));
}

TEST(ModelParams, NoBiasDropsEveryBias) {
  for (const char* norm : {"LAYERNORM", "RMSNORM"}) {
    for (const char* qk : {"NONE", "RMS", "LAYER", "L2"}) {
      SCOPED_TRACE(std::string(norm) + " " + qk);
      const std::vector<std::string> sets = {std::string("model.norm=") + norm,
                                             std::string("model.qk_norm=") + qk, "model.mlp=SWIGLU",
                                             "model.d_ff=96"};
      auto with_bias = model_params(sets);
      std::vector<std::string> no_bias_sets = sets;
      no_bias_sets.push_back("model.bias=false");
      const auto no_bias = model_params(no_bias_sets);
      int biases = 0;
      for (const auto& [name, info] : with_bias) {
        if (ends_with(name, ".bias")) {
          ++biases;
          EXPECT_FALSE(no_bias.count(name)) << name;
        } else {
          EXPECT_TRUE(no_bias.count(name)) << name;  // weights, gains and qk_scale stay
        }
      }
      // qkv, attn proj, mlp fc, gate and proj per layer; LayerNorm: ln1, ln2 and ln_f; LAYER
      // QK-norm: q_norm and k_norm.
      const bool ln = std::string(norm) == "LAYERNORM";
      const bool layer_qk = std::string(qk) == "LAYER";
      EXPECT_EQ(biases, 2 * (5 + (ln ? 2 : 0) + (layer_qk ? 2 : 0)) + (ln ? 1 : 0));
      EXPECT_EQ(no_bias.size(), with_bias.size() - biases);
    }
  }
}

// OLMo 2 (RMSNorm after each sublayer, RMS QK-norm over the whole projection, RoPE, SwiGLU, no
// biases, untied): exactly these tensors, and the logical count of its published formula
// 2 V C + L (4 C^2 + 3 C F + 2 C + 2 C) + C.
TEST(ModelParams, Olmo2ShapedModelHasExactlyItsTensors) {
  const auto ps =
      model_params({"model.norm=RMSNORM", "model.qk_norm=RMS", "model.qk_norm_scope=PROJECTION",
                    "model.position=ROPE", "model.mlp=SWIGLU", "model.bias=false",
                    "model.norm_placement=POST_SUBLAYER", "model.tie_embeddings=false"});
  const int64_t V = 300, C = 64, F = 192, H = 4, D = 16, L = 2;
  std::map<std::string, Shape> want = {
      {"wte", {V, C}}, {"ln_f.weight", {C}}, {"lm_head.weight", {V, C}}};
  for (int l = 0; l < L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    want[p + "ln1.weight"] = {C};
    want[p + "ln2.weight"] = {C};
    want[p + "attn.qkv.weight"] = {3, H, D, C};
    want[p + "attn.q_norm.weight"] = {H, D};
    want[p + "attn.k_norm.weight"] = {H, D};
    want[p + "attn.proj.weight"] = {C, H * D};
    want[p + "mlp.fc.weight"] = {F, C};
    want[p + "mlp.gate.weight"] = {F, C};
    want[p + "mlp.proj.weight"] = {C, F};
  }
  std::map<std::string, Shape> got;
  int64_t total = 0;
  for (const auto& [name, info] : ps) {
    got[name] = info.spec.logical;
    total += shape_numel(info.spec.logical);
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(total, 2 * V * C + L * (4 * C * C + 3 * C * F + 2 * C + 2 * C) + C);
}

}  // namespace
}  // namespace keel
