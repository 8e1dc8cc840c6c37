// launch/tools/keel-sweep and launch/tools/plot_sweep.py, driving the real keel-train on tiny
// grids:
// - a 2 x 2 grid (two learning rates x NONE/RMS, z_loss 1e-4) writes a sweep.csv with exactly the
//   documented columns, one row per run in grid order, every number parsing and in range, a
//   sensitivity.csv that agrees with Wortsman et al.'s definition recomputed here from sweep.csv,
//   and valid PNGs; run again it redoes nothing, and with one result removed it redoes that run;
// - with debug.inject_nan_at_step every run's loss turns non-finite: each is stopped and
//   marked diverged at that step, and the guard arm (spike guard on) skips the NaN step and
//   finishes, its alert drawn in guard_run.png;
// - bad usage, a sweep directory made with other settings, and a run keel-train rejects each exit
//   2 with one line naming the cause;
// - plot_sweep.py draws the committed example (launch/examples/sweep) headless.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::read_file;
using testing::run_command;
using testing::TempDir;

const std::string kPython = "/usr/bin/python3";
const std::string kSweep = std::string(KEEL_SOURCE_DIR) + "/launch/tools/keel-sweep";
const std::string kPlot = std::string(KEEL_SOURCE_DIR) + "/launch/tools/plot_sweep.py";
const std::vector<std::string> kColumns = {"name",
                                           "lr",
                                           "qk_norm",
                                           "z_loss",
                                           "guard",
                                           "final_loss",
                                           "final_train_loss",
                                           "min_train_loss",
                                           "max_attn_logit",
                                           "final_attn_logit",
                                           "log_z",
                                           "max_log_z",
                                           "diverged",
                                           "unstable",
                                           "diverged_step",
                                           "steps",
                                           "rewinds",
                                           "halted",
                                           "seconds"};

// A small model so that each run takes about a second.
std::vector<std::string> sweep_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> args = {kSweep,
                                   "--out",
                                   out,
                                   "--keel-train",
                                   KEEL_TRAIN_BIN,
                                   "--steps",
                                   "12",
                                   "--warmup",
                                   "2",
                                   "--jobs",
                                   "2",
                                   "--set",
                                   "model.d_model=32",
                                   "--set",
                                   "model.n_heads=2",
                                   "--set",
                                   "model.n_layers=1",
                                   "--set",
                                   "train.log_every=1",
                                   "--set",
                                   "data.builtin_bytes=200000"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  std::string field;
  while (std::getline(ss, field, sep)) out.push_back(field);
  if (!line.empty() && line.back() == sep) out.push_back("");
  return out;
}

using Row = std::map<std::string, std::string>;

std::vector<Row> read_csv(const std::string& path, const std::vector<std::string>& columns) {
  std::istringstream in(read_file(path));
  std::string line;
  EXPECT_TRUE(std::getline(in, line));
  EXPECT_EQ(split(line, ','), columns) << path << " header";
  std::vector<Row> rows;
  while (std::getline(in, line)) {
    const auto fields = split(line, ',');
    EXPECT_EQ(fields.size(), columns.size()) << line;
    Row r;
    for (size_t i = 0; i < columns.size() && i < fields.size(); ++i) r[columns[i]] = fields[i];
    rows.push_back(r);
  }
  return rows;
}

double number(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  EXPECT_TRUE(!text.empty() && *end == '\0') << "not a number: '" << text << "'";
  return v;
}

// PNG signature and IHDR width/height.
void expect_png(const std::string& path, uint32_t width = 900, uint32_t height = 550) {
  const std::string png = read_file(path);
  ASSERT_GT(png.size(), 1000u) << path;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << path;
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<unsigned char>(png[at])) << 24) |
           (static_cast<uint32_t>(static_cast<unsigned char>(png[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<unsigned char>(png[at + 2])) << 8) |
           static_cast<uint32_t>(static_cast<unsigned char>(png[at + 3]));
  };
  EXPECT_EQ(be32(16), width) << path;
  EXPECT_EQ(be32(20), height) << path;
}

size_t count_lines(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(SweepTest, TinyGridWritesCsvSensitivityAndPlotsAndResumes) {
  TempDir dir("keel_sweep_test");
  const std::string out = dir.file("sweep");
  const auto args = sweep_args(out, {"--lrs", "1e-3,3e-2", "--qk-norms", "NONE,RMS", "--z-losses",
                                     "1e-4", "--no-guard-arm"});
  const auto r = run_command(command_line(kPython, args), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("4 runs in the grid, 0 done, 4 to run, 2 at a time"), std::string::npos)
      << r.out;

  const auto rows = read_csv(out + "/sweep.csv", kColumns);
  ASSERT_EQ(rows.size(), 4u);
  const std::vector<std::string> names = {"lr0.001_NONE_z0.0001", "lr0.03_NONE_z0.0001",
                                          "lr0.001_RMS_z0.0001", "lr0.03_RMS_z0.0001"};
  std::map<std::string, std::vector<std::pair<double, bool>>> finals;  // qk -> (loss, diverged)
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    SCOPED_TRACE(row.at("name"));
    EXPECT_EQ(row.at("name"), names[i]) << "grid order";
    EXPECT_EQ(number(row.at("lr")), i % 2 == 0 ? 1e-3 : 3e-2);
    EXPECT_EQ(row.at("qk_norm"), i < 2 ? "NONE" : "RMS");
    EXPECT_EQ(number(row.at("z_loss")), 1e-4);
    EXPECT_EQ(row.at("guard"), "off");
    EXPECT_EQ(number(row.at("steps")), 12);
    EXPECT_TRUE(row.at("diverged") == "0" || row.at("diverged") == "1");
    EXPECT_EQ(row.at("diverged_step"), "") << "no loss went non-finite";
    EXPECT_EQ(row.at("rewinds"), "0");
    EXPECT_EQ(row.at("halted"), "0");
    const double final_loss = number(row.at("final_loss"));
    const double final_train = number(row.at("final_train_loss"));
    const double min_train = number(row.at("min_train_loss"));
    // Twelve steps from ln 256 = 5.545: below it, above zero.
    EXPECT_GT(final_loss, 0.5);
    EXPECT_LT(final_loss, 6.5);
    EXPECT_LE(min_train, final_train);
    EXPECT_EQ(row.at("diverged") == "1",
              final_train - min_train > 1.0 || final_train >= std::log(256.0));
    const double peak = number(row.at("max_attn_logit"));
    EXPECT_GT(peak, 0.0);
    EXPECT_GE(peak, number(row.at("final_attn_logit")));
    EXPECT_GE(number(row.at("max_log_z")), number(row.at("log_z")));
    EXPECT_GT(number(row.at("log_z")), 0.0);
    EXPECT_GE(number(row.at("seconds")), 0.0);
    // The run directory holds keel-train's outputs: metrics every step, the final evaluation.
    const std::string metrics = read_file(out + "/runs/" + names[i] + "/metrics.jsonl");
    EXPECT_EQ(count_lines(metrics, "\"step\": "), 12u);
    EXPECT_EQ(count_lines(metrics, "\"val_loss\": "), 1u);
    EXPECT_NE(metrics.find("\"log_z\": "), std::string::npos);
    finals[row.at("qk_norm")].push_back({final_loss, row.at("diverged") == "1"});
  }

  // LR sensitivity: mean over the lrs of min(final, ln 256) (ln 256 when diverged) minus the best.
  const std::vector<std::string> sens_cols = {"qk_norm",         "z_loss",   "lr_sensitivity",
                                              "best_final_loss", "best_lr",  "runs",
                                              "diverged",        "unstable", "max_stable_lr"};
  const auto sens = read_csv(out + "/sensitivity.csv", sens_cols);
  ASSERT_EQ(sens.size(), 2u);
  for (const Row& s : sens) {
    const auto& f = finals.at(s.at("qk_norm"));
    ASSERT_EQ(f.size(), 2u);
    double sum = 0, best = 1e9;
    for (const auto& [loss, diverged] : f) {
      const double capped = diverged ? std::log(256.0) : std::min(loss, std::log(256.0));
      sum += capped;
      best = std::min(best, capped);
    }
    EXPECT_NEAR(number(s.at("lr_sensitivity")), sum / 2 - best, 1e-4) << s.at("qk_norm");
    EXPECT_NEAR(number(s.at("best_final_loss")), best, 1e-4);
    EXPECT_EQ(s.at("runs"), "2");
    // Unstable: diverged, or above the best lr and more than 0.5 nats above the setting's best
    // non-diverged final loss.
    double best_ok = 1e9, best_lr = 0;
    for (const Row& row : rows) {
      if (row.at("qk_norm") == s.at("qk_norm") && row.at("diverged") == "0" &&
          number(row.at("final_loss")) < best_ok) {
        best_ok = number(row.at("final_loss"));
        best_lr = number(row.at("lr"));
      }
    }
    int unstable = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& row = rows[i];
      if (row.at("qk_norm") != s.at("qk_norm")) continue;
      const bool want = row.at("diverged") == "1" || (number(row.at("lr")) > best_lr &&
                                                      number(row.at("final_loss")) - best_ok > 0.5);
      EXPECT_EQ(row.at("unstable"), want ? "1" : "0") << row.at("name");
      unstable += want;
    }
    EXPECT_EQ(number(s.at("unstable")), unstable);
    // The highest lr below the first unstable one (both grid lrs when none is unstable).
    const bool low_unstable = rows[s.at("qk_norm") == "NONE" ? 0 : 2].at("unstable") == "1";
    const bool high_unstable = rows[s.at("qk_norm") == "NONE" ? 1 : 3].at("unstable") == "1";
    EXPECT_EQ(s.at("max_stable_lr"), low_unstable ? "" : high_unstable ? "0.001" : "0.03");
  }

  // Plots: one line each, valid 900 x 550 PNGs; no guard arm, so no guard_run.png.
  for (const char* png : {"final_loss_vs_lr.png", "attn_logit_steps.png",
                          "max_attn_logit_vs_lr.png", "log_z_vs_lr.png"}) {
    EXPECT_NE(r.out.find("plot_sweep: wrote " + out + "/plots/" + png), std::string::npos) << png;
    expect_png(out + "/plots/" + png);
  }
  EXPECT_NE(r.out.find("attn_logit_steps.png (curves=4 "), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(out + "/plots/guard_run.png"));

  // Resume: nothing to redo, results untouched.
  const auto stamp = fs::last_write_time(out + "/runs/" + names[1] + "/result.json");
  const std::string csv = read_file(out + "/sweep.csv");
  const auto again = run_command(command_line(kPython, args), dir);
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("4 runs in the grid, 4 done, 0 to run"), std::string::npos) << again.out;
  EXPECT_EQ(count_lines(again.out, "started"), 0u);
  EXPECT_EQ(fs::last_write_time(out + "/runs/" + names[1] + "/result.json"), stamp);
  EXPECT_EQ(read_file(out + "/sweep.csv"), csv);

  // A run without its result (as a killed sweep leaves it) is redone from scratch, the same run.
  fs::remove(out + "/runs/" + names[2] + "/result.json");
  const auto redo = run_command(command_line(kPython, args), dir);
  ASSERT_EQ(redo.exit_code, 0) << redo.out << redo.err;
  EXPECT_NE(redo.out.find("4 runs in the grid, 3 done, 1 to run"), std::string::npos) << redo.out;
  EXPECT_EQ(count_lines(redo.out, "started"), 1u);
  EXPECT_NE(redo.out.find("started " + names[2]), std::string::npos);
  const auto redone = read_csv(out + "/sweep.csv", kColumns);
  ASSERT_EQ(redone.size(), 4u);
  EXPECT_EQ(redone[2].at("final_loss"), rows[2].at("final_loss")) << "a deterministic rerun";

  // The same directory with other settings is refused, naming the difference.
  auto other = args;
  other[std::find(other.begin(), other.end(), "--steps") - other.begin() + 1] = "13";
  const auto refused = run_command(command_line(kPython, other), dir);
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_EQ(refused.err,
            "keel-sweep: " + out +
                " was made with different settings (steps differs): resume it with the same "
                "ones or use a new --out\n");
}

TEST(SweepTest, NonfiniteRunsStopAndTheGuardArmSkipsThem) {
  TempDir dir("keel_sweep_test");
  const std::string out = dir.file("sweep");
  // Step 5's gradients are NaN: unguarded, the parameters turn NaN and step 6's loss with them.
  const auto args = sweep_args(
      out, {"--lrs", "1e-3", "--qk-norms", "NONE", "--z-losses", "0,1e-4", "--set",
            "debug.inject_nan_at_step=5", "--steps", "300", "--guard-checkpoint-every", "100"});
  const auto r = run_command(command_line(kPython, args), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto rows = read_csv(out + "/sweep.csv", kColumns);
  ASSERT_EQ(rows.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(rows[i].at("name"));
    EXPECT_EQ(rows[i].at("diverged"), "1");
    EXPECT_EQ(rows[i].at("diverged_step"), "6");
    EXPECT_EQ(rows[i].at("final_train_loss"), "") << "non-finite: empty";
    // How many steps ran before the poll stopped it depends on the machine's speed: not asserted.
  }
  const Row& arm = rows[2];
  EXPECT_EQ(arm.at("name"), "lr0.001_NONE_z0.0001_guard") << "largest z_loss of the grid";
  EXPECT_EQ(arm.at("guard"), "on");
  EXPECT_EQ(arm.at("diverged"), "0");
  EXPECT_EQ(arm.at("steps"), "300");
  EXPECT_EQ(arm.at("halted"), "0");
  EXPECT_TRUE(std::isfinite(number(arm.at("final_loss"))));
  EXPECT_NE(r.out.find("guard arm: lr 0.001, qk_norm NONE, spike guard on"), std::string::npos);
  const std::string alerts = read_file(out + "/runs/" + arm.at("name") + "/alerts.jsonl");
  EXPECT_NE(alerts.find("\"kind\": \"nonfinite_grad\""), std::string::npos) << alerts;
  EXPECT_NE(r.out.find("plot_sweep: wrote " + out + "/plots/guard_run.png (points="),
            std::string::npos)
      << r.out;
  expect_png(out + "/plots/guard_run.png", 1100, 500);  // launch/tools/plot_run.py's drawing
}

TEST(SweepTest, BadInputExitsTwoWithOneLine) {
  TempDir dir("keel_sweep_test");
  const std::string out = dir.file("sweep");
  struct Case {
    std::vector<std::string> extra;
    std::string err;
  } cases[] = {
      {{"--lrs", "1e-3,abc"},
       "keel-sweep: --lrs: '1e-3,abc' is not a comma-separated list of "
       "numbers\n"},
      {{"--qk-norms", "RMS,FOO"},
       "keel-sweep: --qk-norms: 'FOO' is not one of NONE, RMS, LAYER, "
       "L2\n"},
      {{"--lrs", "1e-6"}, "keel-sweep: --final-lr 1e-05 is above the learning rate 1e-06\n"},
      {{"--config", "/nonexistent.pbtxt"},
       "keel-sweep: --config /nonexistent.pbtxt: no such "
       "file\n"},
  };
  for (const Case& c : cases) {
    const auto r = run_command(command_line(kPython, sweep_args(out, c.extra)), dir);
    EXPECT_EQ(r.exit_code, 2) << c.err;
    EXPECT_EQ(r.err, c.err);
  }
  // keel-train refuses the config (7 heads do not divide d_model 32): the run is named.
  const auto r = run_command(
      command_line(kPython, sweep_args(out, {"--lrs", "1e-3", "--qk-norms", "RMS", "--z-losses",
                                             "0", "--set", "model.n_heads=7"})),
      dir);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "keel-sweep: run lr0.001_RMS_z0 failed (keel-train exit 2): see " + out +
                       "/runs/lr0.001_RMS_z0/log.txt\n");
  EXPECT_NE(read_file(out + "/runs/lr0.001_RMS_z0/log.txt").find("model.n_heads"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out + "/runs/lr0.001_RMS_z0/result.json"));
}

TEST(SweepTest, PlotScriptDrawsTheCommittedExample) {
  TempDir dir("keel_sweep_test");
  const std::string copy = dir.file("example");
  fs::copy(std::string(KEEL_SOURCE_DIR) + "/launch/examples/sweep", copy,
           fs::copy_options::recursive);
  fs::remove_all(copy + "/plots");
  const auto r = run_command(command_line(kPython, {kPlot, copy}), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* png : {"final_loss_vs_lr.png", "attn_logit_steps.png", "guard_run.png",
                          "max_attn_logit_vs_lr.png", "log_z_vs_lr.png"}) {
    EXPECT_NE(r.out.find("plot_sweep: wrote " + copy + "/plots/" + png), std::string::npos)
        << png << "\n"
        << r.out;
    if (std::string(png) == "guard_run.png") {
      expect_png(copy + "/plots/" + png, 1100, 500);
    } else {
      expect_png(copy + "/plots/" + png);
    }
  }
  EXPECT_EQ(r.err, "") << "the example holds every run the plots need";
  // The example's guard arm rewound once (logged every 5 steps: the run resumes at step 15 after
  // the rewind to step 10, still that rewind's jump).
  EXPECT_NE(r.out.find("guard_run.png (points=85 alerts=2 rewinds=1)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("final_loss_vs_lr.png (runs=64 settings=8 diverged=0)"), std::string::npos);
  EXPECT_NE(r.out.find("attn_logit_steps.png (curves=8 stable_lr=0.003 unstable_lr=0.01)"),
            std::string::npos);
  const auto bad = run_command(command_line(kPython, {kPlot, dir.file("nothing")}), dir);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.err, "plot_sweep: no sweep.csv in " + dir.file("nothing") + ": nothing to plot\n");
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// The tables and figures of docs/stability-sweeps.md come from the committed launch/examples/sweep:
// each row is rebuilt here from sweep.csv and sensitivity.csv at the printed precision, and the
// sensitivities are recomputed from the per-run final losses.
TEST(SweepTest, ReadmeMatchesTheCommittedExample) {
  const std::string dir = std::string(KEEL_SOURCE_DIR) + "/launch/examples/sweep";
  // Line breaks read as spaces, so rewrapping the page's prose does not break the test.
  std::string doc = read_file(std::string(KEEL_SOURCE_DIR) + "/docs/stability-sweeps.md");
  std::replace(doc.begin(), doc.end(), '\n', ' ');
  const auto rows = read_csv(dir + "/sweep.csv", kColumns);
  ASSERT_EQ(rows.size(), 65u) << "64 grid runs and the guard arm";
  const auto sens = read_csv(dir + "/sensitivity.csv",
                             {"qk_norm", "z_loss", "lr_sensitivity", "best_final_loss", "best_lr",
                              "runs", "diverged", "unstable", "max_stable_lr"});
  ASSERT_EQ(sens.size(), 8u);
  auto fmt = [](const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), f, v);
    return std::string(buf);
  };
  auto with_commas = [](double v) {
    const std::string digits = std::to_string(std::llround(v));
    std::string out;
    for (size_t i = 0; i < digits.size(); ++i) {
      if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
      out += digits[i];
    }
    return out;
  };

  for (const Row& s : sens) {
    const std::string qk = s.at("qk_norm"), z = s.at("z_loss");
    SCOPED_TRACE(qk + " z_loss " + z);
    double sum = 0, best = 1e9, peak = 0, at01 = 0, at03 = 0;
    int n = 0;
    for (const Row& r : rows) {
      if (r.at("qk_norm") != qk || r.at("z_loss") != z || r.at("guard") != "off") continue;
      const double loss = r.at("diverged") == "1"
                              ? std::log(256.0)
                              : std::min(number(r.at("final_loss")), std::log(256.0));
      sum += loss;
      best = std::min(best, loss);
      ++n;
      peak = std::max(peak, number(r.at("max_attn_logit")));
      if (r.at("lr") == "0.1") at01 = number(r.at("final_loss"));
      if (r.at("lr") == "0.3") at03 = number(r.at("final_loss"));
    }
    ASSERT_EQ(n, 8);
    EXPECT_NEAR(number(s.at("lr_sensitivity")), sum / n - best, 1e-4);
    EXPECT_NEAR(number(s.at("best_final_loss")), best, 1e-4);
    EXPECT_EQ(s.at("best_lr"), "0.003");
    const std::string row = "| " + qk + " | " + (z == "0" ? "0" : "1e-4") + " | " +
                            fmt("%.3f", number(s.at("lr_sensitivity"))) + " | " +
                            fmt("%.3f", best) + " | " +
                            (s.at("max_stable_lr") == "0.003"  ? "3e-3"
                             : s.at("max_stable_lr") == "0.01" ? "1e-2"
                                                               : "?") +
                            " | " + fmt("%.3f", at01) + " | " + fmt("%.3f", at03) + " | " +
                            (peak > 1000 ? with_commas(peak) : fmt("%.1f", peak)) + " |";
    EXPECT_NE(doc.find(row), std::string::npos) << "docs/stability-sweeps.md lacks the row\n"
                                                << row;
  }
  // The guard arm's figures.
  const Row& arm = rows.back();
  EXPECT_EQ(arm.at("name"), "lr0.01_NONE_z0.0001_guard");
  EXPECT_EQ(fmt("%.3f", number(arm.at("final_loss"))), "2.286");
  EXPECT_EQ(fmt("%.0f", number(arm.at("max_attn_logit"))), "557");
  EXPECT_EQ(arm.at("rewinds"), "1");
  EXPECT_EQ(arm.at("halted"), "0");
  for (const Row& r : rows) {
    if (r.at("name") == "lr0.01_NONE_z0.0001") {
      EXPECT_EQ(fmt("%.3f", number(r.at("final_loss"))), "2.358");
    }
  }
  for (const char* figure :
       {"final loss 2.286, against 2.358 without the guard", "reached 557",
        "gradient-norm spike at step 22", "checkpoint of step 10, skipping 31 batches"}) {
    EXPECT_NE(doc.find(figure), std::string::npos) << figure;
  }
  // The longer runs (launch/examples/sweep/long): the page's second table, rebuilt from its
  // sweep.csv.
  const auto long_rows = read_csv(dir + "/long/sweep.csv", kColumns);
  ASSERT_EQ(long_rows.size(), 10u);
  for (const char* lr : {"0.003", "0.01", "0.03", "0.1", "0.3"}) {
    const Row* none = nullptr;
    const Row* rms = nullptr;
    for (const Row& r : long_rows) {
      if (r.at("lr") == lr) (r.at("qk_norm") == "NONE" ? none : rms) = &r;
    }
    ASSERT_TRUE(none && rms) << lr;
    const double l = number(lr);
    char label[16];
    std::snprintf(label, sizeof(label), "%.0e", l);
    std::string lr_label = label;  // 3e-03 -> 3e-3
    lr_label.erase(lr_label.find("e-0") + 2, 1);
    const double none_logit = number(none->at("max_attn_logit"));
    const std::string row = "| " + lr_label + " | " + fmt("%.3f", number(none->at("final_loss"))) +
                            " | " + with_commas(none_logit) + " | " +
                            fmt("%.3f", number(rms->at("final_loss"))) + " | " +
                            fmt("%.1f", number(rms->at("max_attn_logit"))) + " |";
    EXPECT_NE(doc.find(row), std::string::npos) << "docs/stability-sweeps.md lacks the row\n"
                                                << row;
  }
  const auto long_sens = read_csv(dir + "/long/sensitivity.csv",
                                  {"qk_norm", "z_loss", "lr_sensitivity", "best_final_loss",
                                   "best_lr", "runs", "diverged", "unstable", "max_stable_lr"});
  ASSERT_EQ(long_sens.size(), 2u);
  EXPECT_EQ(long_sens[0].at("max_stable_lr"), "0.01");
  EXPECT_EQ(long_sens[1].at("max_stable_lr"), "0.1");
  EXPECT_NE(doc.find("LR sensitivity is " + fmt("%.3f", number(long_sens[0].at("lr_sensitivity"))) +
                     " without QK-norm and " +
                     fmt("%.3f", number(long_sens[1].at("lr_sensitivity"))) + " with it"),
            std::string::npos);

  const std::string alerts = read_file(dir + "/runs/lr0.01_NONE_z0.0001_guard/alerts.jsonl");
  EXPECT_NE(alerts.find("\"step\": 22, \"kind\": \"grad_spike\""), std::string::npos) << alerts;
  EXPECT_NE(alerts.find("\"rewound_to\": 10"), std::string::npos);
  EXPECT_NE(alerts.find("skipping 31 batches"), std::string::npos);
}

}  // namespace
}  // namespace keel
