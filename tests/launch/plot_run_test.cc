// launch/tools/plot_run.py under Debian's /usr/bin/python3 (python3-matplotlib, launch/setup.sh),
// on a synthetic run with a rewind: metrics.jsonl logs steps 1..30, then 21..40 again (with a null
// and a NaN loss, and val_loss every 10 steps), and alerts.jsonl holds four alerts written by
// alert_json, one a rewind from step 30 to 20. It exits 0, prints exactly one line per PNG whose
// counts show it read both files (points per plot, 2 segments, 4 alerts, 1 rewind), and writes
// four valid 1100 x 500 PNGs. Without matplotlib it exits 3 with one line and draws nothing; a
// run without metrics.jsonl exits 2 with one line.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "launch/train/alerts.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::read_file;
using testing::run_command;
using testing::TempDir;

const std::string kPython = "/usr/bin/python3";
const std::string kScript = std::string(KEEL_SOURCE_DIR) + "/launch/tools/plot_run.py";

std::string metrics_line(int step, bool rewound) {
  const double loss = 5.0 * std::exp(-step / 30.0) + 1.0 + (rewound && step >= 25 ? 3.0 : 0.0);
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"step\": %d, \"loss\": %.17g, \"z_loss\": 0.0001, \"grad_norm\": %.17g, "
                "\"lr\": %.9g, \"tokens\": %d, \"tokens_per_s\": 1000, \"max_attn_logit\": %.9g",
                step, loss, 1.0 / (1.0 + step / 10.0), 3e-4 * std::min(1.0, step / 10.0),
                step * 512, 5.0 + 0.1 * step);
  std::string line = buf;
  if (step % 10 == 0) line += ", \"val_loss\": " + std::to_string(loss + 0.1);
  return line + "}\n";
}

// Steps 1..30, then (after a rewind to step 20) 21..40. Step 28's loss is null (the trainer's
// non-finite value) and step 29's the NaN token older runs wrote: 48 finite losses.
std::string rewound_metrics() {
  std::string text;
  for (int step = 1; step <= 30; ++step) {
    std::string line = metrics_line(step, /*rewound=*/true);
    if (step == 28 || step == 29) {
      const size_t at = line.find("\"loss\": ") + 8;
      line.replace(at, line.find(',', at) - at, step == 28 ? "null" : "NaN");
    }
    text += line;
  }
  for (int step = 21; step <= 40; ++step) text += metrics_line(step, false);
  return text;
}

std::string rewound_alerts() {
  const double nan = std::nan("");
  std::string text;
  text += alert_json(Alert{.time = 1.0,
                           .step = 25,
                           .kind = "loss_spike",
                           .loss = 9.2,
                           .baseline = 3.1,
                           .threshold = 5.0,
                           .action = "skip",
                           .batches_skipped = 1,
                           .message = "loss spike"}) +
          "\n";
  text += alert_json(Alert{.time = 2.0,
                           .step = 27,
                           .kind = "grad_spike",
                           .grad_norm = 3.5,
                           .action = "skip",
                           .batches_skipped = 2}) +
          "\n";
  text += alert_json(Alert{.time = 3.0,
                           .step = 28,
                           .kind = "nonfinite_loss",
                           .loss = nan,
                           .action = "skip",
                           .batches_skipped = 3}) +
          "\n";
  text += alert_json(Alert{.time = 4.0,
                           .step = 30,
                           .kind = "rewind",
                           .action = "rewind",
                           .checkpoint = "run/checkpoints/step_00000020",
                           .rewound_to = 20,
                           .batches_skipped = 3,
                           .rewinds = 1}) +
          "\n";
  return text;
}

uint32_t big_endian_u32(const std::string& bytes, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

TEST(PlotRun, DrawsFourPngsWithAlertsAndTheRewind) {
  ASSERT_EQ(run_command(kPython + " -c 'import matplotlib'", TempDir()).exit_code, 0)
      << kPython << " has no matplotlib: launch/setup.sh installs python3-matplotlib";
  TempDir scratch;
  const std::string run = scratch.file("run");
  fs::create_directory(run);
  testing::write_file(run + "/metrics.jsonl", rewound_metrics());
  testing::write_file(run + "/alerts.jsonl", rewound_alerts());

  const auto r = run_command(command_line(kPython, {kScript, run}), scratch);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string tail = " segments=2 alerts=4 rewinds=1)\n";
  EXPECT_EQ(r.out, "plot_run: wrote " + run + "/plots/loss.png (points=53" + tail +  // 48 + 5
                       "plot_run: wrote " + run + "/plots/grad_norm.png (points=50" + tail +
                       "plot_run: wrote " + run + "/plots/lr.png (points=50" + tail +
                       "plot_run: wrote " + run + "/plots/max_attn_logit.png (points=50" + tail);
  EXPECT_EQ(r.err, "");
  for (const char* name : {"loss.png", "grad_norm.png", "lr.png", "max_attn_logit.png"}) {
    const std::string png = read_file(run + "/plots/" + name);
    ASSERT_GT(png.size(), 10000u) << name;  // a drawn figure, not an empty canvas
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << name;
    EXPECT_EQ(png.substr(12, 4), "IHDR") << name;
    EXPECT_EQ(big_endian_u32(png, 16), 1100u) << name;  // 11 x 5 inches at 100 dpi
    EXPECT_EQ(big_endian_u32(png, 20), 500u) << name;
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(run + "/plots"), fs::directory_iterator()), 4);
}

TEST(PlotRun, WithoutMatplotlibExits3WithOneLine) {
  TempDir scratch;
  const std::string run = scratch.file("run");
  fs::create_directories(run);
  fs::create_directories(scratch.file("hide/matplotlib"));
  testing::write_file(scratch.file("hide/matplotlib/__init__.py"),
                      "raise ImportError('hidden by the test')\n");
  testing::write_file(run + "/metrics.jsonl", rewound_metrics());
  const auto r = run_command("env PYTHONPATH=" + testing::shell_quote(scratch.file("hide")) + " " +
                                 command_line(kPython, {kScript, run}),
                             scratch);
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err,
            "plot_run: matplotlib is not installed (hidden by the test; apt-get install "
            "python3-matplotlib): no plots drawn\n");
  EXPECT_FALSE(fs::exists(run + "/plots"));
}

TEST(PlotRun, WithoutMetricsExits2WithOneLine) {
  TempDir scratch;
  const auto r = run_command(command_line(kPython, {kScript, scratch.path()}), scratch);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "plot_run: no metrics.jsonl in " + scratch.path() + ": nothing to plot\n");
}

}  // namespace
}  // namespace keel
