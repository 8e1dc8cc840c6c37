// keel-train under mpiexec: layout errors end every rank with exit code 2 and one line from
// rank 0, before any collective (no hang); an error found by one rank only names that rank and
// ends the job; a killed rank ends the job within the watchdog timeout, with keel's own line
// naming the surviving rank, the collective, its group and the step (Note [launcher SIGTERM] in
// parallel/watchdog.cc); a stalled rank is ended by the watchdog. Runs the real binaries.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "tests/launch/launch_test_util.h"

namespace {

using keel::testing::shell_quote;
using keel::testing::TempDir;

struct JobResult {
  int code = -1;
  std::string output;
  double seconds = 0.0;
  // Seconds from the first output line containing the marker to the end of the job (-1: no
  // such line).
  double seconds_after_marker = -1.0;
};

// keel-train's arguments shared by every job: its own run directory under `dir` (keel-train
// resumes from a run directory it finds, so no two jobs share one), one thread, no sampling, no
// evaluation.
std::string common_args(const TempDir& dir) {
  return std::string(KEEL_TRAIN_BIN) + " --run-dir " + shell_quote(dir.file("run")) +
         " --set train.threads=1 --set train.sample_chars=0 --set train.eval_every=0 ";
}

// Runs `mpiexec_args` (what follows mpiexec's global options) with stdout and stderr merged.
JobResult run_mpiexec(const std::string& mpiexec_args, const std::string& marker = "") {
  const std::string cmd =
      std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 180 ") +
      KEEL_MPIEXEC + " --oversubscribe --bind-to none " + mpiexec_args + " 2>&1";
  JobResult r;
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point marked;
  bool seen = false;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) {
    r.output += buf;
    if (!seen && !marker.empty() && std::string(buf).find(marker) != std::string::npos) {
      seen = true;
      marked = std::chrono::steady_clock::now();
    }
  }
  const int status = pclose(p);
  const auto t1 = std::chrono::steady_clock::now();
  r.seconds = std::chrono::duration<double>(t1 - t0).count();
  if (seen) r.seconds_after_marker = std::chrono::duration<double>(t1 - marked).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Every rank runs keel-train with the same arguments, in a fresh run directory.
JobResult run_job(int ranks, const std::string& args, const std::string& marker = "") {
  const TempDir dir("keel_distributed_cli");
  return run_mpiexec("-n " + std::to_string(ranks) + " " + common_args(dir) + args, marker);
}

int count(const std::string& s, const std::string& part) {
  int n = 0;
  for (size_t pos = s.find(part); pos != std::string::npos; pos = s.find(part, pos + 1)) ++n;
  return n;
}

const char* kTiny =
    " --set model.d_model=32 --set model.n_layers=1 --set model.seq_len=16 --set train.steps=2"
    " --set train.global_batch=4 --set data.builtin_bytes=100000";

TEST(DistributedCli, RanksNotDivisibleByTp) {
  const JobResult r = run_job(3, std::string(kTiny) + " --set parallel.tp=2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "layout error: parallel.tp=2 does not divide the 3 ranks"), 1)
      << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

TEST(DistributedCli, TpNotDividingHeads) {
  const JobResult r = run_job(2, std::string(kTiny) +
                                     " --set model.d_model=48 --set model.n_heads=3 "
                                     "--set parallel.tp=2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "parallel.tp=2 does not divide model.n_heads=3"), 1) << r.output;
}

TEST(DistributedCli, TpLargerThanHeads) {
  const JobResult r = run_job(4, std::string(kTiny) + " --set model.n_heads=2 --set parallel.tp=4");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "parallel.tp=4 exceeds model.n_heads=2"), 1) << r.output;
}

TEST(DistributedCli, TpNotDividingDff) {
  const JobResult r = run_job(4, std::string(kTiny) +
                                     " --set model.n_heads=4 --set model.d_ff=66 "
                                     "--set parallel.tp=4");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "parallel.tp=4 does not divide model.d_ff=66"), 1) << r.output;
}

// Note [sequence parallel]: each rank holds seq_len / tp rows of every sequence.
TEST(DistributedCli, SequenceParallelNeedsTpDividingSeqLen) {
  const JobResult r = run_job(4, std::string(kTiny) +
                                     " --set model.n_heads=4 --set model.seq_len=18 "
                                     "--set parallel.tp=4 --set parallel.sequence_parallel=true");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output,
                  "parallel.sequence_parallel: parallel.tp=4 does not divide "
                  "model.seq_len=18"),
            1)
      << r.output;
}

// A TP job no machine holds is refused with the hint to split activations over TP, which the
// same job with sequence parallelism no longer gets.
TEST(DistributedCli, MemoryRefusalUnderTpSuggestsSequenceParallelism) {
  const std::string huge =
      std::string(kTiny) + " --set parallel.tp=2 --set train.global_batch=2147483646";
  const JobResult r = run_job(2, huge);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count(r.output, "this job needs about"), 1) << r.output;
  EXPECT_EQ(count(r.output, ", or split them over TP (parallel.sequence_parallel)"), 1) << r.output;
  const JobResult sp = run_job(2, huge + " --set parallel.sequence_parallel=true");
  EXPECT_EQ(sp.code, 2) << sp.output;
  EXPECT_EQ(count(sp.output, "this job needs about"), 1) << sp.output;
  EXPECT_EQ(count(sp.output, "parallel.sequence_parallel"), 0) << sp.output;
}

TEST(DistributedCli, TwoRanksTrain) {
  const JobResult r = run_job(2, std::string(kTiny) + " --set parallel.tp=2");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("2 ranks = dp 1 x tp 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;
}

TEST(DistributedCli, KilledRankEndsTheJobWithinTheTimeout) {
  // Rank 1 dies (SIGKILL) at the start of step 3; rank 0 then waits in that step's first
  // tensor-parallel all-reduce, which cannot complete. mpirun ends rank 0 (SIGTERM, ~1 s after the
  // death) long before parallel.timeout_s; keel's line must still name rank 0, the collective,
  // the group and the step ("did not complete" ends both the SIGTERM line and the watchdog's).
  const double timeout_s = 5.0;
  const JobResult r = run_job(2,
                              std::string(kTiny) +
                                  " --set parallel.tp=2 --set train.steps=50"
                                  " --set debug.kill_rank=1 --set debug.kill_at_step=3"
                                  " --set parallel.timeout_s=5",
                              "killing this rank at step 3");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "keel-train: debug.kill_rank=1: killing this rank at step 3"), 1)
      << r.output;
  EXPECT_EQ(count(r.output,
                  "keel-train: communication error: rank 0: all_reduce over the tensor-parallel "
                  "group at step 3 did not complete"),
            1)
      << r.output;
  EXPECT_EQ(count(r.output, "communication error"), 1) << r.output;
  // From the death to the end of the job: within the timeout.
  EXPECT_GE(r.seconds_after_marker, 0.0) << r.output;
  // A bound on a hang, not a speed: the launcher acts in about a second, the watchdog at
  // timeout_s; a stuck job would run into the 180 s `timeout`.
  EXPECT_LT(r.seconds_after_marker, timeout_s + 25.0) << r.output;
  EXPECT_LT(r.seconds, timeout_s + 40.0) << r.output;
}

TEST(DistributedCli, ErrorOnOneRankOnlyNamesThatRankAndEndsTheJob) {
  // MPMD launch: rank 0 reads a text file, rank 1 a path that does not exist. Rank 1's data error
  // (exit code 2) is of a kind every rank normally finds alike, but here rank 0 went on into the
  // start-up collectives; after 10 s without the others at its barrier, rank 1 names itself and
  // the reason and aborts the whole job (keel_train_main.cc).
  TempDir dir("keel_mpmd");
  std::string text;
  for (int i = 0; text.size() < 20000; ++i)
    text += "the quick brown fox " + std::to_string(i) + ". ";
  const std::string good = dir.write("train.txt", text);
  const std::string missing = dir.file("missing_on_rank_1.txt");
  const std::string args = common_args(dir) + kTiny;
  const JobResult r = run_mpiexec("-n 1 " + args + " --set data.path=" + shell_quote(good) +
                                  " : -n 1 " + args + " --set data.path=" + shell_quote(missing));
  EXPECT_EQ(r.code, 2) << r.output;  // MPI_Abort's code: the error's
  EXPECT_LT(r.seconds, 10.0 + 40.0) << r.output;
  EXPECT_EQ(count(r.output, "keel-train: rank 1: data error: " + missing + ": cannot open"), 1)
      << r.output;
  EXPECT_EQ(count(r.output, missing), 1) << r.output;
  // Rank 0 found no error: it does not speak as if every rank had.
  EXPECT_EQ(r.output.find("keel-train: data error:"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

TEST(DistributedCli, StalledRankEndsTheJobThroughTheWatchdog) {
  // Rank 1 stops making progress without dying: only rank 0's watchdog can end the job.
  const JobResult r = run_job(2, std::string(kTiny) +
                                     " --set train.steps=50 --set debug.kill_rank=1"
                                     " --set debug.kill_at_step=3 --set debug.fault=STALL"
                                     " --set parallel.timeout_s=3");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_LT(r.seconds, 3.0 + 40.0) << r.output;
  EXPECT_NE(r.output.find("stalling this rank at step 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("communication error: rank 0:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 3 did not complete within parallel.timeout_s=3"),
            std::string::npos)
      << r.output;
}

}  // namespace
