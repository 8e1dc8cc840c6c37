// Preemption through the real binaries (Note [preemption] in launch/train/stop_signals.cc): SIGTERM
// to one rank of a TP2 job under mpiexec -n 2 mid-run saves the step every rank agreed on and exits
// 0, and the resumed run's losses and final checkpoint equal the uninterrupted run's bit for bit;
// SIGUSR1 does the same in one process; SIGUSR1 to mpiexec reaches every rank at once (they save,
// stop, and the next run resumes there), SIGTERM to it after odls_base_sigkill_timeout seconds;
// SIGTERM twice in a row (srun and slurmstepd) to one process saves a checkpoint that verifies,
// exits 0, and the run resumes. In process: the same signal again within the window is ignored,
// after it or a different one ends the process at once, and the watchdog names a collective
// still stuck after the signal (and stays quiet about one that completes). No test assumes how
// many steps a machine takes before a signal: the step each run stopped at is read from its
// output, and the uninterrupted run is sized from it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "launch/train/stop_signals.h"
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
  // The stopped run is planned far longer than it lives, so no machine finishes it before the
  // signal; a constant learning rate (train.steps does not enter it) lets the resumed and the
  // uninterrupted runs then end at a step sized from where it stopped: two checkpoints later,
  // so both final checkpoints have the same parent.
  const std::vector<std::string> constant_lr = {"--set", "optim.schedule=CONSTANT"};
  const CommandResult b = signalled(mpiexec("") + job(100000000, "stopped", constant_lr),
                                    logged("stopped", 20), "TERM", "rank");
  EXPECT_NE(b.out.find("rc=0"), std::string::npos) << b.out << b.err;
  const int s = stopped_step(b, "SIGTERM");
  ASSERT_GE(s, 20) << b.out << b.err;
  EXPECT_EQ(read_file(dir_.file("stopped") + "/checkpoints/LATEST"),
            fs::path(ckpt("stopped", s)).filename().string() + "\n");
  EXPECT_EQ(losses(dir_.file("stopped")).size(), static_cast<size_t>(s));
  EXPECT_EQ(b.err.find("communication error"), std::string::npos) << b.err;

  const int steps = (s / 100 + 2) * 100;  // checkpoint.every=100
  const CommandResult c = run_command(mpiexec("") + job(steps, "stopped", constant_lr), dir_);
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  EXPECT_NE(c.out.find("keel-train: resuming from " + ckpt("stopped", s) + " at step " +
                       std::to_string(s)),
            std::string::npos)
      << c.out;
  const CommandResult a = run_command(mpiexec("") + job(steps, "straight", constant_lr), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  const auto la = losses(dir_.file("straight")), lb = losses(dir_.file("stopped"));
  ASSERT_EQ(la.size(), static_cast<size_t>(steps));
  EXPECT_EQ(lb, la);  // %.17g: bit for bit, every step
  for (const char* shard : {"/shard_00000.bin", "/shard_00001.bin", "/manifest.pb"}) {
    EXPECT_EQ(read_file(ckpt("stopped", steps) + shard), read_file(ckpt("straight", steps) + shard))
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
  // What the two runs logged, counted from the file rather than predicted: the stopped run every
  // 50th step up to s and any step the spike guard flagged (logged whatever train.log_every
  // says), the resumed run s+1..s+3; each step once (losses() checks that).
  const auto logged = losses(dir_.file("usr1"));
  for (int step = 50; step <= s; step += 50) EXPECT_EQ(logged.count(step), 1u) << "step " << step;
  for (int step = s + 1; step <= s + 3; ++step) EXPECT_EQ(logged.count(step), 1u) << step;
  for (const auto& [step, line] : logged) {
    EXPECT_TRUE(step > s || step % 50 == 0 || line.find("\"anomaly\": ") != std::string::npos)
        << "step " << step << " logged by a run with train.log_every=50: " << line;
  }
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

TEST_F(Preemption, SigtermTwiceInARowSavesExitsZeroAndResumes) {
  // srun and slurmstepd each send SIGTERM. The second must arrive after the first was taken
  // (signals of one kind pending together merge into one) and before the process ends,
  // whatever the machine's speed: an alert hook (the NaN injected at step 3 raises one) that
  // waits for GO keeps the process alive at its end, and /proc/PID/status's ShdPnd shows when a
  // handler has taken each SIGTERM (bit 14). GO comes only after the second was taken.
  const std::string started = dir_.file("STARTED"), go = dir_.file("GO");
  const std::string hook = "touch " + shell_quote(started) + "; while [ ! -e " + shell_quote(go) +
                           " ]; do sleep 0.05; done";
  const std::string command = job(100000, "twice",
                                  {"--set", "parallel.tp=1", "--set", "debug.inject_nan_at_step=3",
                                   "--set", "alert.command=" + hook, "--set", "alert.timeout_s=100",
                                   "--set", "alert.drain_timeout_s=100"});
  const std::string taken =
      "m=$(awk '/^ShdPnd:/ {print $2}' /proc/$P/status 2>/dev/null); "
      "[ -z \"$m\" ] || [ $((0x$m & 0x4000)) -eq 0 ]";
  const std::string script =
      command + " & P=$!; until [ -e " + shell_quote(started) + " ] && " + logged("twice", 10) +
      "; do kill -0 $P 2>/dev/null || break; sleep 0.02; done; kill -TERM $P; until " + taken +
      "; do sleep 0.01; done; kill -TERM $P; until " + taken + "; do sleep 0.01; done; touch " +
      shell_quote(go) + "; wait $P; echo rc=$?";
  const CommandResult r = run_command("sh -c " + shell_quote(script), dir_);
  EXPECT_NE(r.out.find("rc=0"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("keel-train: rank 0: SIGTERM again within 5 s of the first: ignored; "
                       "saving and stopping as the first asked"),
            std::string::npos)
      << r.err;
  const int s = stopped_step(r, "SIGTERM");
  ASSERT_GE(s, 10) << r.out << r.err;
  EXPECT_EQ(read_file(dir_.file("twice") + "/checkpoints/LATEST"),
            fs::path(ckpt("twice", s)).filename().string() + "\n");
  EXPECT_EQ(run_command(command_line(KEEL_CKPT_BIN, {"verify", ckpt("twice", s)}), dir_).exit_code,
            0);

  const CommandResult c = run_command(job(s + 3, "twice", {"--set", "parallel.tp=1"}), dir_);
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  EXPECT_NE(
      c.out.find("keel-train: resuming from " + ckpt("twice", s) + " at step " + std::to_string(s)),
      std::string::npos)
      << c.out;
  const auto logged = losses(dir_.file("twice"));
  EXPECT_EQ(logged.size(), static_cast<size_t>(s + 3));  // train.log_every=1: every step once
  EXPECT_EQ(logged.rbegin()->first, s + 3);
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

TEST(StopSignals, TheSameSignalAgainWithinTheWindowIsIgnored) {
  // raise() runs the handler before it returns, so the repeat comes microseconds after the
  // first: well within StopSignals::kRepeatWindowSeconds.
  EXPECT_EXIT(
      {
        StopSignals signals(5);
        raise(SIGTERM);
        raise(SIGTERM);  // ignored
        raise(SIGTERM);  // so is a third
        if (StopSignals::received() != SIGTERM) std::_Exit(3);
        raise(SIGUSR1);  // the other stop signal ends it
        std::_Exit(4);   // not reached
      },
      ::testing::KilledBySignal(SIGUSR1),
      "keel-train: rank 5: SIGTERM again within 5 s of the first: ignored; saving and stopping "
      "as the first asked .SIGUSR1, or SIGTERM after 5 s, ends the process at once.\n"
      "keel-train: rank 5: SIGTERM again within 5 s of the first: ignored; .*\n"
      "keel-train: rank 5: a second stop signal: ending now, without saving");
}

TEST(StopSignals, TheSameSignalAfterTheWindowEndsTheProcess) {
  static_assert(StopSignals::kRepeatWindowSeconds == 5,
                "docs/checkpoints.md and the lines say 5 s");
  EXPECT_EXIT(
      {
        StopSignals signals(2);
        raise(SIGUSR1);
        // A monotonic clock: at least this long has passed, however slow the machine.
        std::this_thread::sleep_for(std::chrono::seconds(StopSignals::kRepeatWindowSeconds) +
                                    std::chrono::milliseconds(200));
        raise(SIGUSR1);
        std::_Exit(4);  // not reached
      },
      ::testing::KilledBySignal(SIGUSR1),
      "keel-train: rank 2: a second stop signal: ending now, without saving");
}

// After a stop signal the process is on its way out with its checkpoint saved: a repeat that
// arrives once the StopSignals object is gone (MPI shutting down after run() returned) must
// still be ignored within the window, not kill a clean exit (found by tests/chaos).
TEST(StopSignals, ARepeatAfterTheObjectIsGoneIsStillIgnored) {
  EXPECT_EXIT(
      {
        {
          StopSignals signals(1);
          raise(SIGTERM);
          if (StopSignals::received() != SIGTERM) std::_Exit(3);
        }
        raise(SIGTERM);  // ignored: within the window of the first
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "rank 1: SIGTERM again within 5 s of the first: ignored");
}

// Sends this process's stderr to a file for its lifetime; text() reads what has arrived so far
// (gtest's capture can only be read once, at its end).
class StderrToFile {
 public:
  explicit StderrToFile(std::string path) : path_(std::move(path)) {
    std::fflush(stderr);
    saved_ = ::dup(STDERR_FILENO);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  ~StderrToFile() {
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  std::string text() const { return read_file(path_); }

 private:
  std::string path_;
  int saved_ = -1;
};

TEST(StopSignals, TheWatchdogNamesACollectiveStuckAfterTheSignal) {
  TempDir dir("keel_watchdog");
  Watchdog w(30.0, 3);
  w.set_step(7);
  std::string quick, stuck;
  double quick_s = 0;
  {
    StderrToFile err(dir.file("stderr"));
    // A collective that completes soon after the signal: no line.
    const auto t0 = std::chrono::steady_clock::now();
    w.begin("all_reduce", "data-parallel");
    Watchdog::note_stop_signal(SIGTERM);
    w.end();
    quick_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    quick = err.text();
    // One that stays stuck: the line, once. Waited for (up to 30 s, a bound on a hang), then
    // 300 ms more in which a second line would show.
    w.begin("all_gather", "tensor-parallel");
    for (int i = 0; i < 3000 && err.text().size() == quick.size(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    w.end();
    stuck = err.text().substr(quick.size());
  }
  // The line comes 0.25 s after the signal at the earliest: only a machine that paused that
  // long between begin() and end() above could have earned one.
  if (quick_s < 0.25) {
    EXPECT_EQ(quick, "") << "after " << quick_s << " s";
  }
  EXPECT_EQ(stuck,
            "keel-train: communication error: rank 3: all_gather over the tensor-parallel group "
            "at step 7 did not complete within 0.25 s of SIGTERM (another rank failed or was "
            "killed, or the job was cancelled); waiting for it, to save the checkpoint if it "
            "completes\n");
}

}  // namespace
}  // namespace keel
