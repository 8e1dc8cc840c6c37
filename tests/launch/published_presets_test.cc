// The presets at published sizes in launch/configs/published/ (read at test time): GPT-2 small,
// and Qwen3-0.6B-, OLMo 2-1B- and Gemma 3-1B-shaped models. Each
//   - has exactly the published parameter count (GPT::count_parameters declares the parameters
//     as the model does without allocating them), which its header states;
//   - states its estimated memory per GPU at 1 GPU and at 8 (DP8 with ZeRO-1) in its header and
//     in docs/model.md's table, as layers/memory_estimate computes them for the preset's
//     micro-batch in BF16 on a GPU, at the precision printed (three significant digits);
//   - trains a few steps with the real keel-train on the CPU at a short context and a batch of
//     two, the loss finite and falling from about ln(vocab_size); GPT-2 small at its full depth,
//     Qwen3 at two layers, OLMo 2 and Gemma 3 (with 411M and 302M parameters of embeddings) at one,
//     whose every tensor has the published shape (a 1B model's 16 GiB of parameters, gradients and
//     AdamW moments would not fit a test on a shared 24 GiB machine).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/device_backend.h"
#include "layers/gpt.h"
#include "layers/memory_estimate.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::CommandResult;
using testing::metric_losses;
using testing::read_file;
using testing::run_command;
using testing::TempDir;

struct Published {
  const char* name;    // launch/configs/published/<name>.pbtxt
  int64_t parameters;  // the published count
  int layers;          // the depth the training test runs at
};

// GPT-2 small: 124,439,808 with the LM head tied (llm.c's reproduction; the Hugging Face
// checkpoint's tensors). The others: the sums of the published checkpoints' tensors, which
// their model cards round to 0.6B, 1.5B and 1B.
constexpr Published kPresets[] = {
    {"gpt2_124m", 124'439'808, 12},
    {"qwen3_0.6b", 596'049'920, 2},
    {"olmo2_1b", 1'484'916'736, 1},
    {"gemma3_1b", 999'885'952, 1},
};

// gtest prints a parameter by name rather than as bytes.
void PrintTo(const Published& p, std::ostream* os) { *os << p.name; }

std::string preset_path(const Published& p) {
  return std::string(KEEL_SOURCE_DIR) + "/launch/configs/published/" + p.name + ".pbtxt";
}

// 124439808 -> "124,439,808".
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// A pbtxt's header comment as one line: the leading "# " of each line dropped, lines joined by
// spaces.
std::string header_text(const std::string& file) {
  std::istringstream in(file);
  std::string out;
  for (std::string line; std::getline(in, line) && line.rfind("#", 0) == 0;) {
    if (!out.empty()) out += ' ';
    out.append(line, line.size() > 1 ? 2 : 1);
  }
  return out;
}

struct GpuMemory {
  std::string one, eight;  // format_bytes of the estimate at 1 GPU and at 8 (DP8, ZeRO-1)
};

GpuMemory gpu_memory(const config::KeelConfig& cfg) {
  const int64_t micro = cfg.train().micro_batch();
  config::KeelConfig zero1 = cfg;
  zero1.mutable_parallel()->set_zero_stage(1);
  return {format_bytes(estimate_memory(cfg, 1, 1, micro, 1, Device::kCuda).total()),
          format_bytes(estimate_memory(zero1, 1, 8, micro, 1, Device::kCuda).total())};
}

TEST(PublishedPresets, ParameterCountsAreThePublishedOnes) {
  for (const Published& p : kPresets) {
    const config::KeelConfig cfg = load_config(preset_path(p), {});
    EXPECT_EQ(GPT::count_parameters(cfg), p.parameters) << p.name;
    const std::string header = header_text(read_file(preset_path(p)));
    EXPECT_NE(header.find(with_commas(p.parameters) + " parameters, as published"),
              std::string::npos)
        << p.name << ": the header must state " << with_commas(p.parameters) << "\n"
        << header;
  }
}

TEST(PublishedPresets, StateTheirMemoryPerGpuAsEstimated) {
  const std::string docs = read_file(std::string(KEEL_SOURCE_DIR) + "/docs/model.md");
  for (const Published& p : kPresets) {
    const config::KeelConfig cfg = load_config(preset_path(p), {});
    ASSERT_GT(cfg.train().micro_batch(), 0) << p.name << " states its micro-batch";
    const GpuMemory m = gpu_memory(cfg);
    std::printf("%s: %s parameters, %s at 1 GPU, %s per GPU at 8 (DP8, ZeRO-1)\n", p.name,
                with_commas(p.parameters).c_str(), m.one.c_str(), m.eight.c_str());
    const std::string header = header_text(read_file(preset_path(p)));
    EXPECT_NE(header.find("1 GPU " + m.one + "; 8 GPUs (DP8, ZeRO-1) " + m.eight),
              std::string::npos)
        << p.name << ": the header must state 1 GPU " << m.one << "; 8 GPUs (DP8, ZeRO-1) "
        << m.eight << "\n"
        << header;
    const std::string row_start = "| `published/" + std::string(p.name) + ".pbtxt` |";
    const size_t row = docs.find(row_start);
    ASSERT_NE(row, std::string::npos) << "docs/model.md has no row " << row_start;
    const std::string line = docs.substr(row, docs.find('\n', row) - row);
    EXPECT_NE(line.find("| " + with_commas(p.parameters) + " |"), std::string::npos) << line;
    EXPECT_NE(line.find("| " + m.one + " | " + m.eight + " |"), std::string::npos)
        << "docs/model.md: " << line << "\nwant | " << m.one << " | " << m.eight << " |";
  }
}

class PublishedPresetTest : public ::testing::TestWithParam<Published> {};

TEST_P(PublishedPresetTest, TrainsAFewStepsOnTheCpu) {
  const Published& p = GetParam();
  constexpr int kSteps = 3;
  TempDir dir(std::string("keel_published_") + p.name);
  const std::string run = dir.file("run");
  const config::KeelConfig cfg = load_config(preset_path(p), {});
  const std::vector<std::string> sets = {
      "model.n_layers=" + std::to_string(p.layers),
      "model.seq_len=32",
      "train.steps=" + std::to_string(kSteps),
      "train.global_batch=2",
      "train.micro_batch=2",
      "train.log_every=1",
      "train.eval_every=0",
      "train.sample_chars=0",
      "train.plot=false",
      "train.tensorboard=false",
      "optim.warmup_steps=0",
      "optim.lr=1e-3",
      "checkpoint.every=0",
      "checkpoint.every_minutes=0",
  };
  std::vector<std::string> args = {preset_path(p), "--run-dir", run};
  for (const std::string& s : sets) {
    args.push_back("--set");
    args.push_back(s);
  }
  const CommandResult t = run_command(command_line(KEEL_TRAIN_BIN, args), dir);
  ASSERT_EQ(t.exit_code, 0) << t.out << t.err;

  config::KeelConfig reduced = cfg;
  reduced.mutable_model()->set_n_layers(p.layers);
  const int64_t n = GPT::count_parameters(reduced);
  EXPECT_NE(t.out.find("keel-train: " + std::to_string(n) + " parameters"), std::string::npos)
      << t.out;

  const std::vector<double> loss = metric_losses(read_file(run + "/metrics.jsonl"));
  ASSERT_EQ(loss.size(), static_cast<size_t>(kSteps)) << t.out;
  for (double l : loss) ASSERT_TRUE(std::isfinite(l)) << p.name;
  const double ln_v = std::log(static_cast<double>(cfg.model().vocab_size()));
  std::printf("%s at %d layers (%lld parameters): loss %.3f -> %.3f (ln V = %.3f)\n", p.name,
              p.layers, static_cast<long long>(n), loss.front(), loss.back(), ln_v);
  // An untrained model starts near ln(V): above it by the spread of its initial logits (0.64 nats
  // measured for OLMo 2, whose post-sublayer norms leave the residual stream unnormalised).
  EXPECT_GT(loss.front(), ln_v - 0.5) << p.name << ": an untrained model starts near ln(V)";
  EXPECT_LT(loss.front(), ln_v + 1.5) << p.name << ": an untrained model starts near ln(V)";
  EXPECT_LT(loss.back(), loss.front() - 0.5) << p.name << ": the loss did not fall";
}

INSTANTIATE_TEST_SUITE_P(Presets, PublishedPresetTest, ::testing::ValuesIn(kPresets),
                         [](const ::testing::TestParamInfo<Published>& i) {
                           std::string name = i.param.name;
                           for (char& c : name) {
                             if (c == '.') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace keel
