// The presets in launch/configs/ (read at test time, so tuning one needs no change here): each
// parses and validates, trains a few steps with the real keel-train on the built-in corpus with a
// finite loss that falls, and its checkpoint exports as the architecture it claims:
// gpt2_small as GPT-2, olmo2_small as OLMo 2, qwen3_small as Qwen3 (with config.json carrying the
// preset's rope_theta), gemma3_small and default under keel's names (gemma3_small two options,
// its GeGLU MLP and sandwich norms, away from Qwen3). A preset added without an entry here fails,
// so each states how it exports. The full 600-step runs and their losses are in each preset's
// header comment; tests/launch/default_job_test trains default.pbtxt in full.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::command_line;
using testing::CommandResult;
using testing::metric_losses;
using testing::read_file;
using testing::run_command;
using testing::TempDir;

constexpr int kSteps = 30;

struct Expected {
  std::string naming;  // what keel-ckpt export calls the names: "GPT-2", "OLMo 2", "Qwen3", "keel"
  std::string model_type;     // config.json's, for the Hugging Face ones
  std::string rope_theta;     // config.json's, as written, for OLMo 2 and Qwen3
  std::string not_qwen3;      // keel names: the "not Qwen3" line's reasons, when checked
  std::string kv_heads = "";  // config.json's num_key_value_heads, when checked
};

const std::map<std::string, Expected>& expected() {
  static const std::map<std::string, Expected> e = {
      {"default", {"keel", "", "", ""}},
      {"gpt2_small", {"GPT-2", "gpt2", "", ""}},
      {"olmo2_small", {"OLMo 2", "olmo2", "500000.0", ""}},
      {"qwen3_small", {"Qwen3", "qwen3", "1000000.0", "", "2"}},  // grouped-query: 4 on 2
      {"gemma3_small",
       {"keel", "", "",
        "model.mlp=GEGLU (Qwen3's MLP is SwiGLU); model.norm_placement=SANDWICH (Qwen3 "
        "normalises each sublayer's input)"}},
      {"sweep", {"keel", "", "", ""}},  // launch/tools/keel-sweep's base config
  };
  return e;
}

std::string configs_dir() { return std::string(KEEL_SOURCE_DIR) + "/launch/configs"; }

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / static_cast<double>(end - begin);
}

TEST(Presets, EveryPresetParsesValidatesAndSaysHowItExports) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(configs_dir())) {
    if (entry.path().extension() != ".pbtxt") continue;
    const std::string name = entry.path().stem();
    found.push_back(name);
    EXPECT_TRUE(expected().count(name))
        << name << ".pbtxt: add it to this test's table with the naming it exports under";
    // load_config merges the file over the defaults and validates; it throws on any error.
    const config::KeelConfig cfg = load_config(entry.path(), {});
    EXPECT_EQ(cfg.data().format(), config::BUILTIN) << name << " trains on the built-in corpus";
    EXPECT_EQ(cfg.model().vocab_size(), 256) << name << ": byte-level";
  }
  for (const auto& [name, e] : expected()) {
    EXPECT_NE(std::find(found.begin(), found.end(), name), found.end()) << name << " is missing";
  }
}

class PresetTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PresetTest, TrainsAFewStepsWithFallingLossAndExportsAsItsArchitecture) {
  const std::string name = GetParam();
  const Expected& want = expected().at(name);
  TempDir dir("keel_preset_" + name);
  const std::string run = dir.file("run"), out = dir.file("export");
  const CommandResult t = run_command(
      command_line(KEEL_TRAIN_BIN,
                   {configs_dir() + "/" + name + ".pbtxt", "--set",
                    "train.steps=" + std::to_string(kSteps), "--set", "train.log_every=1", "--set",
                    "train.eval_every=0", "--set", "train.sample_chars=0", "--set",
                    "checkpoint.every=" + std::to_string(kSteps), "--run-dir", run}),
      dir);
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;

  const std::vector<double> loss = metric_losses(read_file(run + "/metrics.jsonl"));
  ASSERT_EQ(loss.size(), static_cast<size_t>(kSteps));
  for (double l : loss) ASSERT_TRUE(std::isfinite(l)) << name;
  // From about ln(256) = 5.55 nats at step 1; still in warm-up (40 steps) at step 30.
  const double first = mean(loss, 0, 5), last = mean(loss, kSteps - 5, kSteps);
  std::printf("%s: mean loss of steps 1-5 %.4f, of steps %d-%d %.4f\n", name.c_str(), first,
              kSteps - 4, kSteps, last);
  EXPECT_GT(loss[0], 5.0) << name << ": an untrained byte-level model starts near ln(256)";
  EXPECT_LT(last, first - 1.0) << name << ": the loss did not fall";

  const CommandResult e = run_command(command_line(KEEL_CKPT_BIN, {"export", run, out}), dir);
  ASSERT_EQ(e.exit_code, 0) << e.out << e.err;
  EXPECT_NE(e.out.find("/model.safetensors (" + want.naming + " names)"), std::string::npos)
      << e.out;
  const bool hf = want.naming != "keel";
  EXPECT_EQ(fs::exists(out + "/config.json"), hf) << e.out;
  if (hf) {
    const std::string config = read_file(out + "/config.json");
    EXPECT_NE(config.find("\"model_type\": \"" + want.model_type + "\""), std::string::npos)
        << config;
    if (!want.kv_heads.empty()) {
      EXPECT_NE(config.find("\"num_key_value_heads\": " + want.kv_heads + ","), std::string::npos)
          << config;
    }
    if (!want.rope_theta.empty()) {
      EXPECT_NE(config.find("\"rope_theta\": " + want.rope_theta + ","), std::string::npos)
          << config;
    }
  } else {
    EXPECT_EQ(e.out.rfind("keel names, no config.json: no Hugging Face architecture matches", 0),
              0u)
        << e.out;
    if (!want.not_qwen3.empty()) {
      EXPECT_NE(e.out.find("\n  not Qwen3: " + want.not_qwen3 + "\n"), std::string::npos) << e.out;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LaunchConfigs, PresetTest,
                         ::testing::Values("default", "gpt2_small", "olmo2_small", "qwen3_small",
                                           "gemma3_small", "sweep"));

}  // namespace
}  // namespace keel
