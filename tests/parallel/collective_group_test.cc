// Collective groups (Note [collective groups] in parallel/communicator.h) in a training step: the
// tensor-parallel collectives that keel issues back to back form one group each, counted by
// Communicator::groups(). Per micro-batch, with TP over the whole world: the vocab-parallel loss
// groups its target-logit sum with its row-max all-reduce (1 group; the sum-exp's all-reduce
// needs the maxima and stays alone), and with a PROJECTION-scope QK-norm every layer groups the
// q and k statistics' all-reduces in forward and the partials' in backward (2 per layer). On MPI
// a group changes nothing else (each collective completes at its call), so the losses equal the
// ungrouped ones bit for bit in tests/parallel's equivalence tests; on NCCL the emulator's
// nccl_mpi_test.cc checks that a group starts as one.
#include <gtest/gtest.h>

#include <string>

#include "launch/train/trainer.h"
#include "parallel/communicator.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::kLayers;
using testing::mpi_env;
using testing::QkMode;
using testing::tiny_config;
using testing::TinyJob;
using testing::world_size;

int64_t groups_in_one_step(const QkMode& qk, int64_t* accum, int64_t* calls) {
  TinyJob job;
  job.tp = world_size();
  job.qk = qk;
  Distributed dist(mpi_env(), job.tp, 60.0);
  const Topology& topo = dist.topology();
  TrainerOptions opts;
  opts.progress = false;
  Trainer trainer(tiny_config(job), topo, opts);
  trainer.step();  // warm-up: counted from the second step
  topo.tp_comm->reset_counters();
  trainer.step();
  EXPECT_FALSE(topo.tp_comm->in_group()) << "a group left open";
  *accum = trainer.accum_steps();
  *calls = topo.tp_comm->calls();
  return topo.tp_comm->groups();
}

TEST(CollectiveGroups, LossAndProjectionQkNormGroupsPerMicroBatch) {
  if (world_size() < 2) GTEST_SKIP() << "needs tp > 1 (2 or 4 ranks)";
  int64_t accum = 0, calls = 0;
  // HEAD_SHARED: the loss's group only.
  EXPECT_EQ(groups_in_one_step({config::RMS, config::HEAD_SHARED}, &accum, &calls), accum);
  EXPECT_GT(calls, accum * 2) << "the step's other collectives are not grouped";
  // PROJECTION: and two per layer, forward and backward.
  EXPECT_EQ(groups_in_one_step({config::RMS, config::PROJECTION}, &accum, &calls),
            accum * (1 + 2 * kLayers));
}

}  // namespace
}  // namespace keel
