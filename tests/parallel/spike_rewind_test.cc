// The spike guard's rewind under MPI (Note [spike guard]): at TP2xDP2 (or whatever layout the
// world allows), an injected spike makes every rank rewind at the same step to the same
// checkpoint, and right after the rewind every rank holds exactly that checkpoint's parameters
// and AdamW moments (loading the checkpoint again changes no bit), the same sampler position and
// the same skipped range.
#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "launch/train/trainer.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::mpi_env;
using testing::same_on_all_ranks;
using testing::TinyJob;
using testing::world_size;

std::vector<float> copy_of(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

TEST(SpikeRewind, EveryRankRestoresExactlyTheCheckpoint) {
  const int tp = world_size() >= 2 ? 2 : 1;
  TinyJob job;
  job.tp = tp;
  job.zero_stage = world_size() == 4 ? 1 : 0;
  config::KeelConfig cfg = testing::tiny_config(job);
  cfg.mutable_spike()->set_window(20);
  cfg.mutable_spike()->set_warmup_steps(20);
  cfg.mutable_spike()->set_rewind_margin(5);
  cfg.mutable_checkpoint()->set_every(10);
  cfg.mutable_debug()->set_inject_spike_at_step(40);

  // A run directory every rank sees: rank 0 makes it and broadcasts its name.
  char dir[256] = {};
  if (mpi_env().world_rank() == 0) {
    std::snprintf(dir, sizeof(dir), "%s/keel_spike_rewind_XXXXXX",
                  std::filesystem::temp_directory_path().c_str());
    ASSERT_NE(mkdtemp(dir), nullptr);
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);

  Distributed dist(mpi_env(), tp, 60.0);
  TrainerOptions opts;
  opts.progress = false;
  opts.run_dir = std::string(dir) + "/run";
  {
    Trainer trainer(cfg, dist.topology(), opts);
    StepResult r;
    for (int i = 0; i < 60; ++i) {
      r = trainer.step();
      if (r.rewound) break;
      if (trainer.steps_done() % 10 == 0 && trainer.state().guard.streak == 0) {
        trainer.save_checkpoint();
      }
    }
    // Step 40's update is the spike; 41 is flagged, 42 rewinds to the newest checkpoint at or
    // before 41 - 5: step 30.
    ASSERT_TRUE(r.rewound);
    EXPECT_EQ(r.step, 42);
    EXPECT_EQ(trainer.steps_done(), 30);
    EXPECT_TRUE(same_on_all_ranks(static_cast<double>(trainer.steps_done())));
    const GuardState& g = trainer.state().guard;
    ASSERT_EQ(g.skipped.size(), 1u);
    EXPECT_EQ(g.skipped[0].first_sample, 30u * testing::kGlobalBatch);
    EXPECT_TRUE(same_on_all_ranks(static_cast<double>(g.skipped[0].n)));
    EXPECT_TRUE(same_on_all_ranks(static_cast<double>(trainer.state().sampler.next_sample)));

    const std::vector<float> params = copy_of(trainer.model().params().params());
    const std::vector<float> m = copy_of(trainer.optimizer().m());
    const std::vector<float> v = copy_of(trainer.optimizer().v());
    const int64_t t = trainer.optimizer().t();
    const CheckpointStore store(opts.run_dir + "/checkpoints");
    load_checkpoint(store.path_of(30), trainer.state());
    auto same = [](const std::vector<float>& a, const Tensor& b) {
      return a.size() == static_cast<size_t>(b.numel()) &&
             std::memcmp(a.data(), b.f32(), a.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same(params, trainer.model().params().params()));
    EXPECT_TRUE(same(m, trainer.optimizer().m()));
    EXPECT_TRUE(same(v, trainer.optimizer().v()));
    EXPECT_EQ(t, trainer.optimizer().t());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (mpi_env().world_rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace keel
