// A grouped-query checkpoint resumes under other TP sizes (Note [gqa layouts] in
// layers/attention.h): the k/v projection is one logical tensor whether a layout shards it with
// the query heads or replicates it, so the checkpoint's slices load into either. 4 query heads:
//   - 2 k/v heads written at TP2 x DP2 with ZeRO-1 (sharded) resume in one process, at TP4
//     (replicated) and at DP4;
//   - 1 k/v head written at TP4 (replicated) resumes in one process and at TP2 x DP2;
// each with step 11's loss within 1e-6 relative of the run that was never stopped and steps 12-15
// within 1e-5 (the bounds of checkpoint_resume_test's ReshardsToAnyLayout). A multi-head
// checkpoint does not resume as a grouped-query model (exit 2).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::run_command;
using testing::TempDir;

const std::vector<std::string> kJob = {
    "--set", "model.d_model=32",     "--set", "model.n_layers=2",
    "--set", "model.n_heads=4",      "--set", "model.seq_len=16",
    "--set", "train.global_batch=8", "--set", "data.builtin_bytes=100000",
    "--set", "train.steps=20",       "--set", "train.log_every=1",
    "--set", "train.eval_every=0",   "--set", "train.sample_chars=0",
    "--set", "checkpoint.every=5",   "--set", "train.threads=1",
    "--set", "optim.warmup_steps=2", "--set", "model.qk_norm_scope=HEAD"};

// step -> loss of its metrics line.
std::map<int, double> losses(const std::string& run_dir) {
  std::map<int, double> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto num = [&](const std::string& key) {
      const size_t at = line.find("\"" + key + "\": ");
      return at == std::string::npos ? NAN : std::stod(line.substr(at + key.size() + 4));
    };
    out[static_cast<int>(num("step"))] = num("loss");
  }
  return out;
}

class GqaResume : public ::testing::Test {
 protected:
  CommandResult train(const std::string& run, int ranks, std::vector<std::string> extra) {
    std::vector<std::string> args = kJob;
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--run-dir", dir_.file(run)});
    return run_command(testing::train_command(args, ranks), dir_);
  }
  std::string ckpt(const std::string& run, int step) const {
    char name[32];
    std::snprintf(name, sizeof(name), "step_%08d", step);
    return dir_.file(run) + "/checkpoints/" + name;
  }
  struct Layout {
    int ranks;
    std::vector<std::string> sets;
  };
  // Trains `written` straight to step 20 and, again, killed at step 11 (a checkpoint at 10);
  // resumes that checkpoint under each of `resumed`.
  void reshard(const std::string& kv, const Layout& written, const std::vector<Layout>& resumed) {
    std::vector<std::string> base = {"--set", "model.n_kv_heads=" + kv};
    base.insert(base.end(), written.sets.begin(), written.sets.end());
    const CommandResult straight = train("straight", written.ranks, base);
    ASSERT_EQ(straight.exit_code, 0) << straight.out << straight.err;
    std::vector<std::string> kill = base;
    kill.insert(kill.end(), {"--set", "debug.kill_at_step=11", "--set", "debug.kill_rank=0"});
    ASSERT_NE(train("saved", written.ranks, kill).exit_code, 0);
    ASSERT_TRUE(fs::exists(ckpt("saved", 10)));
    const auto reference = losses(dir_.file("straight"));
    for (const Layout& l : resumed) {
      SCOPED_TRACE(::testing::PrintToString(l.sets) + " on " + std::to_string(l.ranks));
      std::vector<std::string> args = {"--set", "model.n_kv_heads=" + kv};
      args.insert(args.end(), l.sets.begin(), l.sets.end());
      args.insert(args.end(), {"--resume-from", ckpt("saved", 10)});
      fs::remove_all(dir_.file("re"));
      const CommandResult r = train("re", l.ranks, args);
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      const auto m = losses(dir_.file("re"));
      ASSERT_EQ(m.size(), 10u);  // steps 11..20
      EXPECT_NEAR(m.at(11), reference.at(11), 1e-6 * reference.at(11));
      for (int s = 12; s <= 15; ++s) EXPECT_NEAR(m.at(s), reference.at(s), 1e-5 * reference.at(s));
    }
  }
  TempDir dir_{"keel_gqa_resume"};
};

TEST_F(GqaResume, ShardedKvHeadsResumeReplicatedAndUnsharded) {
  reshard("2", {4, {"--set", "parallel.tp=2", "--set", "parallel.zero_stage=1"}},
          {{1, {}}, {4, {"--set", "parallel.tp=4"}}, {4, {}}});
}

TEST_F(GqaResume, ReplicatedKvHeadResumesShardedAndUnsharded) {
  reshard("1", {4, {"--set", "parallel.tp=4"}}, {{1, {}}, {4, {"--set", "parallel.tp=2"}}});
}

TEST_F(GqaResume, AMultiHeadCheckpointDoesNotResumeAsGroupedQuery) {
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=7"}).exit_code, 0);
  const CommandResult r = train("run", 1, {"--set", "model.n_kv_heads=2"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("cannot resume from it"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace keel
