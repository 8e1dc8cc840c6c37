// Write failures in the run directory, through the real keel-train: a run directory that cannot be
// created, a metrics file on a full disk (/dev/full), and a disk that fills up mid-run (a tiny
// tmpfs mounted over the run directory in a private mount namespace: a short write, then ENOSPC).
// Each ends the run with exit 1 and one line naming the file and the OS reason, and leaves no
// half-written file: config.pbtxt is whole or absent, and metrics.jsonl ends with a complete line.
// (A file-size limit cannot stand in for the full disk: it also limits MPI's shared-memory files.)
// An async checkpoint write that fails is reported, leaves LATEST on the previous checkpoint and
// makes the run exit 1 when no later save succeeds.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;
using testing::write_file;

const std::vector<std::string> kTiny = {
    "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set",
    "model.seq_len=16", "--set", "train.global_batch=4", "--set", "train.eval_every=0", "--set",
    "train.sample_chars=0", "--set", "train.log_every=1", "--set", "data.builtin_bytes=20000",
    "--set", "train.threads=1",
    // Only metrics.jsonl and config.pbtxt compete for the tiny disks below.
    "--set", "train.tensorboard=false", "--set", "train.plot=false"};

class RunDirErrors : public ::testing::Test {
 protected:
  // keel-train on the tiny job for `steps` steps into `run_dir`, under `prefix` (a shell snippet
  // run before it in the same shell) and `wrapper` (a command the shell runs under).
  CommandResult train(const std::string& run_dir, int steps, const std::string& prefix = "",
                      const std::string& wrapper = "") {
    std::vector<std::string> args = kTiny;
    args.insert(args.end(),
                {"--set", "train.steps=" + std::to_string(steps), "--run-dir", run_dir});
    return run_command(
        wrapper + "bash -c " + shell_quote(prefix + command_line(KEEL_TRAIN_BIN, args)), dir_);
  }

  // The one keel-train line on stderr (and that there is exactly one).
  static std::string one_line(const CommandResult& r) {
    size_t n = 0;
    for (size_t at = r.err.find("keel-train: "); at != std::string::npos;
         at = r.err.find("keel-train: ", at + 1)) {
      ++n;
    }
    EXPECT_EQ(n, 1u) << r.err;
    for (const char* marker : {"terminate called", "what():", "Aborted", "core dumped"}) {
      EXPECT_EQ(r.err.find(marker), std::string::npos) << r.err;
    }
    const size_t at = r.err.find("keel-train: ");
    return at == std::string::npos ? "" : r.err.substr(at, r.err.find('\n', at) - at);
  }

  TempDir dir_{"keel_run_dir_errors"};
};

TEST_F(RunDirErrors, ARunDirectoryUnderAFileCannotBeCreated) {
  write_file(dir_.file("plain_file"), "x");
  const std::string run_dir = dir_.file("plain_file/run");
  const CommandResult r = train(run_dir, 2);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(one_line(r),
            "keel-train: io error: " + run_dir + ": cannot create run directory: Not a directory");
}

TEST_F(RunDirErrors, MetricsOnAFullDiskNameTheFile) {
  const std::string run_dir = dir_.file("run");
  std::filesystem::create_directories(run_dir);
  std::filesystem::create_symlink("/dev/full", run_dir + "/metrics.jsonl");
  const CommandResult r = train(run_dir, 3);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(one_line(r), "keel-train: io error: " + run_dir +
                             "/metrics.jsonl: write failed: No space left on device");
}

// Runs keel-train with the run directory on a 12 KiB tmpfs (three pages: the run-directory lock,
// config.pbtxt and metrics.jsonl take one each) in a private mount namespace; `fill` bytes of
// another file are written there first. What the run left is copied to `out` before the namespace
// goes away. Skips where mounting is not allowed.
#define TRAIN_ON_TINY_DISK(result, steps, fill, out)                                              \
  const std::string run_dir = dir_.file("run");                                                   \
  std::filesystem::create_directories(run_dir);                                                   \
  std::filesystem::create_directories(out);                                                       \
  if (run_command("unshare -m sh -c " +                                                           \
                      shell_quote("mount -t tmpfs -o size=8k tmpfs " + shell_quote(run_dir)),     \
                  dir_)                                                                           \
          .exit_code != 0) {                                                                      \
    GTEST_SKIP() << "cannot mount a tmpfs in a private mount namespace here";                     \
  }                                                                                               \
  const CommandResult result = train(                                                             \
      run_dir, steps,                                                                             \
      "mount -t tmpfs -o size=12k tmpfs " + shell_quote(run_dir) + " || exit 99; " + "head -c " + \
          std::to_string(fill) + " /dev/zero > " + shell_quote(run_dir) +                         \
          "/filler; trap 'cp -a " + shell_quote(run_dir) + "/. " + shell_quote(out) + "' EXIT; ", \
      "unshare -m ")

TEST_F(RunDirErrors, AFullDiskMidRunLeavesWholeLinesInMetrics) {
  const std::string out = dir_.file("left");
  // .lock and config.pbtxt take one page each; metrics.jsonl fills the third after about 18
  // lines.
  TRAIN_ON_TINY_DISK(r, 60, 0, out);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(one_line(r), "keel-train: io error: " + run_dir +
                             "/metrics.jsonl: write failed: No space left on device");
  const std::string metrics = read_file(out + "/metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(metrics.back(), '\n');
  std::istringstream lines(metrics);
  int n = 0;
  for (std::string line; std::getline(lines, line); ++n) {
    EXPECT_EQ(line.rfind("{\"step\": " + std::to_string(n + 1) + ", ", 0), 0u) << line;
    EXPECT_EQ(line.back(), '}') << line;
  }
  EXPECT_GE(n, 5);
  EXPECT_LT(n, 60);
  EXPECT_EQ(read_file(out + "/config.pbtxt").find("model {"), 0u);
}

TEST_F(RunDirErrors, AConfigThatCannotBeWrittenLeavesNoFile) {
  const std::string out = dir_.file("left");
  TRAIN_ON_TINY_DISK(r, 2, 12288, out);  // the disk is full before the run starts
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_EQ(one_line(r), "keel-train: io error: " + run_dir +
                             "/config.pbtxt: write failed: No space left on device");
  // Neither a 0-byte config.pbtxt nor its temporary file is left behind: only the filler and the
  // run-directory lock (created first; its "host pid" line did not fit, and need not).
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(out)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lock", "filler"}));
}

// checkpoint.async on a disk with room for one checkpoint (252 KiB) but not two: the save of
// step 2 commits; the background writes of steps 4 and 6 fail with ENOSPC, each reported in one
// line while training goes on; their .tmp directories are removed, LATEST keeps naming step 2
// (whole: it verifies), every step is logged, and the run exits 1 because nothing after step 2
// was saved.
TEST_F(RunDirErrors, AFailedAsyncSaveIsReportedAndNeverCorruptsLatest) {
  const std::string run_dir = dir_.file("run"), out = dir_.file("left");
  std::filesystem::create_directories(run_dir);
  std::filesystem::create_directories(out);
  if (run_command("unshare -m sh -c " +
                      shell_quote("mount -t tmpfs -o size=8k tmpfs " + shell_quote(run_dir)),
                  dir_)
          .exit_code != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs in a private mount namespace here";
  }
  std::vector<std::string> args = kTiny;
  args.insert(args.end(),
              {"--set", "train.steps=6", "--set", "checkpoint.every=2", "--set",
               "checkpoint.keep=1", "--set", "checkpoint.async=true", "--run-dir", run_dir});
  const CommandResult r = run_command(
      "unshare -m bash -c " +
          shell_quote("mount -t tmpfs -o size=400k tmpfs " + shell_quote(run_dir) +
                      " || exit 99; trap 'cp -a " + shell_quote(run_dir) + "/. " +
                      shell_quote(out) + "' EXIT; " + command_line(KEEL_TRAIN_BIN, args)),
      dir_);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const std::string ckpts = run_dir + "/checkpoints";
  std::string expected;
  for (int step : {4, 6}) {
    expected += "keel-train: rank 0: checkpoint of step " + std::to_string(step) +
                " not saved: " + ckpts + "/step_0000000" + std::to_string(step) +
                ".tmp/shard_00000.bin: write failed: No space left on device (training goes on; "
                "LATEST still names the previous checkpoint)\n";
  }
  expected +=
      "keel-train: io error: the checkpoint of step 6 failed (see above) and no later one "
      "succeeded: the run's last steps are not saved\n";
  EXPECT_EQ(r.err, expected);
  EXPECT_NE(r.out.find("keel-train: saved checkpoint " + ckpts + "/step_00000002 (async"),
            std::string::npos)
      << r.out;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(out + "/checkpoints")) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"LATEST", "step_00000002"}));
  EXPECT_EQ(read_file(out + "/checkpoints/LATEST"), "step_00000002\n");
  const CommandResult v =
      run_command(command_line(KEEL_CKPT_BIN, {"verify", out + "/checkpoints"}), dir_);
  EXPECT_EQ(v.exit_code, 0) << v.out << v.err;
  std::istringstream lines(read_file(out + "/metrics.jsonl"));
  int n = 0;
  for (std::string line; std::getline(lines, line);) ++n;
  EXPECT_EQ(n, 6);
}

}  // namespace
}  // namespace keel
