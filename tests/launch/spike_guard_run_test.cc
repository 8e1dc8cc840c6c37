// The spike guard through the real keel-train (Note [spike guard]): an injected spike (that
// step's learning rate x 1000) is detected within spike.patience steps, alerted, rewound to a
// checkpoint before it with the data skipped, and the run ends with a validation loss within 5%
// of the same run without the injection; the same happens, with the same alerts, under
// mpiexec -n 4 at TP2xDP2; a run killed after a rewind and resumed equals the uninterrupted one
// bit for bit (the skipped range is never replayed); repeated spikes beyond spike.max_rewinds
// halt with exit 3, an alert and a verified checkpoint; a healthy run raises nothing; the alert
// hook gets each alert's JSON line; TensorBoard files hold the scalars and the guard's events, and
// the plots are drawn.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "framework/tensorboard/tensorboard.h"
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
    "--set", "model.d_model=32",     "--set", "model.n_layers=2",
    "--set", "model.n_heads=4",      "--set", "model.seq_len=32",
    "--set", "train.global_batch=8", "--set", "train.steps=300",
    "--set", "train.log_every=1",    "--set", "train.eval_every=300",
    "--set", "train.eval_batches=8", "--set", "train.sample_chars=0",
    "--set", "train.threads=1",      "--set", "checkpoint.every=20",
    "--set", "checkpoint.keep=2",    "--set", "data.builtin_bytes=400000"};

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// A JSON field's raw text ("kind" -> "\"rewind\"").
std::string field(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 4;
  size_t end = begin;
  if (json[begin] == '"') {
    end = json.find('"', begin + 1) + 1;
  } else {
    while (end < json.size() && json[end] != ',' && json[end] != '}') ++end;
  }
  return json.substr(begin, end - begin);
}

// "step kind action rewound_to batches_skipped" per alert: what every layout must agree on.
std::string decisions(const std::string& alerts) {
  std::string out;
  for (const std::string& a : lines(alerts)) {
    out += field(a, "step") + " " + field(a, "kind") + " " + field(a, "action") + " " +
           field(a, "rewound_to") + " " + field(a, "batches_skipped") + "\n";
  }
  return out;
}

double final_val_loss(const std::string& metrics) {
  double v = -1;
  for (const std::string& l : lines(metrics)) {
    const std::string f = field(l, "val_loss");
    if (!f.empty()) v = std::stod(f);
  }
  return v;
}

class SpikeGuardRun : public ::testing::Test {
 protected:
  CommandResult train(const std::string& run, int ranks, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = kJob;
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--run-dir", dir_.file(run)});
    return run_command(testing::train_command(args, ranks), dir_);
  }
  std::string file(const std::string& run, const std::string& name) const {
    return read_file(dir_.file(run) + "/" + name);
  }
  static const std::vector<std::string> kSpike;
  TempDir dir_{"keel_spike_run"};
};
const std::vector<std::string> SpikeGuardRun::kSpike = {"--set", "debug.inject_spike_at_step=200"};

TEST_F(SpikeGuardRun, AnInjectedSpikeIsRewoundAndTheRunRecovers) {
  const CommandResult clean = train("clean", 1);
  ASSERT_EQ(clean.exit_code, 0) << clean.out << clean.err;
  EXPECT_EQ(file("clean", "alerts.jsonl"), "") << "a healthy run raises no alert";

  const CommandResult r = train("spiked", 1, kSpike);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> alerts = lines(file("spiked", "alerts.jsonl"));
  ASSERT_EQ(alerts.size(), 2u) << file("spiked", "alerts.jsonl");
  // Step 200's update is the spike; step 201's loss shows it (patience 2: skip, then rewind at
  // 202) to the newest checkpoint at or before 201 - rewind_margin 10 = 191: step 180. The data
  // from the checkpoint's position to 20 batches past step 201's first batch is skipped.
  EXPECT_EQ(field(alerts[0], "step"), "201");
  EXPECT_EQ(field(alerts[0], "kind"), "\"loss_spike\"");
  EXPECT_EQ(field(alerts[0], "action"), "\"skip\"");
  EXPECT_EQ(field(alerts[1], "step"), "202");
  EXPECT_EQ(field(alerts[1], "kind"), "\"rewind\"");
  EXPECT_EQ(field(alerts[1], "rewound_to"), "180");
  EXPECT_EQ(field(alerts[1], "checkpoint"),
            "\"" + dir_.file("spiked") + "/checkpoints/step_00000180\"");
  EXPECT_EQ(field(alerts[1], "batches_skipped"), "40");  // steps 181..200 and 20 past them
  // The alerts name the block with the largest attention logit (2 layers).
  for (const std::string& a : alerts) {
    const std::string layer = field(a, "max_attn_logit_layer");
    EXPECT_TRUE(layer == "0" || layer == "1") << a;
  }
  EXPECT_NE(r.err.find("keel-train: ALERT step 202: loss_spike for 2 steps from step 201: "
                       "rewound to " +
                       dir_.file("spiked") + "/checkpoints/step_00000180 (step 180)"),
            std::string::npos)
      << r.err;
  // TensorBoard holds the run's scalars and the guard's events; the plots were drawn.
  std::vector<TensorBoardEvent> events;
  for (const auto& e : fs::directory_iterator(dir_.file("spiked") + "/tensorboard")) {
    for (TensorBoardEvent& ev : read_tensorboard_events(e.path().string())) {
      events.push_back(std::move(ev));
    }
  }
  std::map<std::string, int> points;
  int64_t rewind_step = -1;
  for (const TensorBoardEvent& ev : events) {
    for (const TensorBoardValue& v : ev.values) {
      ++points[v.tag];
      if (v.tag == "alerts/rewind") rewind_step = ev.step;
    }
  }
  EXPECT_EQ(points["train/loss"], 322);  // 300 steps, 22 of them (181..202) twice
  // One attention-logit curve per block.
  EXPECT_EQ(points["attn_logit/layer_00"], 322);
  EXPECT_EQ(points["attn_logit/layer_01"], 322);
  EXPECT_EQ(points.count("attn_logit/layer_02"), 0u);
  EXPECT_EQ(points["val/loss"], 1);
  EXPECT_EQ(points["alerts/loss_spike"], 1);
  EXPECT_EQ(points["alerts/text"], 2);
  EXPECT_EQ(rewind_step, 202);
  EXPECT_NE(r.out.find("keel-train: plots in " + dir_.file("spiked") + "/plots/"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(read_file(dir_.file("spiked") + "/plots/loss.png").substr(1, 3), "PNG");
  // The skipped range is in the run state of every later checkpoint.
  const CommandResult info =
      run_command(command_line(KEEL_CKPT_BIN, {"info", dir_.file("spiked")}), dir_);
  EXPECT_NE(info.out.find("| skipped ranges 1"), std::string::npos) << info.out;
  // Recovered: the final validation loss is within 5% of the clean run's.
  const double a = final_val_loss(file("clean", "metrics.jsonl"));
  const double b = final_val_loss(file("spiked", "metrics.jsonl"));
  ASSERT_GT(a, 0);
  ASSERT_GT(b, 0);
  EXPECT_LT(std::abs(b - a), 0.05 * a) << "clean " << a << ", spiked " << b;

  // TP2xDP2 takes the same decisions (every rank decides on all-reduced values; a rank that
  // decided otherwise would leave the others in a collective).
  const CommandResult t = train("tp2dp2", 4, {"--set", "parallel.tp=2", "--set", kSpike[1]});
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;
  EXPECT_EQ(decisions(file("tp2dp2", "alerts.jsonl")), decisions(file("spiked", "alerts.jsonl")));
  const double c = final_val_loss(file("tp2dp2", "metrics.jsonl"));
  EXPECT_NEAR(c, b, 1e-3 * b);

  // Killed after the rewind (step 250) and resumed: every later step equals the uninterrupted
  // run's bit for bit, so the skipped range was not replayed.
  std::vector<std::string> kill = kSpike;
  kill.insert(kill.end(), {"--set", "debug.kill_at_step=250", "--set", "debug.kill_rank=0"});
  ASSERT_NE(train("resumed", 1, kill).exit_code, 0);
  const CommandResult again = train("resumed", 1, kSpike);
  ASSERT_EQ(again.exit_code, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("at step 240"), std::string::npos) << again.out;
  const std::vector<std::string> straight = lines(file("spiked", "metrics.jsonl"));
  const std::vector<std::string> resumed = lines(file("resumed", "metrics.jsonl"));
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = resumed.size() - 60; i < resumed.size(); ++i) {  // steps 241..300
    EXPECT_EQ(field(resumed[i], "loss"), field(straight[i], "loss")) << resumed[i];
    EXPECT_EQ(field(resumed[i], "grad_norm"), field(straight[i], "grad_norm")) << resumed[i];
  }
  EXPECT_EQ(read_file(dir_.file("resumed") + "/checkpoints/step_00000300/shard_00000.bin"),
            read_file(dir_.file("spiked") + "/checkpoints/step_00000300/shard_00000.bin"));
}

// spike.lr_scale / cooldown_steps: after the rewind to step 180, steps 181-190 run at 0.1 x the
// schedule's learning rate ramping back to 1 x (the clean run's lr at the same step), then 1 x.
TEST_F(SpikeGuardRun, CooldownAfterARewind) {
  const CommandResult r = train("cool", 1,
                                {"--set", kSpike[1], "--set", "train.steps=215", "--set",
                                 "spike.lr_scale=0.1", "--set", "spike.cooldown_steps=10"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const CommandResult c = train("clean2", 1, {"--set", "train.steps=215"});
  ASSERT_EQ(c.exit_code, 0) << c.out << c.err;
  std::map<int, double> clean_lr, cool_lr;
  for (const std::string& l : lines(file("clean2", "metrics.jsonl"))) {
    clean_lr[std::stoi(field(l, "step"))] = std::stod(field(l, "lr"));
  }
  for (const std::string& l : lines(file("cool", "metrics.jsonl"))) {
    cool_lr[std::stoi(field(l, "step"))] = std::stod(field(l, "lr"));  // the last line wins
  }
  for (int step = 181; step <= 192; ++step) {
    const double factor = step <= 190 ? 0.1 + 0.9 * (step - 181) / 10.0 : 1.0;
    EXPECT_NEAR(cool_lr.at(step), factor * clean_lr.at(step), 1e-6 * clean_lr.at(step)) << step;
  }
}

TEST_F(SpikeGuardRun, RepeatedSpikesHaltWithExit3) {
  const CommandResult r =
      train("halt", 1,
            {"--set", "debug.inject_spike_at_step=150", "--set", "debug.inject_every=25", "--set",
             "spike.max_rewinds=1", "--set", "spike.warmup_steps=100"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  const std::vector<std::string> alerts = lines(file("halt", "alerts.jsonl"));
  ASSERT_FALSE(alerts.empty());
  EXPECT_EQ(field(alerts.back(), "kind"), "\"halt\"");
  EXPECT_EQ(field(alerts.back(), "rewinds"), "2");
  const std::string latest = file("halt", "checkpoints/LATEST");
  ASSERT_FALSE(latest.empty());
  EXPECT_EQ(field(alerts.back(), "checkpoint"), "\"" + dir_.file("halt") + "/checkpoints/" +
                                                    latest.substr(0, latest.size() - 1) + "\"");
  EXPECT_EQ(run_command(command_line(KEEL_CKPT_BIN, {"verify", dir_.file("halt")}), dir_).exit_code,
            0);
  EXPECT_NE(r.err.find("keel-train: halted by the spike guard at step "), std::string::npos)
      << r.err;
}

TEST_F(SpikeGuardRun, TheAlertHookGetsEachAlertsJson) {
  const std::string got = dir_.file("hook.jsonl");
  const CommandResult r =
      train("hook", 1, {"--set", kSpike[1], "--set", "alert.command=cat >> " + got});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string alerts = file("hook", "alerts.jsonl");
  EXPECT_FALSE(alerts.empty());
  EXPECT_EQ(read_file(got), alerts);
}

// Without checkpoints the guard skips, says once that it cannot rewind, and (the injected spike
// having been applied, the loss stays high) halts once the streak passes spike.max_skipped_steps.
TEST_F(SpikeGuardRun, WithoutCheckpointsItSkipsAndSaysOnceItCannotRewind) {
  const CommandResult r = train("nockpt", 1, {"--set", "checkpoint.every=0", "--set", kSpike[1]});
  ASSERT_EQ(r.exit_code, 3) << r.out << r.err;
  const std::vector<std::string> alerts = lines(file("nockpt", "alerts.jsonl"));
  ASSERT_GE(alerts.size(), 22u) << file("nockpt", "alerts.jsonl");
  int cannot = 0;
  for (size_t i = 0; i + 1 < alerts.size(); ++i) {
    cannot += field(alerts[i], "kind") == "\"cannot_rewind\"";
    EXPECT_EQ(field(alerts[i], "action"), "\"skip\"") << alerts[i];
  }
  EXPECT_EQ(cannot, 1) << file("nockpt", "alerts.jsonl");
  EXPECT_EQ(field(alerts.back(), "kind"), "\"halt\"");
  EXPECT_NE(alerts.back().find("consecutive anomalous steps, more than spike.max_skipped_steps=20"),
            std::string::npos)
      << alerts.back();
}

// step -> the raw "loss" and "grad_norm" text of its last metrics line (a step replayed after a
// rewind is logged again; the replay is what counts).
std::map<int64_t, std::string> last_figures(const std::string& metrics) {
  std::map<int64_t, std::string> out;
  for (const std::string& l : lines(metrics)) {
    out[std::stoll(field(l, "step"))] = field(l, "loss") + " " + field(l, "grad_norm");
  }
  return out;
}

// Note [durable rewind]: a rank killed right after a rewind (debug.fault_point=AFTER_REWIND)
// resumes into the rewound state, not the checkpoint as it was before: the skipped range and the
// rewind count survive, so the restart neither replays the bad data nor rewinds again, and ends
// bit for bit as the uninterrupted run.
TEST_F(SpikeGuardRun, ACrashRightAfterARewindResumesIntoTheRewoundState) {
  const CommandResult straight = train("straight", 1, kSpike);
  ASSERT_EQ(straight.exit_code, 0) << straight.out << straight.err;
  std::vector<std::string> kill = kSpike;
  kill.insert(kill.end(),
              {"--set", "debug.kill_at_step=202", "--set", "debug.fault_point=AFTER_REWIND"});
  const CommandResult killed = train("killed", 1, kill);
  ASSERT_EQ(killed.exit_code, 128 + 9) << killed.out << killed.err;
  EXPECT_NE(killed.err.find("killing this rank at step 202 (AFTER_REWIND)"), std::string::npos)
      << killed.err;
  // What the crash left is the rewound state: step 180's checkpoint now records the skipped
  // range (and the rewind).
  const CommandResult info =
      run_command(command_line(KEEL_CKPT_BIN, {"info", dir_.file("killed")}), dir_);
  EXPECT_NE(info.out.find("step_00000180"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("| skipped ranges 1"), std::string::npos) << info.out;
  const CommandResult resumed = train("killed", 1, kSpike);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_NE(resumed.out.find("resuming from " + dir_.file("killed") +
                             "/checkpoints/step_00000180 at step 180"),
            std::string::npos)
      << resumed.out;
  // The restart neither meets the spike again nor rewinds: it raises no alert of its own.
  EXPECT_EQ(resumed.err.find("ALERT"), std::string::npos) << resumed.err;
  // One rewind in all: the alerts are the uninterrupted run's (the rewind's own alerts, of steps
  // after the checkpoint it committed, are kept on resume).
  EXPECT_EQ(decisions(file("killed", "alerts.jsonl")), decisions(file("straight", "alerts.jsonl")));
  EXPECT_EQ(lines(file("killed", "alerts.jsonl")).size(), 2u);
  EXPECT_EQ(last_figures(file("killed", "metrics.jsonl")),
            last_figures(file("straight", "metrics.jsonl")));
  EXPECT_EQ(file("killed", "checkpoints/step_00000300/shard_00000.bin"),
            file("straight", "checkpoints/step_00000300/shard_00000.bin"));
}

// A streak of anomalies that no rewind can end (here: no checkpoints, a NaN every step from step
// 30) halts once it passes spike.max_skipped_steps (default 20), with exit 3, a halt alert saying
// why and the last good state saved, instead of skipping every update and ending "done".
TEST_F(SpikeGuardRun, SkippedStepsBeyondTheBoundHalt) {
  const CommandResult r = train("skips", 1,
                                {"--set", "checkpoint.every=0", "--set",
                                 "debug.inject_nan_at_step=30", "--set", "debug.inject_every=1"});
  EXPECT_EQ(r.exit_code, 3) << r.out << r.err;
  const std::vector<std::string> alerts = lines(file("skips", "alerts.jsonl"));
  ASSERT_FALSE(alerts.empty());
  const std::string& last = alerts.back();
  EXPECT_EQ(field(last, "kind"), "\"halt\"");
  EXPECT_EQ(field(last, "step"), "50");  // steps 30..50: 21 anomalous steps, one more than 20
  EXPECT_NE(last.find("21 consecutive anomalous steps, more than spike.max_skipped_steps=20 "
                      "(from step 30; no rewind ended them); no checkpoint to restore"),
            std::string::npos)
      << last;
  // Every update from step 30 on was skipped: the saved state is step 50's, and it verifies.
  EXPECT_EQ(file("skips", "checkpoints/LATEST"), "step_00000050\n");
  EXPECT_EQ(
      run_command(command_line(KEEL_CKPT_BIN, {"verify", dir_.file("skips")}), dir_).exit_code, 0);
  // The bound is a config field: a larger one lets the same run skip longer.
  const CommandResult longer =
      train("longer", 1,
            {"--set", "checkpoint.every=0", "--set", "debug.inject_nan_at_step=30", "--set",
             "debug.inject_every=1", "--set", "spike.max_skipped_steps=40"});
  EXPECT_EQ(longer.exit_code, 3) << longer.out << longer.err;
  EXPECT_EQ(field(lines(file("longer", "alerts.jsonl")).back(), "step"), "70");
}

// A stop signal that arrives while the guard rewinds (here: sent by the alert hook of the rewind
// alert, so it lands during the rewind's save or a few steps after it, however fast the machine)
// stops the run with a checkpoint that resumes into the rewound state: exit 0, and the restart
// ends bit for bit as the uninterrupted run, with no second rewind.
TEST_F(SpikeGuardRun, AStopSignalDuringARewindSavesTheRewoundState) {
  const CommandResult straight = train("straight", 1, kSpike);
  ASSERT_EQ(straight.exit_code, 0) << straight.out << straight.err;
  std::vector<std::string> term = kSpike;
  term.insert(term.end(),
              {"--set", "alert.command=grep -q '\"kind\": \"rewind\"' && kill -TERM $PPID"});
  const CommandResult stopped = train("stopped", 1, term);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.out << stopped.err;
  const size_t at = stopped.out.find("keel-train: stopped by SIGTERM");
  ASSERT_NE(at, std::string::npos) << stopped.out;
  const CommandResult resumed = train("stopped", 1, kSpike);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_EQ(resumed.err.find("ALERT"), std::string::npos) << resumed.err;
  EXPECT_EQ(decisions(file("stopped", "alerts.jsonl")),
            decisions(file("straight", "alerts.jsonl")));
  EXPECT_EQ(last_figures(file("stopped", "metrics.jsonl")),
            last_figures(file("straight", "metrics.jsonl")));
  EXPECT_EQ(file("stopped", "checkpoints/step_00000300/shard_00000.bin"),
            file("straight", "checkpoints/step_00000300/shard_00000.bin"));
}

}  // namespace
}  // namespace keel
