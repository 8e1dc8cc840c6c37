// Note [run-directory lock]: one job per run directory. In process: a second RunDirLock on a
// locked directory is refused naming this host and pid, the lock is free again once its holder
// is gone, and a FIFO or a symlink planted as the lock file is refused rather than followed.
// Through keel-train: a second job on a run directory in use exits 2 naming the first job's pid
// and touches nothing (the first job's metrics lines all stay); after the first is killed with
// SIGKILL the kernel has released its lock, so the same command resumes at once.
#include "launch/train/run_lock.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "framework/error.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;

std::string host() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

TEST(RunDirLock, ASecondHolderIsRefusedUntilTheFirstIsGone) {
  TempDir dir("keel_run_lock");
  const std::string run = dir.file("run");
  auto first = std::make_unique<RunDirLock>(run);  // creates the directory
  EXPECT_TRUE(first->unsupported().empty()) << first->unsupported();
  EXPECT_TRUE(fs::is_regular_file(run + "/.lock"));
  try {
    RunDirLock second(run);
    FAIL() << "a second lock on a locked run directory was granted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    const std::string what = e.what();
    EXPECT_NE(what.find(run + ": another keel-train job is using this run directory (host " +
                        host() + ", pid " + std::to_string(getpid()) + ", for "),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("pass another --run-dir"), std::string::npos) << what;
  }
  first.reset();
  EXPECT_NO_THROW(RunDirLock again(run));
}

TEST(RunDirLock, AFifoOrASymlinkInPlaceOfTheLockIsRefused) {
  TempDir dir("keel_run_lock");
  const std::string fifo_run = dir.file("fifo");
  fs::create_directories(fifo_run);
  ASSERT_EQ(mkfifo((fifo_run + "/.lock").c_str(), 0644), 0);
  try {
    RunDirLock lock(fifo_run);  // must not block on the FIFO
    FAIL() << "a FIFO was accepted as the lock";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              fifo_run + "/.lock: not a regular file (the run directory's lock)");
  }
  const std::string link_run = dir.file("link");
  fs::create_directories(link_run);
  fs::create_symlink("/dev/null", link_run + "/.lock");
  EXPECT_THROW(RunDirLock lock(link_run), Error);
}

const std::vector<std::string> kJob = {
    "--set", "model.d_model=32",     "--set", "model.n_layers=1",
    "--set", "model.n_heads=2",      "--set", "model.seq_len=16",
    "--set", "train.global_batch=4", "--set", "data.builtin_bytes=50000",
    "--set", "train.log_every=1",    "--set", "train.eval_every=0",
    "--set", "train.sample_chars=0", "--set", "checkpoint.every=0",
    "--set", "train.threads=1",      "--set", "train.plot=false"};

TEST(RunDirLock, ASecondJobOnARunDirectoryInUseExits2AndTouchesNothing) {
  TempDir dir("keel_run_lock");
  const std::string run = dir.file("run");
  std::vector<std::string> long_job = kJob;
  long_job.insert(long_job.end(), {"--set", "train.steps=1000000", "--run-dir", run});
  std::vector<std::string> short_job = kJob;
  short_job.insert(short_job.end(), {"--set", "train.steps=20", "--run-dir", run});
  // The first job runs in the background until its first metrics line is written; then the
  // second one starts on the same directory; then the first is killed with SIGKILL (no clean-up
  // of any kind) and the same command runs again.
  const std::string script =
      testing::command_line(KEEL_TRAIN_BIN, long_job) + " >first.out 2>&1 & pid=$!; " +
      "for i in $(seq 1200); do [ -s " + shell_quote(run + "/metrics.jsonl") +
      " ] && break; sleep 0.05; done; " + testing::command_line(KEEL_TRAIN_BIN, short_job) +
      " >second.out 2>second.err; echo \"second=$? pid=$pid\"; "
      "head -c 60 " +
      shell_quote(run + "/metrics.jsonl") + "; echo; " + "kill -9 $pid; wait $pid 2>/dev/null; " +
      testing::command_line(KEEL_TRAIN_BIN, short_job) + " >third.out 2>&1; echo \"third=$?\"";
  const CommandResult r = run_command("sh -c " + shell_quote(script), dir);
  const std::string second_err = read_file(dir.file("second.err"));
  const size_t at = r.out.find("second=");
  ASSERT_NE(at, std::string::npos) << r.out << r.err;
  int second = -1;
  long long pid = -1;
  ASSERT_EQ(std::sscanf(r.out.c_str() + at, "second=%d pid=%lld", &second, &pid), 2) << r.out;
  EXPECT_EQ(second, 2) << second_err << read_file(dir.file("second.out"));
  EXPECT_EQ(second_err, "keel-train: usage error: " + run +
                            ": another keel-train job is using this run directory (host " + host() +
                            ", pid " + std::to_string(pid) +
                            second_err.substr(second_err.find(", for "), std::string::npos));
  EXPECT_NE(second_err.find(" s): one job per run directory"), std::string::npos) << second_err;
  // The first job's log was not truncated or renamed over by the second: it starts at step 1.
  EXPECT_NE(r.out.find("{\"step\": 1,"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("third=0"), std::string::npos) << r.out << read_file(dir.file("third.out"));
}

}  // namespace
}  // namespace keel
