// Checkpoints through the real keel-train: a run killed mid-way (debug.kill_rank at step 12)
// and resumed equals the uninterrupted run bit for bit (every logged loss and gradient norm, and
// the bytes of the final checkpoint) in one process and at TP2xDP2 with and without ZeRO-1, with
// synchronous and with async saves; a TP2xDP2 ZeRO-1 checkpoint resumes at 1 process, TP4 and
// DP4 (resharding); corrupt checkpoints are named and skipped for the previous one;
// --resume-from a corrupt one, a changed model and other data exit 2; --no-resume refuses to
// clobber checkpoints unless --overwrite; a stale .tmp is removed; retention keeps what
// checkpoint.keep and keep_every say.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "framework/tensorboard/tensorboard.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;

const std::vector<std::string> kJob = {
    "--set", "model.d_model=32",     "--set", "model.n_layers=2",
    "--set", "model.n_heads=4",      "--set", "model.seq_len=16",
    "--set", "train.global_batch=8", "--set", "data.builtin_bytes=100000",
    "--set", "train.steps=20",       "--set", "train.log_every=1",
    "--set", "train.eval_every=0",   "--set", "train.sample_chars=0",
    "--set", "checkpoint.every=5",   "--set", "train.threads=1",
    "--set", "optim.warmup_steps=2"};

struct Line {
  double loss = 0, grad_norm = 0, z_loss = 0;
};

// step -> the figures of its metrics line.
std::map<int, Line> metrics(const std::string& run_dir) {
  std::map<int, Line> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto num = [&](const std::string& key) {
      const size_t at = line.find("\"" + key + "\": ");
      return at == std::string::npos ? NAN : std::stod(line.substr(at + key.size() + 4));
    };
    const int step = static_cast<int>(num("step"));
    EXPECT_EQ(out.count(step), 0u) << "step " << step << " logged twice";
    out[step] = {num("loss"), num("grad_norm"), num("z_loss")};
  }
  return out;
}

class CheckpointResume : public ::testing::Test {
 protected:
  // keel-train on `ranks` ranks (1: no mpiexec) with the job, `extra` and --run-dir `run`.
  CommandResult train(const std::string& run, int ranks, std::vector<std::string> extra = {}) {
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
  // Runs to step 20 straight, and killed at step 12 then resumed; expects both identical.
  // `writers`: the ranks that own something to save.
  void expect_bitwise_resume(int ranks, int writers, const std::vector<std::string>& layout) {
    const CommandResult a = train("straight", ranks, layout);
    ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
    std::vector<std::string> kill = layout;
    kill.insert(kill.end(), {"--set", "debug.kill_at_step=12", "--set",
                             "debug.kill_rank=" + std::to_string(ranks - 1)});
    const CommandResult b1 = train("resumed", ranks, kill);
    ASSERT_NE(b1.exit_code, 0) << b1.out << b1.err;
    // An async save of step 10 may still be in flight when the rank dies at step 12: then the
    // run resumes from step 5. A synchronous one is committed before step 11 starts.
    const bool async =
        std::find(layout.begin(), layout.end(), "checkpoint.async=true") != layout.end();
    const int from = fs::exists(ckpt("resumed", 10)) ? 10 : 5;
    ASSERT_TRUE(async || from == 10);
    ASSERT_TRUE(fs::exists(ckpt("resumed", 5)));
    ASSERT_FALSE(fs::exists(ckpt("resumed", 15)));
    const CommandResult b2 = train("resumed", ranks, layout);
    ASSERT_EQ(b2.exit_code, 0) << b2.out << b2.err;
    EXPECT_NE(b2.out.find("keel-train: resuming from " + ckpt("resumed", from) + " at step " +
                          std::to_string(from)),
              std::string::npos)
        << b2.out;
    const auto ma = metrics(dir_.file("straight")), mb = metrics(dir_.file("resumed"));
    ASSERT_EQ(ma.size(), 20u);
    ASSERT_EQ(mb.size(), 20u);  // steps 11 and 12 of the killed run are not logged twice
    for (const auto& [step, l] : ma) {
      SCOPED_TRACE(step);
      EXPECT_EQ(mb.at(step).loss, l.loss);  // %.17g round-trips: bit for bit
      EXPECT_EQ(mb.at(step).grad_norm, l.grad_norm);
      EXPECT_EQ(mb.at(step).z_loss, l.z_loss);
    }
    // The final checkpoint's files (parameters, AdamW m and v, manifest) are the same files with
    // the same bytes. Without ZeRO-1, ranks of DP rank > 0 hold only replicas and write none.
    auto listing = [](const std::string& dir) {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(dir)) {
        names.push_back(e.path().filename().string());
      }
      std::sort(names.begin(), names.end());
      return names;
    };
    const std::vector<std::string> names = listing(ckpt("straight", 20));
    EXPECT_EQ(listing(ckpt("resumed", 20)), names);
    EXPECT_EQ(names.size(), static_cast<size_t>(writers) + 1) << ::testing::PrintToString(names);
    for (const std::string& name : names) {
      EXPECT_EQ(read_file(ckpt("straight", 20) + "/" + name),
                read_file(ckpt("resumed", 20) + "/" + name))
          << name;
    }
  }
  void reshard(const std::vector<std::string>& model);
  TempDir dir_{"keel_ckpt_resume"};
};

TEST_F(CheckpointResume, BitwiseInOneProcess) { expect_bitwise_resume(1, 1, {}); }

TEST_F(CheckpointResume, BitwiseAtTp2Dp2) {
  expect_bitwise_resume(4, 2, {"--set", "parallel.tp=2"});
}

TEST_F(CheckpointResume, BitwiseAtTp2Dp2WithZero1) {
  expect_bitwise_resume(4, 4, {"--set", "parallel.tp=2", "--set", "parallel.zero_stage=1"});
}

// checkpoint.async (Note [async checkpoint]): the same bits as a synchronous save.
TEST_F(CheckpointResume, BitwiseWithAsyncSaveInOneProcess) {
  expect_bitwise_resume(1, 1, {"--set", "checkpoint.async=true"});
}

TEST_F(CheckpointResume, BitwiseWithAsyncSaveAtTp2Dp2) {
  expect_bitwise_resume(4, 2, {"--set", "parallel.tp=2", "--set", "checkpoint.async=true"});
}

TEST_F(CheckpointResume, BitwiseWithAsyncSaveAtTp2Dp2WithZero1) {
  expect_bitwise_resume(4, 4,
                        {"--set", "parallel.tp=2", "--set", "parallel.zero_stage=1", "--set",
                         "checkpoint.async=true"});
}

// A TP2xDP2 ZeRO-1 checkpoint resumes at 1 process, TP4, DP4 and DP2 + ZeRO-1: step 11's loss
// within 1e-6 relative of the unresharded run's, steps 12-15 within 1e-5. `model` may set a
// vocabulary that each TP size pads differently (Note [vocab padding]).
TEST_F(CheckpointResume, ReshardsToAnyLayout) { reshard({}); }

TEST_F(CheckpointResume, ReshardsAVocabularyEachTpSizePadsDifferently) {
  // 300 tokens: 300 rows at tp 1, 384 at tp 2, 512 at tp 4.
  reshard({"--set", "model.vocab_size=300"});
}

void CheckpointResume::reshard(const std::vector<std::string>& model) {
  std::vector<std::string> zero = {"--set", "parallel.tp=2", "--set", "parallel.zero_stage=1"};
  zero.insert(zero.begin(), model.begin(), model.end());
  ASSERT_EQ(train("straight", 4, zero).exit_code, 0);
  std::vector<std::string> kill = zero;
  kill.insert(kill.end(), {"--set", "debug.kill_at_step=11", "--set", "debug.kill_rank=0"});
  ASSERT_NE(train("saved", 4, kill).exit_code, 0);
  ASSERT_TRUE(fs::exists(ckpt("saved", 10)));
  const auto reference = metrics(dir_.file("straight"));
  struct Layout {
    int ranks;
    std::vector<std::string> sets;
  };
  for (const Layout& l : std::vector<Layout>{{1, {}},
                                             {4, {"--set", "parallel.tp=4"}},
                                             {4, {}},
                                             {2, {"--set", "parallel.zero_stage=1"}}}) {
    SCOPED_TRACE(l.ranks);
    std::vector<std::string> args = model;
    args.insert(args.end(), l.sets.begin(), l.sets.end());
    args.insert(args.end(), {"--resume-from", ckpt("saved", 10)});
    fs::remove_all(dir_.file("re"));
    const CommandResult r = train("re", l.ranks, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("at step 10 (written at dp 2 x tp 2, ZeRO-1)"), std::string::npos)
        << r.out;
    const auto m = metrics(dir_.file("re"));
    ASSERT_EQ(m.size(), 10u);  // steps 11..20
    EXPECT_NEAR(m.at(11).loss, reference.at(11).loss, 1e-6 * reference.at(11).loss);
    for (int s = 12; s <= 15; ++s) {
      EXPECT_NEAR(m.at(s).loss, reference.at(s).loss, 1e-5 * reference.at(s).loss) << s;
    }
  }
}

// Two checkpoints (steps 5 and 10), then the newest damaged in `damage`; the resumed run must
// name it and start from step 5.
class CorruptCheckpoint : public CheckpointResume,
                          public ::testing::WithParamInterface<const char*> {};

TEST_P(CorruptCheckpoint, IsNamedAndSkippedForThePreviousOne) {
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=12"}).exit_code, 0);
  const std::string newest = ckpt("run", 10);
  const std::string shard = newest + "/shard_00000.bin";
  const std::string how = GetParam();
  std::string expect;
  if (how == std::string("flip")) {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    char c = 0;
    f.read(&c, 1);
    f.seekp(1000);
    c ^= 0x10;
    f.write(&c, 1);
    expect = shard + ": tensor ";
  } else if (how == std::string("truncate")) {
    fs::resize_file(shard, fs::file_size(shard) - 100);
    expect = shard + ": ";
  } else if (how == std::string("delete_shard")) {
    fs::remove(shard);
    expect = shard + ": ";
  } else {
    fs::remove(newest + "/manifest.pb");
    expect = newest + "/manifest.pb: missing";
  }
  const CommandResult r = train("run", 1);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("keel-train: checkpoint " + newest + " is unusable: " + expect),
            std::string::npos)
      << r.out;
  if (how == std::string("flip")) {
    EXPECT_NE(r.out.find("checksum mismatch"), std::string::npos) << r.out;
  }
  if (how == std::string("truncate")) {
    EXPECT_NE(r.out.find("truncated"), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("resuming from " + ckpt("run", 5) + " at step 5"), std::string::npos)
      << r.out;
  const auto m = metrics(dir_.file("run"));
  EXPECT_EQ(m.size(), 20u);
  EXPECT_EQ(m.begin()->first, 1);
  EXPECT_EQ(m.rbegin()->first, 20);
}

INSTANTIATE_TEST_SUITE_P(Damage, CorruptCheckpoint,
                         ::testing::Values("flip", "truncate", "delete_shard", "delete_manifest"));

// A crash at each point of the save of step 10: the resumed run picks the newest whole
// checkpoint (step 10 once it was renamed into place, even with LATEST behind), no .tmp survives,
// and the run ends exactly as an uninterrupted one.
class CrashDuringSave : public CheckpointResume,
                        public ::testing::WithParamInterface<const char*> {};

TEST_P(CrashDuringSave, ResumesFromTheNewestWholeCheckpoint) {
  const std::string point = GetParam();
  ASSERT_EQ(train("straight", 1).exit_code, 0);
  const CommandResult crash =
      train("run", 1, {"--set", "debug.kill_at_step=10", "--set", "debug.fault_point=" + point});
  ASSERT_NE(crash.exit_code, 0) << crash.out << crash.err;
  EXPECT_NE(crash.err.find("killing this rank at step 10 (" + point + ")"), std::string::npos)
      << crash.err;
  const std::string root = dir_.file("run") + "/checkpoints";
  const bool renamed = point == "SAVE_BEFORE_LATEST";
  EXPECT_EQ(fs::exists(ckpt("run", 10)), renamed);
  EXPECT_EQ(fs::exists(ckpt("run", 10) + ".tmp"), !renamed);
  EXPECT_EQ(read_file(root + "/LATEST"), "step_00000005\n");  // never ahead of a whole save
  const CommandResult r = train("run", 1);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const int from = renamed ? 10 : 5;
  EXPECT_NE(r.out.find("resuming from " + ckpt("run", from) + " at step " + std::to_string(from)),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("removed 1 unfinished checkpoint(s)") != std::string::npos, !renamed)
      << r.out;
  for (const auto& e : fs::directory_iterator(root)) {
    EXPECT_EQ(e.path().extension(), "") << e.path();  // no .tmp or .old left
  }
  const auto a = metrics(dir_.file("straight")), b = metrics(dir_.file("run"));
  ASSERT_EQ(b.size(), 20u);
  for (const auto& [step, l] : a) EXPECT_EQ(b.at(step).loss, l.loss) << step;
  EXPECT_EQ(read_file(ckpt("straight", 20) + "/shard_00000.bin"),
            read_file(ckpt("run", 20) + "/shard_00000.bin"));
}

INSTANTIATE_TEST_SUITE_P(Points, CrashDuringSave,
                         ::testing::Values("SAVE_MID_SHARD", "SAVE_BEFORE_MANIFEST",
                                           "SAVE_BEFORE_LATEST"));

TEST_F(CheckpointResume, ResumeFromACorruptCheckpointExits2) {
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=12"}).exit_code, 0);
  fs::resize_file(ckpt("run", 10) + "/shard_00000.bin", 10);
  const CommandResult r = train("other", 1, {"--resume-from", ckpt("run", 10)});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("keel-train: data error: " + ckpt("run", 10) + "/shard_00000.bin: "),
            std::string::npos)
      << r.err;
}

TEST_F(CheckpointResume, AChangedModelOrOtherDataIsRefused) {
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=7"}).exit_code, 0);
  const CommandResult wider = train("run", 1, {"--set", "model.d_model=48"});
  EXPECT_EQ(wider.exit_code, 2) << wider.out << wider.err;
  EXPECT_NE(wider.err.find("cannot resume from it: tensor "), std::string::npos) << wider.err;
  EXPECT_NE(wider.err.find("a shape-determining model field changed"), std::string::npos);
  const CommandResult data = train("run", 1, {"--set", "data.builtin_seed=8"});
  EXPECT_EQ(data.exit_code, 2) << data.out << data.err;
  EXPECT_NE(data.err.find("it was trained on other data (xxh3:"), std::string::npos) << data.err;
}

// Model fields that keep every tensor's shape but change what the parameters compute: a smaller
// vocabulary still finds its rows in the stored table, RMSNORM would read a LayerNorm's gain, a
// post-sublayer block a pre-norm one's weights. Each exits 2 naming the field and both values.
TEST_F(CheckpointResume, AChangedModelFieldThatKeepsTheShapesIsRefused) {
  ASSERT_NE(
      train("run", 1, {"--set", "debug.kill_at_step=7", "--set", "model.vocab_size=300"}).exit_code,
      0);
  const CommandResult vocab = train("run", 1);  // the default vocabulary, 256
  EXPECT_EQ(vocab.exit_code, 2) << vocab.out << vocab.err;
  EXPECT_NE(vocab.err.find("cannot resume from it: it was written with model.vocab_size=300 and "
                           "this config has model.vocab_size=256"),
            std::string::npos)
      << vocab.err;
  for (const char* set : {"model.norm=RMSNORM", "model.norm_placement=POST_SUBLAYER"}) {
    const CommandResult r = train("run", 1, {"--set", "model.vocab_size=300", "--set", set});
    EXPECT_EQ(r.exit_code, 2) << set << ": " << r.out << r.err;
    const std::string field = std::string(set).substr(0, std::string(set).find('='));
    EXPECT_NE(r.err.find("it was written with " + field + "="), std::string::npos) << r.err;
  }
}

// Context extension: a run may resume with a longer model.seq_len (RoPE: no position table) and
// another model.rope_theta.
TEST_F(CheckpointResume, SeqLenAndRopeThetaMayChange) {
  ASSERT_NE(
      train("run", 1, {"--set", "debug.kill_at_step=7", "--set", "model.position=ROPE"}).exit_code,
      0);
  const CommandResult r = train("run", 1,
                                {"--set", "model.position=ROPE", "--set", "model.seq_len=32",
                                 "--set", "model.rope_theta=40000"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resuming from " + ckpt("run", 5) + " at step 5"), std::string::npos)
      << r.out;
}

TEST_F(CheckpointResume, NoResumeRefusesToClobberUnlessOverwrite) {
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=7"}).exit_code, 0);
  const CommandResult refused = train("run", 1, {"--no-resume"});
  EXPECT_EQ(refused.exit_code, 2) << refused.out << refused.err;
  EXPECT_NE(refused.err.find("holds 1 checkpoint(s), the newest at step 5: drop --no-resume"),
            std::string::npos)
      << refused.err;
  EXPECT_TRUE(fs::exists(ckpt("run", 5)));
  const CommandResult fresh = train("run", 1, {"--no-resume", "--overwrite"});
  EXPECT_EQ(fresh.exit_code, 0) << fresh.out << fresh.err;
  EXPECT_EQ(fresh.out.find("resuming"), std::string::npos);
  EXPECT_EQ(metrics(dir_.file("run")).size(), 20u);
}

TEST_F(CheckpointResume, AStaleTemporaryIsRemovedAndRetentionKeepsThePolicy) {
  fs::create_directories(dir_.file("run") + "/checkpoints/step_00000003.tmp");
  auto left = [&](const std::string& run) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_.file(run) + "/checkpoints")) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> policy = {"--set", "checkpoint.every=1",
                                           "--set", "checkpoint.keep=2",
                                           "--set", "checkpoint.keep_every=4"};
  std::vector<std::string> off = policy;
  off.insert(off.end(), {"--set", "spike.enabled=false"});
  const CommandResult r = train("run", 1, off);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("removed 1 unfinished checkpoint(s)"), std::string::npos) << r.out;
  EXPECT_EQ(left("run"),
            (std::vector<std::string>{"LATEST", "step_00000004", "step_00000008", "step_00000012",
                                      "step_00000016", "step_00000019", "step_00000020"}));
  EXPECT_EQ(read_file(dir_.file("run") + "/checkpoints/LATEST"), "step_00000020\n");
  // With the spike guard on, retention also keeps what it may rewind to: an anomaly at step 21
  // would go back to step 11 or before (spike.rewind_margin=10), so 11 and everything newer stay.
  const CommandResult g = train("guarded", 1, policy);
  ASSERT_EQ(g.exit_code, 0) << g.out << g.err;
  std::vector<std::string> expected = {"LATEST", "step_00000004", "step_00000008"};
  for (int s = 11; s <= 20; ++s) expected.push_back("step_000000" + std::to_string(s));
  EXPECT_EQ(left("guarded"), expected);
}

// Note [timed saves]: checkpoint.every_minutes is on by default (30 minutes), so a run saves at
// its end (and every 30 minutes) with checkpoint.every=0; both 0 save nothing.
TEST_F(CheckpointResume, ByDefaultARunEndsWithACheckpoint) {
  const CommandResult d = train("default", 1, {"--set", "checkpoint.every=0"});
  ASSERT_EQ(d.exit_code, 0) << d.out << d.err;
  EXPECT_TRUE(fs::exists(ckpt("default", 20)));
  EXPECT_EQ(read_file(dir_.file("default") + "/checkpoints/LATEST"), "step_00000020\n");
  EXPECT_NE(d.out.find("config.pbtxt, checkpoints/)"), std::string::npos) << d.out;
  const CommandResult again = train("default", 1, {"--set", "checkpoint.every=0"});
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("resuming from " + ckpt("default", 20) + " at step 20"),
            std::string::npos)
      << again.out;
  const CommandResult off =
      train("off", 1, {"--set", "checkpoint.every=0", "--set", "checkpoint.every_minutes=0"});
  ASSERT_EQ(off.exit_code, 0) << off.out << off.err;
  EXPECT_FALSE(fs::exists(dir_.file("off") + "/checkpoints/LATEST"));
  EXPECT_NE(off.out.find("config.pbtxt)"), std::string::npos) << off.out;
}

// A tiny checkpoint.every_minutes makes every step end past due: rank 0's verdict applies at the
// next step end on every rank alike, so steps 2 to 20 are saved, in one process and at TP2xDP2
// (a rank saving a step the others do not would hang the save's collectives).
TEST_F(CheckpointResume, SavesByWallClockOnEveryRankAlike) {
  for (int ranks : {1, 4}) {
    SCOPED_TRACE(ranks);
    const std::string run = "timed" + std::to_string(ranks);
    std::vector<std::string> args = {"--set", "checkpoint.every=0",
                                     "--set", "checkpoint.every_minutes=1e-9",
                                     "--set", "checkpoint.keep=100"};
    if (ranks == 4) args.insert(args.end(), {"--set", "parallel.tp=2"});
    const CommandResult r = train(run, ranks, args);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    for (int s = 1; s <= 20; ++s) EXPECT_EQ(fs::exists(ckpt(run, s)), s >= 2) << "step " << s;
  }
}

// Note [lineage]: --resume-from an older checkpoint of the run directory starts a new lineage
// there. The newer checkpoints of the branch it abandons are deleted (and the line says so), the
// logs lose the abandoned steps, and a plain restart afterwards resumes the new branch, never the
// higher-numbered abandoned one (the reproduction: steps 10, 15, 20; a branch from 10 to
// 13; a restart to 30).
TEST_F(CheckpointResume, ResumeFromAnOlderCheckpointStartsANewLineage) {
  const CommandResult first = train("run", 1);
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  ASSERT_TRUE(fs::exists(ckpt("run", 20)));
  const CommandResult branch =
      train("run", 1, {"--set", "train.steps=13", "--resume-from", ckpt("run", 10)});
  ASSERT_EQ(branch.exit_code, 0) << branch.out << branch.err;
  EXPECT_NE(branch.out.find("--resume-from " + ckpt("run", 10) +
                            ": a new lineage from step 10; deleted the 2 newer checkpoint(s) of "
                            "the branch it abandons (steps 15, 20)"),
            std::string::npos)
      << branch.out;
  EXPECT_FALSE(fs::exists(ckpt("run", 15)));
  EXPECT_FALSE(fs::exists(ckpt("run", 20)));
  EXPECT_EQ(read_file(dir_.file("run") + "/checkpoints/LATEST"), "step_00000013\n");
  auto m = metrics(dir_.file("run"));  // each step once (metrics() fails a step logged twice)
  ASSERT_EQ(m.size(), 13u);
  EXPECT_EQ(m.rbegin()->first, 13);

  const CommandResult restart = train("run", 1, {"--set", "train.steps=30"});
  ASSERT_EQ(restart.exit_code, 0) << restart.out << restart.err;
  EXPECT_NE(restart.out.find("resuming from " + ckpt("run", 13) + " at step 13"), std::string::npos)
      << restart.out;
  m = metrics(dir_.file("run"));
  ASSERT_EQ(m.size(), 30u);
  // keel-ckpt's current checkpoint is the same one.
  const CommandResult info =
      run_command(command_line(KEEL_CKPT_BIN, {"info", dir_.file("run")}), dir_);
  EXPECT_EQ(info.exit_code, 0) << info.out << info.err;
  EXPECT_NE(info.out.find(ckpt("run", 30)), std::string::npos) << info.out;
  // TensorBoard holds each step's loss once: the abandoned steps 14..20 were dropped on resume.
  std::map<int64_t, int> loss_points;
  for (const auto& e : fs::directory_iterator(dir_.file("run") + "/tensorboard")) {
    for (const TensorBoardEvent& ev : read_tensorboard_events(e.path().string())) {
      for (const TensorBoardValue& v : ev.values) loss_points[ev.step] += v.tag == "train/loss";
    }
  }
  ASSERT_EQ(loss_points.size(), 30u);
  for (const auto& [step, n] : loss_points) EXPECT_EQ(n, 1) << "step " << step;
}

// --resume-from another run's checkpoint into a run directory with checkpoints of its own would
// mix two histories: refused (exit 2) unless --overwrite deletes them.
TEST_F(CheckpointResume, ResumeFromAnotherRunsCheckpointNeedsAnEmptyStore) {
  ASSERT_EQ(train("donor", 1).exit_code, 0);
  ASSERT_NE(train("run", 1, {"--set", "debug.kill_at_step=7"}).exit_code, 0);
  const CommandResult refused = train("run", 1, {"--resume-from", ckpt("donor", 10)});
  EXPECT_EQ(refused.exit_code, 2) << refused.out << refused.err;
  EXPECT_NE(refused.err.find("holds 1 checkpoint(s) of another history (the newest at step 5): "
                             "--resume-from " +
                             ckpt("donor", 10)),
            std::string::npos)
      << refused.err;
  EXPECT_TRUE(fs::exists(ckpt("run", 5)));
  const CommandResult ok = train("run", 1, {"--resume-from", ckpt("donor", 10), "--overwrite"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("resuming from " + ckpt("donor", 10) + " at step 10"), std::string::npos)
      << ok.out;
  EXPECT_FALSE(fs::exists(ckpt("run", 5)));
  EXPECT_TRUE(fs::exists(ckpt("run", 20)));
}

}  // namespace
}  // namespace keel
