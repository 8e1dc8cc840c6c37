// Spike forensics through the real keel-train (Note [replay] in launch/train/forensics.h, Note
// [replica check] in launch/train/trainer_replay.cc): an injected bit flip in one rank's gradients
// is told apart from an injected loss spike, in one process and under mpiexec -n 4 at TP2xDP2. The
// flip's step replays differently: a nondeterministic_step alert names the flipped rank and its
// host, and spike.on_hardware_fault decides (CONTINUE: the replayed result is applied, no rewind;
// STOP: exit 4 with the state saved). The spike's step replays identically: the guard skips and
// rewinds as before, and no nondeterministic_step alert is raised. Every anomaly leaves
// RUN/anomalies/step_N/ with the batch and the per-layer statistics, bounded by
// spike.keep_anomalies. spike.replay_every samples healthy steps; spike.check_replicas catches a
// flipped parameter on one DP replica.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::TempDir;

const std::vector<std::string> kJob = {
    "--set", "model.d_model=32",     "--set", "model.n_layers=2",
    "--set", "model.n_heads=4",      "--set", "model.seq_len=16",
    "--set", "train.global_batch=8", "--set", "train.steps=40",
    "--set", "train.log_every=1",    "--set", "train.eval_every=0",
    "--set", "train.sample_chars=0", "--set", "train.threads=1",
    "--set", "checkpoint.every=10",  "--set", "spike.warmup_steps=20",
    "--set", "spike.window=20",      "--set", "data.builtin_bytes=100000",
    "--set", "optim.warmup_steps=5", "--set", "spike.grad_min_ratio=100"};

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The alert lines of `kind`.
std::vector<std::string> alerts_of(const std::string& run, const std::string& kind) {
  std::vector<std::string> out;
  for (const std::string& l : lines(read_file(run + "/alerts.jsonl"))) {
    if (l.find("\"kind\": \"" + kind + "\"") != std::string::npos) out.push_back(l);
  }
  return out;
}

class SpikeForensics : public ::testing::Test {
 protected:
  CommandResult train(const std::string& run, int ranks, std::vector<std::string> extra) {
    std::vector<std::string> args = kJob;
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--run-dir", dir_.file(run)});
    return run_command(testing::train_command(args, ranks), dir_);
  }
  std::string anomaly(const std::string& run, int step) const {
    char name[32];
    std::snprintf(name, sizeof(name), "step_%08d", step);
    return dir_.file(run) + "/anomalies/" + name;
  }
  // A bit flip at step 30 on `rank`: told apart as hardware; the run goes on with the replay.
  void expect_bitflip_named(int ranks, int rank, const std::vector<std::string>& layout) {
    std::vector<std::string> extra = layout;
    extra.insert(extra.end(), {"--set", "debug.inject_bitflip_at_step=30", "--set",
                               "debug.inject_bitflip_rank=" + std::to_string(rank)});
    const std::string run = "flip" + std::to_string(ranks);
    const CommandResult r = train(run, ranks, extra);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const std::vector<std::string> hw = alerts_of(dir_.file(run), "nondeterministic_step");
    ASSERT_EQ(hw.size(), 1u) << read_file(dir_.file(run) + "/alerts.jsonl");
    EXPECT_NE(hw[0].find("\"step\": 30"), std::string::npos) << hw[0];
    EXPECT_NE(hw[0].find("changed: rank " + std::to_string(rank) + " (host "), std::string::npos)
        << hw[0];
    EXPECT_NE(hw[0].find("suspected hardware fault"), std::string::npos) << hw[0];
    // The replayed (healthy) result was applied: nothing else was alerted (no skip, no rewind).
    EXPECT_EQ(lines(read_file(dir_.file(run) + "/alerts.jsonl")).size(), 1u)
        << read_file(dir_.file(run) + "/alerts.jsonl");
    const std::string summary = read_file(anomaly(run, 30) + "/summary.json");
    EXPECT_NE(summary.find("\"replay\": \"different\""), std::string::npos) << summary;
    EXPECT_NE(summary.find("\"kind\": \"grad_spike\""), std::string::npos) << summary;
    // The first computation's figures: the flipped gradient's norm is astronomically large, the
    // replay's is not.
    const size_t g = summary.find("\"grad_norm\": ");
    ASSERT_NE(g, std::string::npos);
    EXPECT_GT(std::stod(summary.substr(g + 13)), 1e20) << summary;
    const size_t rg = summary.find("\"replay_grad_norm\": ");
    ASSERT_NE(rg, std::string::npos);
    EXPECT_LT(std::stod(summary.substr(rg + 20)), 1e3) << summary;
    // The evidence: the batch (8 x 16 int32 token ids) and a gradient norm per block and one for
    // the rest.
    EXPECT_EQ(fs::file_size(anomaly(run, 30) + "/tokens.bin"), 8u * 16u * 4u);
    const size_t at = summary.find("\"grad_norm_layers\": [");
    ASSERT_NE(at, std::string::npos) << summary;
    const std::string layers = summary.substr(at, summary.find(']', at) - at);
    EXPECT_EQ(std::count(layers.begin(), layers.end(), ','), 2) << layers;
    EXPECT_NE(read_file(anomaly(run, 30) + "/alerts.jsonl").find("nondeterministic_step"),
              std::string::npos);
  }
  TempDir dir_{"keel_spike_forensics"};
};

TEST_F(SpikeForensics, ABitFlipIsNamedAsHardwareInOneProcess) {
  expect_bitflip_named(1, 0, {});
  // keel-ckpt anomaly prints the evidence: the verdict, the figures of both computations, the
  // block holding the corrupted gradient, the batch decoded (here as bytes: a byte vocabulary).
  const CommandResult a =
      run_command(testing::command_line(KEEL_CKPT_BIN, {"anomaly", anomaly("flip1", 30)}), dir_);
  ASSERT_EQ(a.exit_code, 0) << a.out << a.err;
  EXPECT_NE(a.out.find("step 30: grad_spike; replay: different (rank 0 (host "), std::string::npos)
      << a.out;
  EXPECT_NE(a.out.find("batch: 8 samples of 16 tokens"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("decoded as bytes"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("\n  [7] offset "), std::string::npos) << a.out;
  const CommandResult list =
      run_command(testing::command_line(KEEL_CKPT_BIN, {"anomaly", dir_.file("flip1")}), dir_);
  ASSERT_EQ(list.exit_code, 0) << list.out << list.err;
  EXPECT_NE(list.out.find("1 anomaly in "), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("step_00000030  step 30  grad_spike  replay different"),
            std::string::npos)
      << list.out;
  const CommandResult bad = run_command(
      testing::command_line(KEEL_CKPT_BIN, {"anomaly", dir_.file("flip1/checkpoints")}), dir_);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("not an anomaly directory"), std::string::npos) << bad.err;
}

// A JSON array field of summary.json as numbers.
std::vector<double> numbers(const std::string& json, const std::string& key) {
  std::vector<double> out;
  const size_t at = json.find("\"" + key + "\": [");
  if (at == std::string::npos) return out;
  std::istringstream in(json.substr(at + key.size() + 5, json.find(']', at) - at - key.size() - 5));
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stod(item));
  return out;
}

TEST_F(SpikeForensics, ABitFlipIsNamedAsHardwareAtTp2Dp2) {
  expect_bitflip_named(4, 2, {"--set", "parallel.tp=2"});
  // The evidence's per-block output norms (from the replay) are the whole batch's in any layout:
  // TP2xDP2 gives one process's to float rounding.
  expect_bitflip_named(1, 0, {});
  const std::vector<double> four =
      numbers(read_file(anomaly("flip4", 30) + "/summary.json"), "act_norm_layers");
  const std::vector<double> one =
      numbers(read_file(anomaly("flip1", 30) + "/summary.json"), "act_norm_layers");
  ASSERT_EQ(one.size(), 2u);
  ASSERT_EQ(four.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_GT(one[l], 1.0) << l;
    EXPECT_NEAR(four[l], one[l], 1e-3 * one[l]) << "block " << l;
  }
}

// An injected loss spike (the learning rate of step 30 x 1000) replays identically: the guard's
// usual skip and rewind, no hardware verdict, and the evidence says "same".
TEST_F(SpikeForensics, AnInjectedSpikeReplaysTheSame) {
  for (int ranks : {1, 4}) {
    SCOPED_TRACE(ranks);
    const std::string run = "spike" + std::to_string(ranks);
    std::vector<std::string> extra = {"--set", "debug.inject_spike_at_step=30"};
    if (ranks == 4) extra.insert(extra.end(), {"--set", "parallel.tp=2"});
    const CommandResult r = train(run, ranks, extra);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(alerts_of(dir_.file(run), "nondeterministic_step").empty());
    EXPECT_FALSE(alerts_of(dir_.file(run), "rewind").empty())
        << read_file(dir_.file(run) + "/alerts.jsonl");
    int replayed = 0;
    for (const auto& e : fs::directory_iterator(dir_.file(run) + "/anomalies")) {
      const std::string summary = read_file(e.path().string() + "/summary.json");
      EXPECT_NE(summary.find("\"replay\": \"same\""), std::string::npos) << summary;
      ++replayed;
    }
    EXPECT_GE(replayed, 1);
  }
}

// spike.on_hardware_fault=STOP: exit 4, one nondeterministic_step alert with action halt, and a
// checkpoint of the state before the flipped step's update.
TEST_F(SpikeForensics, StopOnAHardwareFaultExits4WithTheStateSaved) {
  const CommandResult r =
      train("stop", 1,
            {"--set", "debug.inject_bitflip_at_step=30", "--set", "spike.on_hardware_fault=STOP"});
  EXPECT_EQ(r.exit_code, 4) << r.out << r.err;
  const std::vector<std::string> hw = alerts_of(dir_.file("stop"), "nondeterministic_step");
  ASSERT_EQ(hw.size(), 1u);
  EXPECT_NE(hw[0].find("\"action\": \"halt\""), std::string::npos) << hw[0];
  EXPECT_NE(r.err.find("suspected hardware fault"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(dir_.file("stop") + "/checkpoints/LATEST"), "step_00000029\n");
}

// spike.replay=false: the flip is not told apart (the guard skips it as a gradient spike), and
// spike.keep_anomalies bounds the evidence to the newest directories.
TEST_F(SpikeForensics, WithoutReplayAFlipIsAGradSpikeAndEvidenceIsBounded) {
  const CommandResult r =
      train("noreplay", 1,
            {"--set", "debug.inject_bitflip_at_step=25", "--set", "debug.inject_every=5", "--set",
             "spike.replay=false", "--set", "spike.keep_anomalies=2"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(alerts_of(dir_.file("noreplay"), "nondeterministic_step").empty());
  EXPECT_FALSE(alerts_of(dir_.file("noreplay"), "grad_spike").empty());
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir_.file("noreplay") + "/anomalies")) {
    kept.push_back(e.path().filename().string());
    EXPECT_NE(read_file(e.path().string() + "/summary.json").find("\"replay\": \"not replayed\""),
              std::string::npos);
  }
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept.size(), 2u);
}

// The figures of each metrics line that a run computes (not its timings).
std::vector<std::string> computed(const std::string& metrics) {
  std::vector<std::string> out;
  for (const std::string& l : lines(metrics)) {
    const size_t a = l.find("\"loss\""), b = l.find("\"lr\"");
    out.push_back(l.substr(0, l.find(',')) + l.substr(a, b - a));
  }
  return out;
}

// spike.replay_every samples the hardware between anomalies: with the guard off, a flip on a
// sampled step is still named; replaying every step of a healthy run changes no bit of it and
// leaves no evidence.
TEST_F(SpikeForensics, ReplayEverySamplesHealthySteps) {
  const CommandResult r = train("sampled", 1,
                                {"--set", "spike.enabled=false", "--set", "spike.replay_every=5",
                                 "--set", "debug.inject_bitflip_at_step=30"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> hw = alerts_of(dir_.file("sampled"), "nondeterministic_step");
  ASSERT_EQ(hw.size(), 1u) << read_file(dir_.file("sampled") + "/alerts.jsonl");
  EXPECT_NE(hw[0].find("\"step\": 30"), std::string::npos) << hw[0];
  const CommandResult every = train("every", 1, {"--set", "spike.replay_every=1"});
  const CommandResult plain = train("plain", 1, {});
  ASSERT_EQ(every.exit_code, 0) << every.out << every.err;
  ASSERT_EQ(plain.exit_code, 0) << plain.out << plain.err;
  EXPECT_EQ(computed(read_file(dir_.file("every") + "/metrics.jsonl")),
            computed(read_file(dir_.file("plain") + "/metrics.jsonl")));
  EXPECT_EQ(read_file(dir_.file("every") + "/alerts.jsonl"), "");
  EXPECT_FALSE(fs::exists(dir_.file("every") + "/anomalies"));
}

// Note [replica check]: a flipped low bit of one parameter on DP replica rank 3 (TP2xDP2) is too
// small to spike; the checksum compare before the next periodic save names rank 3, CONTINUE
// copies DP rank 0's parameters over it and the run goes on (one alert: the replicas agree at the
// saves after); STOP exits 4 without saving, leaving the previous checkpoint.
TEST_F(SpikeForensics, TheReplicaCheckCatchesAFlippedParameter) {
  const std::vector<std::string> flip = {"--set", "parallel.tp=2",
                                         "--set", "debug.inject_param_bitflip_at_step=12",
                                         "--set", "debug.inject_bitflip_rank=3"};
  const CommandResult r = train("replica", 4, flip);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> bad = alerts_of(dir_.file("replica"), "replica_mismatch");
  ASSERT_EQ(bad.size(), 1u) << read_file(dir_.file("replica") + "/alerts.jsonl");
  EXPECT_NE(bad[0].find("\"step\": 20"), std::string::npos) << bad[0];
  EXPECT_NE(bad[0].find("rank 3 (host "), std::string::npos) << bad[0];
  EXPECT_NE(bad[0].find("\"action\": \"repair\""), std::string::npos) << bad[0];
  std::vector<std::string> stop = flip;
  stop.insert(stop.end(), {"--set", "spike.on_hardware_fault=STOP"});
  const CommandResult s = train("replica_stop", 4, stop);
  EXPECT_EQ(s.exit_code, 4) << s.out << s.err;
  EXPECT_NE(s.err.find("suspected hardware fault"), std::string::npos) << s.err;
  EXPECT_EQ(read_file(dir_.file("replica_stop") + "/checkpoints/LATEST"), "step_00000010\n");
}

}  // namespace
}  // namespace keel
