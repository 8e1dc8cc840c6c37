// keel-train under mpiexec: layout errors end every rank with exit code 2 and one line from
// rank 0, before any collective (no hang); a killed rank ends the job non-zero within the
// watchdog timeout, naming the rank or step. Runs the real binaries.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct JobResult {
  int code = -1;
  std::string output;
  double seconds = 0.0;
};

JobResult run_job(int ranks, const std::string& args) {
  const std::string cmd =
      std::string("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 180 ") +
      KEEL_MPIEXEC + " -n " + std::to_string(ranks) + " --oversubscribe --bind-to none " +
      KEEL_TRAIN_BIN +
      " --run-dir /tmp/keel_distributed_cli_test --set train.threads=1"
      " --set train.sample_chars=0 --set train.eval_every=0 " +
      args + " 2>&1";
  JobResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof(buf), p)) r.output += buf;
  const int status = pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
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

TEST(DistributedCli, TwoRanksTrain) {
  const JobResult r = run_job(2, std::string(kTiny) + " --set parallel.tp=2");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("2 ranks = dp 1 x tp 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("done: 2 steps"), std::string::npos) << r.output;
}

TEST(DistributedCli, KilledRankEndsTheJobWithinTheTimeout) {
  const double timeout_s = 5.0;
  const JobResult r = run_job(2, std::string(kTiny) +
                                     " --set train.steps=50 --set debug.kill_rank=1"
                                     " --set debug.kill_at_step=3 --set parallel.timeout_s=5");
  EXPECT_NE(r.code, 0) << r.output;
  // The launcher or the watchdog ends the job: well inside the timeout plus start-up.
  EXPECT_LT(r.seconds, timeout_s + 40.0) << r.output;
  EXPECT_NE(r.output.find("killing this rank at step 3"), std::string::npos) << r.output;
  const bool names_rank = r.output.find("rank 1") != std::string::npos ||
                          r.output.find("rank 0: all_reduce") != std::string::npos;
  EXPECT_TRUE(names_rank) << r.output;
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
