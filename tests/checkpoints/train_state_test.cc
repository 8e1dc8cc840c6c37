// TrainState's tensor walker and the ZeRO-1 partition behind it (Note [run state],
// Note [ZeRO-1 partition]): every parameter is listed once in registration order with its arena
// range; across the DP ranks of a ZeRO-1 layout, the moment slices of each parameter tile its
// values exactly (no element twice, none missing); host reads and writes land where the
// optimizer keeps them.
#include "checkpoints/train_state.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "framework/config/config.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;

void add_params(ParamStore& ps) {
  ps.add({.name = "wte", .logical = {50, 8}, .decay = true});
  ps.add({.name = "ln.g", .logical = {8}, .init = ParamInit::kConstant, .value = 1.0f});
  ps.add({.name = "fc", .logical = {8, 33}, .decay = true});
  ps.add({.name = "b", .logical = {3}, .init = ParamInit::kConstant});
}

struct Rank {
  ParamStore ps;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<TrainState> state;
};

std::unique_ptr<Rank> make_rank(int dp, int dp_rank, bool zero) {
  auto r = std::make_unique<Rank>();
  add_params(r->ps);
  r->ps.allocate(0, 1, dp);
  r->ps.init(1);
  const ZeroPartition part(r->ps.total_elems(), dp, dp_rank, zero);
  std::vector<ParamSegment> segs;
  for (int id = 0; id < r->ps.size(); ++id) {
    const ArenaSlice own = part.clip(r->ps.info(id).offset, r->ps.info(id).numel());
    if (!own.empty()) segs.push_back({own.offset - part.mine().offset, own.n, false});
  }
  r->opt = std::make_unique<AdamW>(default_config().optim(), part.mine().n, segs);
  r->state = std::make_unique<TrainState>(r->ps, *r->opt, part);
  return r;
}

TEST(ZeroPartition, SlicesTileTheArena) {
  const ZeroPartition whole(96, 1, 0, true);
  EXPECT_FALSE(whole.sharded());  // dp = 1: nothing to shard
  EXPECT_EQ(whole.mine(), (ArenaSlice{0, 96}));
  const ZeroPartition off(96, 4, 2, false);
  EXPECT_FALSE(off.sharded());
  EXPECT_EQ(off.mine(), (ArenaSlice{0, 96}));
  const ZeroPartition z(96, 4, 2, true);
  EXPECT_TRUE(z.sharded());
  EXPECT_EQ(z.mine(), (ArenaSlice{48, 24}));
  EXPECT_EQ(z.slice_of(0), (ArenaSlice{0, 24}));
  EXPECT_EQ(z.slice_of(3), (ArenaSlice{72, 24}));
  EXPECT_EQ(z.clip(40, 20), (ArenaSlice{48, 12}));
  EXPECT_EQ(z.clip(50, 5), (ArenaSlice{50, 5}));
  EXPECT_EQ(z.clip(70, 10), (ArenaSlice{70, 2}));
  EXPECT_TRUE(z.clip(0, 48).empty());
  EXPECT_TRUE(z.clip(72, 10).empty());
  error_of(ErrorKind::kInternal, [] { ZeroPartition(97, 4, 0, true); });
}

TEST(TrainState, ListsEveryParameterOnceInRegistrationOrder) {
  const auto r = make_rank(1, 0, false);
  const auto& ts = r->state->tensors();
  ASSERT_EQ(static_cast<int>(ts.size()), r->ps.size());
  for (int id = 0; id < r->ps.size(); ++id) {
    EXPECT_EQ(ts[id].id, id);
    EXPECT_EQ(ts[id].info->spec.name, r->ps.info(id).spec.name);
    EXPECT_EQ(ts[id].values, (ArenaSlice{r->ps.info(id).offset, r->ps.info(id).numel()}));
    EXPECT_EQ(ts[id].moments, ts[id].values);  // no ZeRO-1: this rank holds every moment
  }
}

TEST(TrainState, ZeroMomentSlicesTileEachParameterAcrossRanks) {
  for (int dp : {2, 3, 5}) {
    SCOPED_TRACE(dp);
    std::vector<std::unique_ptr<Rank>> ranks;
    for (int d = 0; d < dp; ++d) ranks.push_back(make_rank(dp, d, true));
    const ParamStore& ps = ranks[0]->ps;
    for (int id = 0; id < ps.size(); ++id) {
      std::vector<int> owners(ps.info(id).numel(), 0);
      for (const auto& rank : ranks) {
        const StateParam& p = rank->state->tensors()[id];
        EXPECT_EQ(p.values, ranks[0]->state->tensors()[id].values);
        for (int64_t e = p.moments.offset; e < p.moments.end(); ++e) {
          ++owners[e - p.values.offset];
        }
      }
      for (int o : owners) EXPECT_EQ(o, 1) << ps.info(id).spec.name;
    }
  }
}

TEST(TrainState, HostCopiesLandWhereTheOptimizerKeepsThem) {
  const auto r = make_rank(3, 1, true);
  const TrainState& st = *r->state;
  const int64_t base = st.partition().mine().offset;
  for (const StateParam& p : st.tensors()) {
    std::vector<float> values(p.values.n), m(p.moments.n), v(p.moments.n);
    std::iota(values.begin(), values.end(), 1000.0f * p.id);
    std::iota(m.begin(), m.end(), 10.0f * p.id);
    std::iota(v.begin(), v.end(), 20.0f * p.id);
    st.write_values(p, values.data());
    st.write_moments(p, m.data(), v.data());
    for (int64_t i = 0; i < p.values.n; ++i) {
      EXPECT_EQ(r->ps.params().f32()[p.values.offset + i], values[i]);
    }
    for (int64_t i = 0; i < p.moments.n; ++i) {
      EXPECT_EQ(r->opt->m().f32()[p.moments.offset - base + i], m[i]);
      EXPECT_EQ(r->opt->v().f32()[p.moments.offset - base + i], v[i]);
    }
    std::vector<float> back(p.values.n), mb(p.moments.n), vb(p.moments.n);
    st.read_values(p, back.data());
    st.read_moments(p, mb.data(), vb.data());
    EXPECT_EQ(back, values);
    EXPECT_EQ(mb, m);
    EXPECT_EQ(vb, v);
  }
}

}  // namespace
}  // namespace keel
