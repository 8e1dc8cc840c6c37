// Preemption through the real binaries (Note [preemption] in launch/stop_signals.cc): SIGTERM to
// one rank of a TP2 job under mpiexec -n 2 mid-run saves the step every rank agreed on and exits
// 0, and the resumed run's losses and final checkpoint equal the uninterrupted run's bit for bit;
// SIGUSR1 does the same in one process; SIGUSR1 to mpiexec reaches every rank at once (they save,
// stop, and the next run resumes there), SIGTERM to it after odls_base_sigkill_timeout seconds. In
// process: a second stop signal ends the process at once, and the watchdog names a collective
// still stuck after the signal (and stays quiet about one that completes).
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "launch/stop_signals.h"
#include "parallel/watchdog.h"
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
    "--set", "model.d_model=32",     "--set", "model.n_layers=1",
    "--set", "model.n_heads=2",      "--set", "model.seq_len=16",
    "--set", "train.global_batch=4", "--set", "data.builtin_bytes=50000",
    "--set", "train.log_every=1",    "--set", "train.eval_every=0",
    "--set", "train.sample_chars=0", "--set", "train.threads=1",
    "--set", "parallel.tp=2",        "--set", "checkpoint.every=100"};

const char* kMpiEnv = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";

// step -> its metrics line without the timing fields (everything a step computes).
std::map<int, std::string> losses(const std::string& run_dir) {
  std::map<int, std::string> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  const std::regex timing(", \"(seconds|tokens_per_s|elapsed_s|comm_[a-z_]+|[a-z_]*_s)\": [^,}]*");
  for (std::string line; std::getline(in, line);) {
    const int step = std::stoi(line.substr(line.find(':') + 1));
    EXPECT_EQ(out.count(step), 0u) << "step " << step << " logged twice";
    out[step] = std::regex_replace(line, timing, "");
  }
  return out;
}

class Preemption : public ::testing::Test {
 protected:
  std::string job(int steps, const std::string& run, std::vector<std::string> extra = {}) const {
    std::vector<std::string> args = kJob;
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(),
                {"--set", "train.steps=" + std::to_string(steps), "--run-dir", dir_.file(run)});
    return command_line(KEEL_TRAIN_BIN, args);
  }
  std::string mpiexec(const std::string& opts) const {
    return kMpiEnv + shell_quote(KEEL_MPIEXEC) + " -n 2 --oversubscribe --bind-to none " + opts +
           " ";
  }
  // Starts `command` in the background, waits until the shell test `ready` holds, sends `signal`
  // to `target` ("job": the launched process; "rank": its newest child), waits for it and prints
  // "rc=N" on stdout.
  CommandResult signalled(const std::string& command, const std::string& ready,
                          const std::string& signal, const std::string& target) {
    const std::string victim = target == "job" ? "$P" : "$(pgrep -n -P $P)";
    const std::string script = command + " & P=$!; until " + ready +
                               "; do kill -0 $P 2>/dev/null || break; sleep 0.02; done; kill -" +
                               signal + " " + victim + "; wait $P; echo rc=$?";
    return run_command("sh -c " + shell_quote(script), dir_);
  }
  // A shell test: run `run` has logged at least `lines` steps in metrics.jsonl.
  std::string logged(const std::string& run, int lines) const {
    return "[ \"$(cat " + shell_quote(dir_.file(run) + "/metrics.jsonl") +
           " 2>/dev/null | wc -l)\" -ge " + std::to_string(lines) + " ]";
  }
  static int stopped_step(const CommandResult& r, const std::string& signal) {
    std::smatch m;
    const std::regex line("keel-train: stopped by " + signal +
                          " \\(received by rank [01]\\) after step ([0-9]+): checkpoint (\\S+) "
                          "saved; run the same command to resume\n");
    if (!std::regex_search(r.out, m, line)) return -1;
    return std::stoi(m[1]);
  }
  std::string ckpt(const std::string& run, int step) const {
    char name[32];
    std::snprintf(name, sizeof(name), "step_%08d", step);
    return dir_.file(run) + "/checkpoints/" + name;
  }
  TempDir dir_{"keel_preempt"};
};

TEST_F(Preemption, SigtermToOneRankSavesExitsZeroAndResumesBitForBit) {
  constexpr int kSteps = 600;
  const CommandResult a = run_command(mpiexec("") + job(kSteps, "straight"), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;

  const CommandResult b =
      signalled(mpiexec("") + job(kSteps, "stopped"), logged("stopped", 20), "TERM", "rank");
  EXPECT_NE(b.out.find("rc=0"), std::string::npos) << b.out << b.err;
  const int s = stopped_step(b, "SIGTERM");
  ASSERT_GE(s, 20) << b.out << b.err;
  ASSERT_LT(s, kSteps) << "the run ended before the signal; make it longer";
  EXPECT_EQ(read_file(dir_.file("stopped") + "/checkpoints/LATEST"),
            fs::path(ckpt("stopped", s)).filename().string() + "\n");
  EXPECT_EQ(losses(dir_.file("stopped")).size(), static_cast<size_t>(s));
  EXPECT_EQ(b.err.find("communication error"), std::string::npos) << b.err;

  const CommandResult c = run_command(mpiexec("") + job(kSteps, "stopped"), dir_);
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  EXPECT_NE(c.out.find("keel-train: resuming from " + ckpt("stopped", s) + " at step " +
                       std::to_string(s)),
            std::string::npos)
      << c.out;
  const auto la = losses(dir_.file("straight")), lb = losses(dir_.file("stopped"));
  ASSERT_EQ(la.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(lb, la);  // %.17g: bit for bit, every step
  for (const char* shard : {"/shard_00000.bin", "/shard_00001.bin", "/manifest.pb"}) {
    EXPECT_EQ(read_file(ckpt("stopped", kSteps) + shard),
              read_file(ckpt("straight", kSteps) + shard))
        << shard;
  }
}

TEST_F(Preemption, SigusrOneInOneProcessSavesAndExitsZero) {
  const CommandResult r =
      signalled(job(100000, "one", {"--set", "parallel.tp=1"}), logged("one", 10), "USR1", "job");
  EXPECT_NE(r.out.find("rc=0"), std::string::npos) << r.out << r.err;
  const int s = stopped_step(r, "SIGUSR1");
  ASSERT_GE(s, 10) << r.out << r.err;
  EXPECT_TRUE(fs::exists(ckpt("one", s) + "/manifest.pb"));
}

TEST_F(Preemption, SigusrOneToMpiexecReachesEveryRankAndTheRunResumes) {
  // mpirun forwards SIGUSR1 to every rank at once and exits 0 with them.
  const CommandResult r =
      signalled(mpiexec("") + job(1000000, "usr1", {"--set", "train.log_every=50"}),
                logged("usr1", 2), "USR1", "job");
  EXPECT_NE(r.out.find("rc=0"), std::string::npos) << r.out << r.err;
  const int s = stopped_step(r, "SIGUSR1");
  ASSERT_GE(s, 100) << r.out << r.err;
  EXPECT_EQ(read_file(dir_.file("usr1") + "/checkpoints/LATEST"),
            fs::path(ckpt("usr1", s)).filename().string() + "\n");
  // train.steps may grow on resume: three more, each logged.
  const CommandResult c = run_command(mpiexec("") + job(s + 3, "usr1"), dir_);
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  EXPECT_NE(
      c.out.find("keel-train: resuming from " + ckpt("usr1", s) + " at step " + std::to_string(s)),
      std::string::npos)
      << c.out;
  const auto logged = losses(dir_.file("usr1"));
  EXPECT_EQ(logged.size(), static_cast<size_t>(s / 50 + 3));
  EXPECT_EQ(logged.rbegin()->first, s + 3);
}

TEST_F(Preemption, SigtermToMpiexecReachesEveryRankAfterTheKillTimeout) {
  // mpirun forwards SIGTERM odls_base_sigkill_timeout seconds after it gets it, and SIGKILLs
  // that many seconds later: the ranks save in between. While it waits it relays no output, so
  // a rank that prints more than the pseudo-terminal holds (4 KiB) blocks: this job prints
  // little (no progress lines, a checkpoint line every 1000 steps).
  const CommandResult r = signalled(
      mpiexec("--mca odls_base_sigkill_timeout 3") +
          job(10000000, "term",
              {"--set", "train.log_every=100000000", "--set", "checkpoint.every=1000"}),
      "[ -e " + shell_quote(dir_.file("term") + "/checkpoints/LATEST") + " ]", "TERM", "job");
  const int s = stopped_step(r, "SIGTERM");
  ASSERT_GE(s, 1000) << r.out << r.err;
  EXPECT_EQ(read_file(dir_.file("term") + "/checkpoints/LATEST"),
            fs::path(ckpt("term", s)).filename().string() + "\n");
  EXPECT_EQ(run_command(command_line(KEEL_CKPT_BIN, {"verify", ckpt("term", s)}), dir_).exit_code,
            0);
  EXPECT_EQ(r.err.find("communication error"), std::string::npos) << r.err;
}

TEST(StopSignals, TheFirstSignalIsRecordedAndASecondEndsTheProcess) {
  EXPECT_EXIT(
      {
        StopSignals signals(5);
        raise(SIGTERM);
        if (StopSignals::received() != SIGTERM) std::_Exit(3);
        raise(SIGUSR1);
        std::_Exit(4);  // not reached
      },
      ::testing::KilledBySignal(SIGUSR1),
      "keel-train: rank 5: a second stop signal: ending now, without saving");
  {
    StopSignals signals(0);
    EXPECT_EQ(StopSignals::received(), 0);
  }
}

TEST(StopSignals, TheWatchdogNamesACollectiveStuckAfterTheSignal) {
  Watchdog w(30.0, 3);
  w.set_step(7);
  ::testing::internal::CaptureStderr();
  // A collective that completes soon after the signal: no line.
  w.begin("all_reduce", "data-parallel");
  Watchdog::note_stop_signal(SIGTERM);
  w.end();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  // One that stays stuck: the line, once.
  w.begin("all_gather", "tensor-parallel");
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  w.end();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "keel-train: communication error: rank 3: all_gather over the tensor-parallel group "
            "at step 7 did not complete within 0.25 s of SIGTERM (another rank failed or was "
            "killed, or the job was cancelled); waiting for it, to save the checkpoint if it "
            "completes\n");
}

}  // namespace
}  // namespace keel
