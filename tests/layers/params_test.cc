// ParamStore: Note [layout-independent init]. Every TP rank's slice of a sharded parameter holds
// exactly the elements of the single-process tensor (shard = slice, as Megatron tests), for a
// shard on the first, a middle and the last dimension; replicated parameters are identical on
// every rank; the arena layout is aligned and padded for ZeRO-1.
#include "layers/params.h"

#include <gtest/gtest.h>

#include <vector>

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

}  // namespace
}  // namespace keel
