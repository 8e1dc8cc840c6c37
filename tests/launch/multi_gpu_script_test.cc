// tests/gpu/multi_gpu.sh, the multi-GPU checks a node with several GPUs runs, kept working on
// machines without GPUs: with --device CPU it runs the same layouts (TP2, DP2, DP2 + ZeRO-1,
// TP2 x DP2 against one rank, losses within 1e-5) and the killed- and stalled-rank checks over
// MPI, and every check must pass.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::run_command;
using testing::TempDir;

TEST(MultiGpuScript, PassesEveryCheckOnTheCpu) {
  TempDir scratch("keel_multi_gpu_script");
  const std::string bin = std::filesystem::path(KEEL_TRAIN_BIN).parent_path().string();
  const std::string cmd =
      "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
      "OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 MPIRUN=" KEEL_MPIEXEC
      " " KEEL_SOURCE_DIR "/tests/gpu/multi_gpu.sh --device CPU --bin " +
      bin;
  const auto r = run_command(cmd, scratch);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* check : {"PASS one:", "PASS tp2:", "PASS dp2:", "PASS dp2_zero1:",
                            "PASS tp2xdp2:", "PASS killed:", "PASS stalled:"}) {
    EXPECT_NE(r.out.find(check), std::string::npos) << check << " missing:\n" << r.out << r.err;
  }
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace keel
