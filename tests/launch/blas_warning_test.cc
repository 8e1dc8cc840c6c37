// keel-train warns, once, with its start-up banner, when OpenBLAS runs its generic Prescott
// kernels on a CPU with AVX2 or AVX-512 (docs/performance.md, "BLAS and threads"), naming the
// OPENBLAS_CORETYPE that fixes it; with that setting it says nothing. keel-bench says the same on
// stderr. OPENBLAS_CORETYPE forces OpenBLAS's choice, so both cases are provoked on any AVX2
// machine.
#include <gtest/gtest.h>

#include <string>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::run_command;
using testing::TempDir;

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(BlasWarningTest, PrescottOnAModernCpuIsNamedWithItsFix) {
#if defined(__x86_64__)
  const char* fix = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                    : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                      : nullptr;
#else
  const char* fix = nullptr;
#endif
  if (fix == nullptr) GTEST_SKIP() << "no AVX2: Prescott is the right OpenBLAS kernel here";
  TempDir dir("keel_blas_warning_test");
  const std::vector<std::string> args = {
      "--set",     "train.steps=1",      "--set", "model.d_model=32",
      "--set",     "model.n_heads=2",    "--set", "model.n_layers=1",
      "--set",     "train.eval_every=0", "--set", "train.sample_chars=0",
      "--set",     "train.plot=false",   "--set", "data.builtin_bytes=200000",
      "--run-dir", dir.file("run")};
  const auto slow =
      run_command("env OPENBLAS_CORETYPE=Prescott " + command_line(KEEL_TRAIN_BIN, args), dir);
  ASSERT_EQ(slow.exit_code, 0) << slow.out << slow.err;
  const std::string want =
      std::string("keel-train: warning: OpenBLAS chose its generic Prescott ") +
      "kernels for this CPU (sgemm several times slower than it can be): set " +
      "OPENBLAS_CORETYPE=" + fix + " in the job's environment (mpirun -x " +
      "OPENBLAS_CORETYPE=" + fix + ")\n";
  EXPECT_EQ(count(slow.out, want), 1u) << slow.out;
  EXPECT_EQ(slow.err.find("keel-train: warning"), std::string::npos) << slow.err;

  std::vector<std::string> args2 = args;
  args2.back() = dir.file("run2");
  const auto fast = run_command(
      "env OPENBLAS_CORETYPE=" + std::string(fix) + " " + command_line(KEEL_TRAIN_BIN, args2), dir);
  ASSERT_EQ(fast.exit_code, 0) << fast.out << fast.err;
  EXPECT_EQ(fast.out.find("keel-train: warning"), std::string::npos) << fast.out;

  // keel-bench says the same on stderr (its stdout is the figures).
  const std::vector<std::string> bench = {"--config", "S", "--steps",   "1",
                                          "--warmup", "0", "--threads", "1"};
  const auto bench_slow =
      run_command("env OPENBLAS_CORETYPE=Prescott " + command_line(KEEL_BENCH_BIN, bench), dir);
  ASSERT_EQ(bench_slow.exit_code, 0) << bench_slow.out << bench_slow.err;
  std::string bench_want = want;
  bench_want.replace(0, std::string("keel-train").size(), "keel-bench");
  EXPECT_EQ(count(bench_slow.err, bench_want), 1u) << bench_slow.err;
  EXPECT_EQ(bench_slow.out.find("warning"), std::string::npos) << bench_slow.out;
}

}  // namespace
}  // namespace keel
