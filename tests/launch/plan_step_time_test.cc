// The "Sizing a GPU run" tables of docs/distributed.md are what launch/tools/plan_step_time.py
// prints, line for line, the script's arithmetic holds for one row recomputed here (124M at
// TP8 x DP16), and every row's head count divides by its tp.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::read_file;
using testing::run_command;
using testing::TempDir;

const std::string kScript = std::string(KEEL_SOURCE_DIR) + "/launch/tools/plan_step_time.py";

// The number after " key=" in one of the script's "key=value ..." lines.
double value_of(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  EXPECT_NE(at, std::string::npos) << key << " in " << line;
  return at == std::string::npos ? 0.0 : std::stod(line.substr(at + key.size() + 2));
}

// Both tables: the default (bf16 on the TP wire) and --tp-comm-dtype FP32 (whose TP1 row, the
// same as the first table's, the page leaves out).
TEST(PlanStepTime, ReadmeTablesAreTheScriptsOutput) {
  TempDir dir("keel_plan_step_time_test");
  const std::string doc = read_file(std::string(KEEL_SOURCE_DIR) + "/docs/distributed.md");
  for (const std::string flags : {"", " --tp-comm-dtype FP32", " --sequence-parallel"}) {
    const auto r = run_command("python3 " + kScript + " --markdown" + flags, dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::istringstream lines(r.out);
    std::string line;
    int rows = 0;
    while (std::getline(lines, line)) {
      EXPECT_NE(doc.find(line + "\n"), std::string::npos)
          << "not in docs/distributed.md (" << flags << "): " << line;
      ++rows;
    }
    EXPECT_EQ(rows, 6) << flags;  // header, rule, four layouts
  }
}

// Every row is a layout keel-train accepts: TP splits whole heads (the 124M row at TP8 has 16).
TEST(PlanStepTime, EveryRowSplitsWholeHeads) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript, dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    const size_t tp_at = line.find("layout=TP");
    ASSERT_NE(tp_at, std::string::npos) << line;
    const int tp = std::stoi(line.substr(tp_at + 9));
    EXPECT_EQ(static_cast<int>(value_of(line, "heads")) % tp, 0) << line;
    ++rows;
  }
  EXPECT_EQ(rows, 4);
}

// 124M at TP8 x DP16, micro-batch 16 x 2 accumulation steps of 1024 tokens: the TP formula of
// docs/distributed.md, A[w (2 + 4L) BT C + 4 x 3 BT] + 8 bytes, w = 2 with bf16 on the TP wire
// (the default, whose TP time adds A BT C (12 + 6 (1 + 2L)) bytes of HBM traffic at 3.35 TB/s) or
// 4 (--tp-comm-dtype FP32), and the fp32 arena over TP for DP.
class PlanStepTimeWire : public ::testing::TestWithParam<int> {};

TEST_P(PlanStepTimeWire, ArithmeticOfOneRow) {
  const int w = GetParam();
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command(
      "python3 " + kScript + (w == 4 ? " --tp-comm-dtype FP32" : " --tp-comm-dtype BF16"), dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  auto field = [&](const std::string& key) { return value_of(first, key); };
  const double L = 12, C = 768, T = 1024, V = 50304, BT = 16 * T, A = 2;
  EXPECT_EQ(field("tp_bytes"), A * (w * (2 + 4 * L) * BT * C + 4 * 3 * BT) + 8);
  const double params = L * 12 * C * C + V * C + T * C;
  EXPECT_NEAR(field("params"), params, 1e-6 * params);
  EXPECT_NEAR(field("dp_bytes"), 4 * params / 8, 1e-6 * params);
  const double flops = (6 * (L * 12 * C * C + V * C) + 12 * L * T * C) * 512 * T;
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-8 * std::abs(b); };
  EXPECT_TRUE(near(field("compute_s"), flops / 128 / (0.45 * 989e12)));
  const double cast_s = w == 2 ? A * BT * C * (12 + 6 * (1 + 2 * L)) / 3.35e12 : 0.0;
  EXPECT_TRUE(near(field("tp_s"), 2 * 7.0 / 8 * field("tp_bytes") / 450e9 + cast_s));
  EXPECT_TRUE(near(field("dp_s"), 2 * 15.0 / 16 * field("dp_bytes") / 50e9));
}

INSTANTIATE_TEST_SUITE_P(Wire, PlanStepTimeWire, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return i.param == 2 ? std::string("BF16") : std::string("FP32");
                         });

// --sequence-parallel, 124M at TP8 x DP16 (16 x 2 of 1024 tokens): the formula of
// docs/distributed.md with sequence parallelism, fp32 all-gathers and reduce-scatters of
// (4 + 10L) BT C per micro-batch moving 7/8 of each buffer per rank in a ring, plus all-reduces
// (2 (7/8)) of the loss statistics, the 2L + 1 LayerNorms' weight and bias gradients and the
// 8-byte norm; no bf16 casts.
TEST(PlanStepTime, SequenceParallelArithmeticOfOneRow) {
  TempDir dir("keel_plan_step_time_test");
  const auto r = run_command("python3 " + kScript + " --sequence-parallel", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  auto field = [&](const std::string& key) { return value_of(first, key); };
  const double L = 12, C = 768, BT = 16 * 1024, A = 2;
  const double gather = 4 * A * (4 + 10 * L) * BT * C;
  const double reduce = 4 * A * (3 * BT + (2 * L + 1) * 2 * C) + 8;
  EXPECT_EQ(field("tp_bytes"), gather + reduce);
  const double want_s = (7.0 / 8 * gather + 2 * 7.0 / 8 * reduce) / 450e9;
  EXPECT_LE(std::abs(field("tp_s") - want_s), 1e-8 * want_s);
}

// The default is parallel.tp_comm_dtype's under train.precision=BF16 (a GPU's default): BF16.
TEST(PlanStepTime, DefaultIsTheBf16Wire) {
  TempDir dir("keel_plan_step_time_test");
  const auto plain = run_command("python3 " + kScript, dir);
  const auto bf16 = run_command("python3 " + kScript + " --tp-comm-dtype BF16", dir);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.out, bf16.out);
}

}  // namespace
}  // namespace keel
