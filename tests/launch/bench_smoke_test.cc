// keel-bench on the real binary, in one process and under mpiexec -n 2, on a tiny model and two
// steps: it exits 0 and ends with exactly one summary line
//   config=S tokens_per_s=... gflops=... peak_gflops=... peak_fraction=... ranks=... tp=... dp=...
// whose numbers are positive and finite, peak_fraction > 0, gflops = tokens_per_s x the
// PaLM FLOPs per token of the model (docs/performance.md, "Benchmark"), peak_fraction = gflops /
// peak_gflops, peak_gflops = ranks x the per-rank sgemm peak of the header line, and the layout
// figures match the launch (under DP the data-parallel group moved bytes, TP none).
//
// keel-bench --checkpoint on the same tiny model, in one process (scratch directory in $TMPDIR)
// and on 2 ranks (in --dir): it exits 0 and prints exactly one ckpt=disk, save, load, sync_cost
// and async_cost line, each naming the launch (ranks, dp), the parameter count and the
// checkpoint's bytes = 12 x parameters (fp32 parameters + AdamW m + v, no byte written twice);
// every throughput and time is positive and finite with min <= median <= max, save_gbps =
// bytes / save_s, disk_fraction = save_gbps / write_gbps, the cost lines name the save interval,
// and the directory it worked in is empty afterwards. Speed is never asserted (a save's cost may
// even come out negative on a noisy machine: only its finiteness is). Misused flags exit 2 before
// anything runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::CommandResult;
using testing::run_command;
using testing::TempDir;

// S overridden down to 1 layer of width 32 (4 heads of 8) over 16 tokens: a step takes
// milliseconds, and its tiny GEMMs reach a small fraction of the sgemm peak (about 0.2 measured),
// so peak_fraction stays below 1.5 even when the peak was measured while other work loaded the
// machine (0.2-0.9 measured at load 10 on 2 cores). The peak measurement (rank 0, one thread,
// five 2048^3 sgemms) takes most of the run: about a second on an idle core.
const std::vector<std::string> kTinyS = {"--config",  "S",
                                         "--steps",   "4",
                                         "--warmup",  "1",
                                         "--threads", "1",
                                         "--set",     "model.d_model=32",
                                         "--set",     "model.n_layers=1",
                                         "--set",     "model.n_heads=4",
                                         "--set",     "model.seq_len=16"};

// 6 (L (4 d^2 + 2 d f) + V d) + 12 L T d with V 256, d 32, f 4 d, L 1, T 16.
constexpr double kFlopsPerToken = 6.0 * (4 * 32 * 32 + 2 * 32 * 128 + 256 * 32) + 12.0 * 16 * 32;

// Ranks waiting for rank 0's peak measurement yield the core instead of spinning on it.
std::string env_prefix() {
  return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 "
         "OMPI_MCA_mpi_yield_when_idle=1 ";
}

// The key=value fields of the one line of `out` starting with "config=S "; empty if there is
// not exactly one.
std::map<std::string, std::string> summary_fields(const std::string& out) {
  std::map<std::string, std::string> fields;
  std::istringstream lines(out);
  std::string line, found;
  int n = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("config=S ", 0) == 0) {
      found = line;
      ++n;
    }
  }
  EXPECT_EQ(n, 1) << out;
  if (n != 1) return fields;
  std::istringstream words(found);
  std::string w;
  while (words >> w) {
    const size_t eq = w.find('=');
    if (eq != std::string::npos) fields[w.substr(0, eq)] = w.substr(eq + 1);
  }
  return fields;
}

// The value of `key`, parsed whole as a double; NaN when absent or malformed.
double number(const std::map<std::string, std::string>& f, const std::string& key) {
  const auto it = f.find(key);
  if (it == f.end()) return std::nan("");
  size_t pos = 0;
  try {
    const double v = std::stod(it->second, &pos);
    return pos == it->second.size() ? v : std::nan("");
  } catch (const std::exception&) {
    return std::nan("");
  }
}

// "sgemm peak X GFLOP/s per rank" from the header line; NaN when absent.
double per_rank_peak(const std::string& out) {
  const std::string key = "sgemm peak ";
  const size_t at = out.find(key);
  if (at == std::string::npos) return std::nan("");
  return std::atof(out.c_str() + at + key.size());
}

void check_summary(const CommandResult& r, int ranks) {
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto f = summary_fields(r.out);
  ASSERT_FALSE(f.empty());
  const double tps = number(f, "tokens_per_s"), gflops = number(f, "gflops");
  const double peak = number(f, "peak_gflops"), fraction = number(f, "peak_fraction");
  for (double v : {tps, gflops, peak, fraction}) {
    EXPECT_TRUE(std::isfinite(v) && v > 0) << v << "\n" << r.out;
  }
  // No upper bound on the fraction: the peak and the steps are timed at different moments, so
  // on a loaded machine their ratio says nothing about keel; the accounting below is what counts.
  // The accounting: printed with 1, 2, 2 and 4 decimals, hence the tolerances.
  EXPECT_NEAR(gflops, tps * kFlopsPerToken / 1e9, 0.005 + 1e-3 * gflops) << r.out;
  EXPECT_NEAR(fraction, gflops / peak, 5e-5 + 1e-2 * fraction) << r.out;
  EXPECT_NEAR(peak, ranks * per_rank_peak(r.out), 0.06 * ranks) << r.out;  // X has 1 decimal
  EXPECT_EQ(number(f, "ranks"), ranks) << r.out;
  EXPECT_EQ(number(f, "tp"), 1) << r.out;
  EXPECT_EQ(number(f, "dp"), ranks) << r.out;
  EXPECT_EQ(number(f, "tp_bytes_per_step"), 0) << r.out;
  if (ranks > 1) {
    EXPECT_GT(number(f, "dp_bytes_per_step"), 0) << r.out;
  } else {
    EXPECT_EQ(number(f, "dp_bytes_per_step"), 0) << r.out;
  }
}

TEST(BenchSmoke, OneProcessPrintsTheSummaryLine) {
  TempDir scratch("keel_bench");
  const CommandResult r = run_command(env_prefix() + command_line(KEEL_BENCH_BIN, kTinyS), scratch);
  check_summary(r, 1);
}

TEST(BenchSmoke, TwoRanksPrintTheSummaryLineOnce) {
  TempDir scratch("keel_bench");
  const CommandResult r =
      run_command(env_prefix() + KEEL_MPIEXEC + " -n 2 --oversubscribe --bind-to none " +
                      command_line(KEEL_BENCH_BIN, kTinyS),
                  scratch);
  check_summary(r, 2);
}

// --checkpoint on the tiny model (kTinyS without --steps), 1 warmup step, saving every 2 steps
// (keel-bench's default), in 3 rounds (an odd count: each median is one round's value, so the
// median rate is the rate of the median time).
std::vector<std::string> tiny_checkpoint_args() {
  std::vector<std::string> args = {"--checkpoint", "--rounds", "3", "--warmup", "1"};
  for (size_t i = 0; i < kTinyS.size(); i += 2) {
    if (kTinyS[i] != "--steps" && kTinyS[i] != "--warmup") {
      args.insert(args.end(), {kTinyS[i], kTinyS[i + 1]});
    }
  }
  return args;
}

const char* const kCheckpointKinds[] = {"disk", "save", "load", "sync_cost", "async_cost"};

// The key=value fields of the one line of `out` starting with "ckpt=<kind> "; empty (and a
// failure) if there is not exactly one.
std::map<std::string, std::string> ckpt_fields(const std::string& out, const std::string& kind) {
  std::map<std::string, std::string> fields;
  std::istringstream lines(out);
  std::string line, found;
  int n = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("ckpt=" + kind + " ", 0) == 0) {
      found = line;
      ++n;
    }
  }
  EXPECT_EQ(n, 1) << kind << "\n" << out;
  if (n != 1) return fields;
  std::istringstream words(found);
  std::string w;
  while (words >> w) {
    const size_t eq = w.find('=');
    if (eq != std::string::npos) fields[w.substr(0, eq)] = w.substr(eq + 1);
  }
  return fields;
}

// `key`, `key`_min and `key`_max are positive and finite, in order.
void expect_positive_spread(const std::map<std::string, std::string>& f, const std::string& key,
                            const std::string& out) {
  const double med = number(f, key), lo = number(f, key + "_min"), hi = number(f, key + "_max");
  for (double v : {med, lo, hi}) EXPECT_TRUE(std::isfinite(v) && v > 0) << key << "\n" << out;
  EXPECT_LE(lo, med) << key << "\n" << out;
  EXPECT_LE(med, hi) << key << "\n" << out;
}

void check_checkpoint_summary(const CommandResult& r, int ranks) {
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  double params = std::nan("");
  for (const char* kind : kCheckpointKinds) {
    const auto f = ckpt_fields(r.out, kind);
    ASSERT_FALSE(f.empty()) << kind;
    EXPECT_EQ(f.at("config"), "S") << r.out;
    EXPECT_EQ(number(f, "ranks"), ranks) << r.out;
    EXPECT_EQ(number(f, "tp"), 1) << r.out;
    EXPECT_EQ(number(f, "dp"), ranks) << r.out;
    EXPECT_EQ(number(f, "rounds"), 3) << r.out;
    // Every line names the same checkpoint: fp32 parameters and both AdamW moments, each
    // logical element once whatever the layout.
    if (std::isnan(params)) params = number(f, "params");
    EXPECT_EQ(number(f, "params"), params) << r.out;
    EXPECT_GT(params, 0) << r.out;
    EXPECT_EQ(number(f, "bytes"), 12 * params) << r.out;
  }
  const std::string& out = r.out;
  const auto disk = ckpt_fields(out, "disk");
  for (const char* key : {"write_gbps", "read_cached_gbps", "read_dropped_gbps"}) {
    expect_positive_spread(disk, key, out);
  }
  const double resident = number(disk, "dropped_resident");
  EXPECT_TRUE(resident >= 0 && resident <= 1) << out;
  const auto save = ckpt_fields(out, "save");
  expect_positive_spread(save, "save_gbps", out);
  EXPECT_NEAR(number(save, "disk_fraction"), number(save, "save_gbps") / number(disk, "write_gbps"),
              1e-5 * number(save, "disk_fraction"))
      << out;
  const double save_s = number(save, "save_s");
  EXPECT_TRUE(std::isfinite(save_s) && save_s > 0) << out;
  // The median rate is the rate of the median time (odd rounds; 6 significant digits printed).
  EXPECT_NEAR(number(save, "save_gbps"), number(save, "bytes") / 1e9 / save_s,
              1e-5 * number(save, "save_gbps"))
      << out;
  const auto load = ckpt_fields(out, "load");
  expect_positive_spread(load, "load_cached_gbps", out);
  expect_positive_spread(load, "load_dropped_gbps", out);
  for (const char* kind : {"sync_cost", "async_cost"}) {
    const auto f = ckpt_fields(out, kind);
    EXPECT_EQ(number(f, "every"), 2) << out;
    const double step_s = number(f, "step_s");
    EXPECT_TRUE(std::isfinite(step_s) && step_s > 0) << out;
    // A difference of two timings: finite, of either sign.
    for (const char* key :
         {"save_cost_s", "step_fraction", "step_fraction_min", "step_fraction_max"}) {
      EXPECT_TRUE(std::isfinite(number(f, key))) << key << "\n" << out;
    }
    EXPECT_LE(number(f, "step_fraction_min"), number(f, "step_fraction")) << out;
    EXPECT_LE(number(f, "step_fraction"), number(f, "step_fraction_max")) << out;
  }
  const double wait = number(ckpt_fields(out, "async_cost"), "write_wait_s");
  EXPECT_TRUE(std::isfinite(wait) && wait >= 0) << out;
}

// The entries of `dir` (it must exist), but for Open MPI's session directory (ompi.*), which
// MPI_Init of a process started without mpiexec makes in $TMPDIR.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ompi.", 0) != 0) names.push_back(name);
  }
  return names;
}

TEST(BenchSmoke, CheckpointInOneProcessUsesTmpdirAndLeavesNothing) {
  TempDir scratch("keel_bench");
  const std::string tmp = scratch.file("tmp");
  std::filesystem::create_directory(tmp);
  const CommandResult r = run_command(env_prefix() + "TMPDIR=" + testing::shell_quote(tmp) + " " +
                                          command_line(KEEL_BENCH_BIN, tiny_checkpoint_args()),
                                      scratch);
  check_checkpoint_summary(r, 1);
  EXPECT_NE(r.out.find(tmp + "/keel-bench-ckpt."), std::string::npos) << r.out;
  EXPECT_TRUE(entries(tmp).empty()) << entries(tmp).front();
}

TEST(BenchSmoke, CheckpointOnTwoRanksLeavesNothingInDir) {
  TempDir scratch("keel_bench");
  const std::string dir = scratch.file("ckpt");
  std::filesystem::create_directory(dir);
  std::vector<std::string> args = tiny_checkpoint_args();
  args.insert(args.end(), {"--dir", dir});
  const CommandResult r =
      run_command(env_prefix() + KEEL_MPIEXEC + " -n 2 --oversubscribe --bind-to none " +
                      command_line(KEEL_BENCH_BIN, args),
                  scratch);
  check_checkpoint_summary(r, 2);
  EXPECT_NE(r.out.find(dir + "/keel-bench-ckpt."), std::string::npos) << r.out;
  EXPECT_TRUE(entries(dir).empty()) << entries(dir).front();
}

TEST(BenchSmoke, CheckpointFlagsMisusedExitTwo) {
  TempDir scratch("keel_bench");
  const std::vector<std::vector<std::string>> misuses = {
      {"--checkpoint", "--dir", scratch.file("missing")},  // no such directory
      {"--rounds", "2"},                                   // without --checkpoint
      {"--dir", scratch.path()},                           // without --checkpoint
      {"--checkpoint", "--profile"},
      {"--checkpoint", "--rounds", "0"},
      {"--checkpoint", "--steps", "4"},  // --checkpoint's interval is checkpoint.every
  };
  for (const auto& args : misuses) {
    const CommandResult r = run_command(env_prefix() + command_line(KEEL_BENCH_BIN, args), scratch);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1] << "\n" << r.out << r.err;
    EXPECT_EQ(r.err.rfind("keel-bench: usage error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.out.find("ckpt="), std::string::npos) << r.out;
  }
}

// --device: a GPU config on the CPU, a CPU config on the GPU, an unknown device and (on a machine
// without a GPU) --device CUDA itself exit 2 with one usage line; the CPU summary line says
// device=CPU precision=FP32.
TEST(BenchSmoke, DeviceFlagMisusedExitTwo) {
  TempDir scratch("keel_bench");
  std::vector<std::vector<std::string>> misuses = {
      {"--config", "124M"},                  // a GPU config, and the device is the CPU
      {"--device", "TPU", "--config", "S"},  // no such device
  };
  if (!std::filesystem::exists("/dev/nvidia0")) {
    misuses.push_back({"--device", "CUDA", "--config", "S"});  // built without, or no GPU
  }
  for (const auto& args : misuses) {
    const CommandResult r = run_command(env_prefix() + command_line(KEEL_BENCH_BIN, args), scratch);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1] << "\n" << r.out << r.err;
    EXPECT_EQ(r.err.rfind("keel-bench: usage error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    EXPECT_EQ(r.out.find("config="), std::string::npos) << r.out;
  }
  const CommandResult ok =
      run_command(env_prefix() + command_line(KEEL_BENCH_BIN, kTinyS), scratch);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find(" device=CPU precision=FP32\n"), std::string::npos) << ok.out;
}

}  // namespace
}  // namespace keel
