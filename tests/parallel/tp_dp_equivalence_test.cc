// Layout equivalence: a tiny GPT trained for three steps under tensor parallelism (TP), data
// parallelism (DP), TP x DP and ZeRO-1 computes what the same job computes in one process
// (Topology::single, run on every rank as the reference; it is deterministic). Checked per case:
//   - loss, z-loss and gradient norm of every step to 1e-6 / 1e-6 / 1e-5 relative;
//   - every gradient after step 1, assembled to its logical shape over TP, to 1e-5 relative in
//     norm (||a - b|| <= 1e-5 ||b|| + 1e-9) — except under ZeRO-1, where a rank's gradient arena
//     holds only its own DP replica's sum; padded vocabulary rows get exactly zero gradient;
//   - every parameter after three AdamW steps to 1e-5 relative in norm;
//   - loss and gradient norm bit-identical on every rank, replicated parameters bit-identical on
//     every rank and whole parameter arenas bit-identical across DP replicas;
//   - ZeRO-1's optimizer state per rank is 1/dp of plain DP's.
// The case list covers every QK-norm mode and scope under TP=2 and TP=4, two or more modes under
// DP, TP x DP and ZeRO-1, tied and untied embeddings, gradient accumulation and a binding clip.
// Each case runs only where tp x dp equals the world size (mpiexec -n 1, 2, 4).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "launch/trainer.h"
#include "layers/params.h"
#include "parallel/communicator.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::all_gather_world;
using testing::fingerprint;
using testing::mpi_env;
using testing::QkMode;
using testing::same_on_all_ranks;
using testing::tiny_config;
using testing::TinyJob;
using testing::world_size;

constexpr double kLossRtol = 1e-6;
constexpr double kGradRtol = 1e-5;
constexpr double kParamRtol = 1e-5;
constexpr double kAtol = 1e-9;  // floor for (near-)zero tensors, in norm
constexpr double kBindingClip = 0.05;

struct Case {
  int tp = 1, dp = 1;
  QkMode qk;
  int zero_stage = 0;
  int micro_batch = 0;
  bool tied = true;
  double grad_clip = 1e9;

  std::string name() const {
    std::string s = "TP" + std::to_string(tp) + "xDP" + std::to_string(dp);
    if (zero_stage) s += "_ZeRO1";
    s += "_" + qk.name();
    if (micro_batch) s += "_mb" + std::to_string(micro_batch);
    if (!tied) s += "_untied";
    if (grad_clip < 1e8) s += "_clip";
    return s;
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  const QkMode rms_shared{config::RMS, config::HEAD_SHARED};
  // One process through Distributed: the MPI path with groups of one.
  out.push_back({1, 1, rms_shared, 0, 4});
  // Every QK-norm mode and scope under TP = 2 and TP = 4; accumulation and untied heads mixed in.
  const std::vector<QkMode> modes = testing::all_qk_modes();
  for (int tp : {2, 4}) {
    for (size_t i = 0; i < modes.size(); ++i) {
      Case c{tp, 1, modes[i]};
      c.micro_batch = i % 2 == 1 ? 4 : 0;  // accumulation over two micro-batches
      c.tied = i % 3 != 2;
      out.push_back(c);
    }
    out.push_back({tp, 1, {config::RMS, config::PROJECTION}, 0, 0, true, kBindingClip});
  }
  // Data parallelism, plain and ZeRO-1.
  out.push_back({1, 2, rms_shared, 0, 2});
  out.push_back({1, 2, {config::LAYER, config::PROJECTION}, 0, 0, false});
  out.push_back({1, 2, rms_shared, 0, 0, true, kBindingClip});
  out.push_back({1, 2, rms_shared, 1, 0});
  out.push_back({1, 2, {config::L2, config::HEAD_SHARED}, 1, 2, false});
  out.push_back({1, 4, rms_shared, 0, 0});
  out.push_back({1, 4, {config::L2, config::HEAD}, 0, 1, false});
  out.push_back({1, 4, {config::LAYER, config::HEAD_SHARED}, 1, 1, true, kBindingClip});
  // TP x DP, plain and ZeRO-1 (ZeRO with gains whose gradients are TP partial sums).
  out.push_back({2, 2, rms_shared, 0, 0});
  out.push_back({2, 2, {config::LAYER, config::HEAD}, 0, 2, false});
  out.push_back({2, 2, rms_shared, 1, 0});
  out.push_back({2, 2, {config::LAYER, config::HEAD_SHARED}, 1, 2});
  out.push_back({2, 2, {config::L2, config::PROJECTION}, 1, 0, false, kBindingClip});
  out.push_back({2, 2, {config::NONE, config::HEAD_SHARED}, 1, 2});
  return out;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

struct Diff {
  double err = 0.0;  // ||a - b||
  double ref = 0.0;  // ||b||
  bool within(double rtol) const { return err <= rtol * ref + kAtol; }
  double relative() const { return err / std::max(ref, 1e-30); }
};

Diff diff(const float* a, const float* b, int64_t n) {
  double e = 0.0, r = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    e += d * d;
    r += static_cast<double>(b[i]) * b[i];
  }
  return {std::sqrt(e), std::sqrt(r)};
}

// Logical elements of parameter `id` that exist in the unpadded (single-process) model: the first
// V rows of the vocabulary-sharded tables, everything of the rest.
int64_t unpadded_elems(const ParamStore& ps, int id) {
  const ParamInfo& info = ps.info(id);
  const std::string& n = info.spec.name;
  if (n == "wte" || n == "lm_head.weight") return testing::kVocab * info.spec.logical[1];
  return shape_numel(info.spec.logical);
}

// Note [shift-invariant key biases]: a bias added to every key of a head shifts each query's
// logits by the constant q.b, which softmax cancels, so its gradient is zero in exact arithmetic:
// the k third of qkv.bias without QK-norm, and k_norm.bias after LayerNorm. In floats it is
// rounding noise (~1e-11), which AdamW's g / (|g| + eps) turns into layout-dependent updates of
// ~lr |g| / eps. Those elements are checked to have a ~zero gradient and left out of the
// parameter comparison. Returns the logical range [first, second) of such elements.
std::pair<int64_t, int64_t> shift_invariant(const ParamInfo& info, config::QkNorm qk) {
  const std::string& n = info.spec.name;
  auto ends_with = [&](const std::string& suffix) {
    return n.size() >= suffix.size() &&
           n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const int64_t numel = shape_numel(info.spec.logical);
  if (qk == config::NONE && ends_with(".attn.qkv.bias")) return {numel / 3, 2 * numel / 3};
  if (qk == config::LAYER && ends_with(".attn.k_norm.bias")) return {0, numel};
  return {0, 0};
}

constexpr float kShiftInvariantGradMax = 1e-7f;  // vs gradients of order 1e-3 around them

enum class Which { kGrads, kParams };

// Compares every parameter's (or gradient's) logical tensor with the reference; collective over
// TP (every rank calls it). Returns the worst relative difference and names it.
double compare_logical(ParamStore& got, ParamStore& ref, const Topology& topo, config::QkNorm qk,
                       Which which, double rtol, std::string* worst_name) {
  double worst = 0.0;
  for (int id = 0; id < got.size(); ++id) {
    const ParamInfo& info = got.info(id);
    const float* local = which == Which::kGrads ? got.grad(id) : got.param(id);
    const std::vector<float> logical = gather_logical(got, id, local, *topo.tp_comm);
    const int rid = ref.find(info.spec.name);
    EXPECT_GE(rid, 0) << info.spec.name << " is missing from the single-process model";
    if (rid < 0) continue;
    const int64_t n = unpadded_elems(got, id);
    EXPECT_EQ(shape_numel(ref.info(rid).spec.logical), n) << info.spec.name;
    EXPECT_EQ(static_cast<int64_t>(logical.size()), shape_numel(info.spec.logical))
        << info.spec.name;
    if (shape_numel(ref.info(rid).spec.logical) != n || static_cast<int64_t>(logical.size()) < n) {
      continue;
    }
    const float* r = which == Which::kGrads ? ref.grad(rid) : ref.param(rid);
    const auto [skip_lo, skip_hi] = shift_invariant(info, qk);
    if (which == Which::kGrads) {
      float mx = 0.0f;
      for (int64_t i = skip_lo; i < skip_hi; ++i) {
        mx = std::max({mx, std::abs(logical[i]), std::abs(r[i])});
      }
      EXPECT_LE(mx, kShiftInvariantGradMax) << info.spec.name << " [" << skip_lo << ", " << skip_hi
                                            << "): the gradient of a key bias must vanish";
    }
    std::vector<float> a(logical.begin(), logical.begin() + n), b(r, r + n);
    std::fill(a.begin() + skip_lo, a.begin() + skip_hi, 0.0f);
    std::fill(b.begin() + skip_lo, b.begin() + skip_hi, 0.0f);
    const Diff d = diff(a.data(), b.data(), n);
    EXPECT_TRUE(d.within(rtol)) << (which == Which::kGrads ? "gradient of " : "parameter ")
                                << info.spec.name << ": ||got - ref|| = " << d.err
                                << ", ||ref|| = " << d.ref << " (relative " << d.relative()
                                << ", tolerance " << rtol << ")";
    if (d.relative() > worst && d.ref > 0) {
      worst = d.relative();
      *worst_name = info.spec.name;
    }
    if (which == Which::kGrads) {
      // Padded vocabulary rows are never looked up and their logits are masked out of the loss.
      int64_t nonzero = 0;
      for (size_t i = n; i < logical.size(); ++i) nonzero += logical[i] != 0.0f;
      EXPECT_EQ(nonzero, 0) << info.spec.name << ": padded vocabulary rows have gradient";
    }
  }
  return worst;
}

class TpDpEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(TpDpEquivalence, MatchesSingleProcess) {
  const Case& c = GetParam();
  if (c.tp * c.dp != world_size()) {
    GTEST_SKIP() << c.name() << " needs " << c.tp * c.dp << " ranks, the world has "
                 << world_size();
  }
  const int rank = mpi_env().world_rank();
  TinyJob job;
  job.qk = c.qk;
  job.tied = c.tied;
  job.grad_clip = c.grad_clip;
  TrainerOptions opts;
  opts.progress = false;

  // Reference: the whole global batch in one forward, in this process alone.
  std::unique_ptr<Communicator> self_tp, self_dp;
  const Topology single = Topology::single(self_tp, self_dp);
  Trainer ref(tiny_config(job), single, opts);

  job.tp = c.tp;
  job.zero_stage = c.zero_stage;
  job.micro_batch = c.micro_batch;
  Distributed dist(mpi_env(), c.tp, 60.0);
  const Topology& topo = dist.topology();
  ASSERT_EQ(topo.dp, c.dp);  // the same on every rank, so no rank is left in a collective
  Trainer par(tiny_config(job), topo, opts);
  const int per_rank = testing::kGlobalBatch / c.dp;
  EXPECT_EQ(par.accum_steps(), c.micro_batch ? per_rank / c.micro_batch : 1);
  ParamStore& ps = par.model().params();
  ParamStore& rps = ref.model().params();
  const bool zero = c.zero_stage == 1 && c.dp > 1;

  double worst_loss = 0.0, worst_norm = 0.0, worst_grad = 0.0;
  std::string worst_grad_name = "-", worst_param_name = "-";
  for (int s = 1; s <= 3; ++s) {
    const StepResult rr = ref.step();
    const StepResult rp = par.step();
    EXPECT_LE(rel(rp.loss, rr.loss), kLossRtol)
        << "step " << s << ": loss " << rp.loss << " vs single-process " << rr.loss;
    EXPECT_LE(rel(rp.z_loss, rr.z_loss), kLossRtol)
        << "step " << s << ": z-loss " << rp.z_loss << " vs single-process " << rr.z_loss;
    EXPECT_LE(rel(rp.grad_norm, rr.grad_norm), kGradRtol)
        << "step " << s << ": gradient norm " << rp.grad_norm << " vs single-process "
        << rr.grad_norm;
    EXPECT_NEAR(rp.max_attn_logit, rr.max_attn_logit, 1e-4 * std::abs(rr.max_attn_logit));
    worst_loss = std::max(worst_loss, rel(rp.loss, rr.loss));
    worst_norm = std::max(worst_norm, rel(rp.grad_norm, rr.grad_norm));
    // Every rank decides alike: the values the spike guard and the clip see carry the same bits.
    EXPECT_TRUE(same_on_all_ranks(rp.loss)) << "step " << s << ": loss differs between ranks";
    EXPECT_TRUE(same_on_all_ranks(rp.z_loss)) << "step " << s << ": z-loss differs between ranks";
    EXPECT_TRUE(same_on_all_ranks(rp.grad_norm))
        << "step " << s << ": gradient norm differs between ranks";
    if (c.grad_clip < 1e8) {
      EXPECT_GT(rr.grad_norm, c.grad_clip) << "the clip must bind in this case";
    }
    if (s == 1 && !zero) {
      worst_grad =
          compare_logical(ps, rps, topo, c.qk.norm, Which::kGrads, kGradRtol, &worst_grad_name);
    }
  }
  const double worst_param =
      compare_logical(ps, rps, topo, c.qk.norm, Which::kParams, kParamRtol, &worst_param_name);

  // Replicated parameters carry the same bits on every rank; whole arenas (sharded slices
  // included) the same bits on the DP replicas of one TP rank.
  uint64_t replicated = fingerprint(nullptr, 0);
  for (int id = 0; id < ps.size(); ++id) {
    if (!ps.info(id).sharded()) {
      replicated = fingerprint(ps.param(id), ps.info(id).numel() * sizeof(float), replicated);
    }
  }
  const std::vector<uint64_t> rep_all = all_gather_world(replicated);
  const std::vector<uint64_t> arena_all = all_gather_world(
      fingerprint(ps.params().f32(), static_cast<size_t>(ps.total_elems()) * sizeof(float)));
  for (int r = 0; r < world_size(); ++r) {
    EXPECT_EQ(rep_all[r], rep_all[0])
        << "replicated parameters of rank " << r << " differ from rank 0's";
    EXPECT_EQ(arena_all[r], arena_all[r % c.tp])
        << "parameters of rank " << r << " differ from those of its DP peer rank " << r % c.tp;
  }

  if (zero) {
    // ZeRO-1 shards AdamW's m and v over DP: 1/dp of what plain DP holds on each rank.
    job.zero_stage = 0;
    Trainer plain(tiny_config(job), topo, opts);
    const int64_t zero_bytes = par.optimizer().state_bytes();
    const int64_t plain_bytes = plain.optimizer().state_bytes();
    EXPECT_EQ(plain_bytes, 2 * ps.total_elems() * static_cast<int64_t>(sizeof(float)));
    EXPECT_EQ(zero_bytes * c.dp, plain_bytes);
    EXPECT_EQ(par.shard_n() * c.dp, ps.total_elems());
    EXPECT_EQ(par.shard_offset(), topo.dp_rank * par.shard_n());
    if (rank == 0) {
      std::printf(
          "[ %s ] optimizer state per rank: ZeRO-1 %lld bytes, plain DP %lld bytes (1/%d)\n",
          c.name().c_str(), static_cast<long long>(zero_bytes), static_cast<long long>(plain_bytes),
          c.dp);
    }
  }
  if (rank == 0) {
    std::printf(
        "[ %s ] worst relative error: loss %.2e, grad norm %.2e, gradient %.2e (%s), "
        "parameter %.2e (%s)\n",
        c.name().c_str(), worst_loss, worst_norm, worst_grad, worst_grad_name.c_str(), worst_param,
        worst_param_name.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, TpDpEquivalence, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
}  // namespace keel
