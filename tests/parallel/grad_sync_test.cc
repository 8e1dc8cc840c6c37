// DP gradient sync (parallel/grad_sync.cc):
//   - with a recording fake communicator (every rank alike, no MPI): buckets are whole parameters
//     in backward order cut at bucket_bytes; a bucket's all-reduce is issued by the ready() of its
//     last parameter, not later; finish() issues only what was never ready and waits for all;
//     every bucket element is reduced exactly once per step; begin() resets the record;
//   - overlap on the real model under MPI (dp = 2 and 4, mpiexec -n 2 and 4; skipped at -n 1):
//     with a small bucket size (several buckets), every bucket but the one holding the
//     parameters backward finishes last is issued while backward still runs (counted both by the
//     communicator's call counter before finish() and by GradSync's record), and the synced
//     gradients equal a blocking all-reduce of the same local gradients.
#include "parallel/grad_sync.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "layers/gpt.h"
#include "parallel/communicator.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::kGlobalBatch;
using testing::kSeqLen;
using testing::kVocab;
using testing::mpi_env;
using testing::tiny_config;
using testing::TinyJob;
using testing::world_size;

// A request that completes only in wait(), doubling its range (the sum over two ranks holding
// the same gradients).
class DoublingRequest final : public CommRequest {
 public:
  DoublingRequest(float* data, int64_t n) : data_(data), n_(n) {}
  void wait() override {
    if (done_) return;
    for (int64_t i = 0; i < n_; ++i) data_[i] *= 2.0f;
    done_ = true;
  }
  bool test() override { return done_; }

 private:
  float* data_;
  int64_t n_;
  bool done_ = false;
};

// Records every non-blocking all-reduce it is asked for; GradSync uses no other collective.
class RecordingComm final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_reduce(float*, int64_t, ReduceOp) override { ADD_FAILURE() << "unexpected"; }
  void all_reduce(double*, int64_t, ReduceOp) override { ADD_FAILURE() << "unexpected"; }
  void all_reduce_bf16(float*, int64_t) override { ADD_FAILURE() << "unexpected"; }
  void all_reduce_bf16(Bf16*, int64_t) override { ADD_FAILURE() << "unexpected"; }
  void all_gather(const float*, float*, int64_t) override { ADD_FAILURE() << "unexpected"; }
  void reduce_scatter(const float*, float*, int64_t) override { ADD_FAILURE() << "unexpected"; }
  void broadcast(float*, int64_t, int) override { ADD_FAILURE() << "unexpected"; }
  void all_gather_bytes(const void*, void*, int64_t) override { ADD_FAILURE() << "unexpected"; }
  void broadcast_bytes(void*, int64_t, int) override { ADD_FAILURE() << "unexpected"; }
  void barrier() override { ADD_FAILURE() << "unexpected"; }
  std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override {
    issued.emplace_back(data, n);
    return std::make_unique<DoublingRequest>(data, n);
  }
  std::vector<std::pair<float*, int64_t>> issued;
};

// Seven parameters with padding between some of them; a cap of 30 floats cuts them (walking
// backward) into {6} (larger than the cap alone), {3, 4, 5} = [48, 99) and {0, 1, 2} = [0, 41).
const std::vector<ArenaRange> kParams = {{0, 10}, {16, 20}, {36, 5},  {48, 40},
                                         {88, 7}, {96, 3},  {104, 64}};
constexpr int64_t kArena = 168;
constexpr int64_t kCapBytes = 30 * sizeof(float);

std::vector<float> ramp() {
  std::vector<float> g(kArena);
  for (int64_t i = 0; i < kArena; ++i) g[i] = static_cast<float>(i + 1);
  return g;
}

// Whether arena element i lies in some bucket.
bool in_bucket(const GradSync& s, int64_t i) {
  for (int b = 0; b < s.num_buckets(); ++b) {
    const ArenaRange r = s.bucket_range(b);
    if (i >= r.offset && i < r.offset + r.n) return true;
  }
  return false;
}

TEST(GradSyncBuckets, WholeParametersInBackwardOrderCutAtTheCap) {
  RecordingComm comm;
  std::vector<float> g = ramp();
  GradSync s(comm, g.data(), kParams, kCapBytes);
  ASSERT_EQ(s.num_buckets(), 3);
  EXPECT_EQ(s.bucket_range(0).offset, 104);
  EXPECT_EQ(s.bucket_range(0).n, 64);
  EXPECT_EQ(s.bucket_range(1).offset, 48);
  EXPECT_EQ(s.bucket_range(1).n, 51);
  EXPECT_EQ(s.bucket_range(2).offset, 0);
  EXPECT_EQ(s.bucket_range(2).n, 41);
  // Every parameter lies inside exactly one bucket.
  for (const ArenaRange& p : kParams) {
    int holders = 0;
    for (int b = 0; b < s.num_buckets(); ++b) {
      const ArenaRange r = s.bucket_range(b);
      holders += p.offset >= r.offset && p.offset + p.n <= r.offset + r.n ? 1 : 0;
    }
    EXPECT_EQ(holders, 1) << "parameter at " << p.offset;
  }
}

TEST(GradSyncBuckets, EachBucketIsIssuedByItsLastParametersReady) {
  RecordingComm comm;
  std::vector<float> g = ramp();
  const std::vector<float> before = g;
  GradSync s(comm, g.data(), kParams, kCapBytes);
  s.begin();
  // Backward reports parameters in reverse registration order; after each ready(), the number of
  // all-reduces issued so far.
  const int expected_issued[] = {1, 1, 1, 2, 2, 2, 3};  // after ready(6), ready(5), ..., ready(0)
  for (int id = 6, k = 0; id >= 0; --id, ++k) {
    s.ready(id);
    EXPECT_EQ(static_cast<int>(comm.issued.size()), expected_issued[k])
        << "after ready(" << id << ")";
  }
  ASSERT_EQ(comm.issued.size(), 3u);
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(comm.issued[b].first, g.data() + s.bucket_range(b).offset);
    EXPECT_EQ(comm.issued[b].second, s.bucket_range(b).n);
    EXPECT_TRUE(s.issued_during_backward(b)) << "bucket " << b;
  }
  EXPECT_EQ(s.buckets_issued_during_backward(), 3);
  s.finish();
  EXPECT_EQ(comm.issued.size(), 3u);  // finish() issued nothing more
  EXPECT_EQ(s.buckets_issued_during_backward(), 3);
  // Every bucket element reduced exactly once; the padding outside buckets untouched.
  for (int64_t i = 0; i < kArena; ++i) {
    EXPECT_EQ(g[i], in_bucket(s, i) ? 2 * before[i] : before[i]) << "element " << i;
  }
}

TEST(GradSyncBuckets, FinishIssuesWhatWasNeverReadyAndRecordsIt) {
  RecordingComm comm;
  std::vector<float> g = ramp();
  const std::vector<float> before = g;
  GradSync s(comm, g.data(), kParams, kCapBytes);
  // Step 1: parameter 0 is never reported, so bucket 2 waits for finish().
  s.begin();
  for (int id = 6; id >= 1; --id) s.ready(id);
  EXPECT_EQ(comm.issued.size(), 2u);
  s.finish();
  ASSERT_EQ(comm.issued.size(), 3u);
  EXPECT_EQ(comm.issued[2].first, g.data() + s.bucket_range(2).offset);
  EXPECT_TRUE(s.issued_during_backward(0));
  EXPECT_TRUE(s.issued_during_backward(1));
  EXPECT_FALSE(s.issued_during_backward(2));
  EXPECT_EQ(s.buckets_issued_during_backward(), 2);
  for (int64_t i = 0; i < kArena; ++i) {
    EXPECT_EQ(g[i], in_bucket(s, i) ? 2 * before[i] : before[i]) << "element " << i;
  }
  // Step 2: nothing reported; begin() cleared the record, finish() issues every bucket.
  s.begin();
  s.finish();
  EXPECT_EQ(comm.issued.size(), 6u);
  EXPECT_EQ(s.buckets_issued_during_backward(), 0);
  for (int64_t i = 0; i < kArena; ++i) {
    EXPECT_EQ(g[i], in_bucket(s, i) ? 4 * before[i] : before[i]) << "element " << i;
  }
}

// The real model under MPI: dp = world size, tp = 1.
TEST(GradSyncOverlap, BucketsStartWhileBackwardRuns) {
  const int world = world_size();
  if (world < 2) GTEST_SKIP() << "data parallelism needs at least 2 ranks";
  TinyJob job;
  job.bucket_mb = 0.004;  // 4 KiB buckets; the tiny model's gradients are ~90 KiB
  const config::KeelConfig cfg = tiny_config(job);
  Distributed dist(mpi_env(), 1, 60.0);
  const Topology& topo = dist.topology();
  ASSERT_EQ(topo.dp, world);
  Communicator& dp = *topo.dp_comm;
  const int64_t B = kGlobalBatch / topo.dp;
  GPT model(cfg, topo, B);
  model.init(cfg.train().seed());
  ParamStore& ps = model.params();
  std::vector<ArenaRange> ranges;
  for (int id = 0; id < ps.size(); ++id)
    ranges.push_back({ps.info(id).offset, ps.info(id).numel()});
  const auto bucket_bytes = static_cast<int64_t>(cfg.parallel().bucket_mb() * 1024.0 * 1024.0);
  GradSync sync(dp, ps.grads().f32(), ranges, bucket_bytes);
  const int nb = sync.num_buckets();
  ASSERT_GE(nb, 6);
  // Each rank's own batch (so the DP sum is not a multiple of one rank's gradient).
  std::vector<int32_t> tokens(B * kSeqLen), targets(B * kSeqLen);
  const int64_t total = ps.total_elems();
  float* grads = ps.grads().f32();
  const float loss_weight = 1.0f / static_cast<float>(topo.dp);
  for (int step = 0; step < 2; ++step) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 7 + topo.dp_rank * 31 + step * 11) % kVocab);
      targets[i] = static_cast<int32_t>((i * 5 + topo.dp_rank * 17 + step * 3 + 1) % kVocab);
    }
    // Reference: this rank's gradients, summed over DP by one blocking all-reduce.
    ps.zero_grads();
    model.forward(tokens.data(), targets.data(), B);
    model.backward(loss_weight);
    std::vector<float> expected(grads, grads + total);
    dp.all_reduce(expected.data(), total, ReduceOp::kSum);
    // The same backward with the overlapped sync, as the trainer runs it.
    ps.zero_grads();
    model.forward(tokens.data(), targets.data(), B);
    sync.begin();
    // For each bucket issued, whether backward still had work left then: the position
    // embedding's gradient, the last one backward writes, is still all zero.
    const int wpe = ps.find("wpe");
    ASSERT_GE(wpe, 0);
    auto wpe_untouched = [&] {
      const float* g = ps.grad(wpe);
      return std::all_of(g, g + ps.info(wpe).numel(), [](float v) { return v == 0.0f; });
    };
    int issued_before_backward_ended = 0;
    model.set_grad_ready_hook([&](int id) {
      const int64_t before = dp.calls();
      const bool pending = wpe_untouched();
      sync.ready(id);
      if (dp.calls() > before && pending) ++issued_before_backward_ended;
    });
    const int64_t calls_before = dp.calls();
    model.backward(loss_weight);
    model.set_grad_ready_hook({});
    ASSERT_FALSE(wpe_untouched());
    // Fails if the buckets were issued only once backward had finished its work (even from
    // ready() calls made at its very end).
    EXPECT_GE(issued_before_backward_ended, nb - 1) << "step " << step << ", " << nb << " buckets";
    // Issued before finish() was entered, i.e. while backward ran: every bucket except at most
    // the one holding the embeddings, which backward finishes at its very end.
    const int64_t issued_in_backward = dp.calls() - calls_before;
    EXPECT_GE(issued_in_backward, nb - 1) << "step " << step << ", " << nb << " buckets";
    EXPECT_EQ(sync.buckets_issued_during_backward(), issued_in_backward) << "step " << step;
    sync.finish();
    EXPECT_EQ(dp.calls() - calls_before, nb) << "step " << step;
    EXPECT_GE(sync.buckets_issued_during_backward(), nb - 1) << "step " << step;
    for (int b = 0; b + 1 < nb; ++b) {
      EXPECT_TRUE(sync.issued_during_backward(b)) << "step " << step << ", bucket " << b;
    }
    // The overlapped sync computes what the blocking one does.
    double max_ref = 0.0, max_diff = 0.0;
    for (int64_t i = 0; i < total; ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(expected[i])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(grads[i]) - expected[i]));
    }
    ASSERT_GT(max_ref, 0.0);
    EXPECT_LE(max_diff, 1e-6 * max_ref) << "step " << step;
  }
}

}  // namespace
}  // namespace keel
