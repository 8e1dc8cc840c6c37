// Tests for launch/trainer: bit-identical runs from the same config and seed (and different ones
// from another seed), gradient accumulation equal to one large batch, metrics.jsonl's fields and
// round-trip float precision, evaluate() leaving the training state untouched, and z-loss
// accounting. All on a tiny model in one process (Topology::single).
#include "launch/train/trainer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/optim/optimizer.h"
#include "parallel/communicator.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::read_file;
using testing::TempDir;

// A tiny byte-level job: 2 layers, d_model 32, 16-token windows, batches of 8.
config::KeelConfig tiny_config(std::vector<std::string> sets = {}) {
  std::vector<std::string> all = {"model.seq_len=16",         "model.d_model=32",
                                  "model.n_layers=2",         "model.n_heads=2",
                                  "train.global_batch=8",     "train.steps=6",
                                  "train.eval_batches=1",     "train.sample_chars=0",
                                  "data.builtin_bytes=60000", "optim.warmup_steps=2"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// A Trainer with its own single-process topology (the Trainer keeps a reference to it).
class TrainerRun {
 public:
  explicit TrainerRun(const config::KeelConfig& cfg, std::string run_dir = "",
                      std::function<int()> stop_signal = {})
      : topo_(Topology::single(tp_, dp_)) {
    TrainerOptions opts;
    opts.run_dir = std::move(run_dir);
    opts.stop_signal = std::move(stop_signal);
    opts.progress = false;
    trainer_ = std::make_unique<Trainer>(cfg, topo_, opts);
  }
  Trainer& operator*() { return *trainer_; }
  Trainer* operator->() { return trainer_.get(); }

  std::vector<float> params() {
    ParamStore& ps = trainer_->model().params();
    const float* p = ps.params().f32();
    return std::vector<float>(p, p + ps.total_elems());
  }

 private:
  std::unique_ptr<Communicator> tp_, dp_;
  Topology topo_;
  std::unique_ptr<Trainer> trainer_;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(TrainerTest, SameConfigAndSeedIsBitIdentical) {
  const config::KeelConfig cfg = tiny_config();
  TrainerRun a(cfg), b(cfg);
  // Interleaved, so state shared between trainers (or left over in a global) would show.
  for (int s = 1; s <= 5; ++s) {
    const StepResult ra = a->step();
    const StepResult rb = b->step();
    EXPECT_EQ(ra.step, s);
    EXPECT_EQ(ra.loss, rb.loss) << "step " << s;
    EXPECT_EQ(ra.z_loss, rb.z_loss) << "step " << s;
    EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << s;
    EXPECT_EQ(ra.lr, rb.lr) << "step " << s;
    EXPECT_EQ(ra.max_attn_logit, rb.max_attn_logit) << "step " << s;
    EXPECT_TRUE(std::isfinite(ra.loss) && std::isfinite(ra.grad_norm)) << "step " << s;
  }
  EXPECT_TRUE(same_bits(a.params(), b.params())) << "parameters differ after 5 steps";
  EXPECT_EQ(a->evaluate(), b->evaluate());
}

// optim.schedule=WSD through the trainer: each step's learning rate is the schedule's (the peak
// through the stable phase, then down to the floor), and a run planned longer is the same run,
// bit for bit, until the shorter one's decay starts, which is what lets a WSD run be extended.
TEST(TrainerTest, WsdRunsShareTheirStablePhase) {
  const std::vector<std::string> wsd = {"optim.schedule=WSD", "optim.decay_steps=4",
                                        "optim.lr=2e-3"};
  std::vector<std::string> short_sets = wsd, long_sets = wsd;
  short_sets.push_back("train.steps=10");
  long_sets.push_back("train.steps=30");
  const config::KeelConfig short_cfg = tiny_config(short_sets), long_cfg = tiny_config(long_sets);
  TrainerRun a(short_cfg), b(long_cfg);
  for (int s = 1; s <= 10; ++s) {
    const StepResult ra = a->step();
    const StepResult rb = b->step();
    EXPECT_EQ(ra.lr, learning_rate(short_cfg.optim(), s - 1, 10)) << "step " << s;
    if (s >= 3 && s <= 7) {
      EXPECT_EQ(ra.lr, 2e-3f) << "step " << s << ": the stable phase";
    }
    if (s <= 7) {  // 0-based step 6 starts the decay at its top
      EXPECT_EQ(ra.lr, rb.lr) << "step " << s;
      EXPECT_EQ(ra.loss, rb.loss) << "step " << s;
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "step " << s;
    } else {
      EXPECT_LT(ra.lr, rb.lr) << "step " << s << ": the short run decays";
    }
  }
  EXPECT_NEAR(a->last().lr, 2e-3 * (0.1 + 0.9 * 0.25), 1e-9);  // a quarter of the way up
}

// Resume's model check (changed_model_field): the same resolved model passes; any other model
// field differing is named with both values, except those that may change (context extension)
// and qk_norm_scope without a QK-norm; a config stored before some fields existed (an enum at
// UNSPECIFIED) is checked on the fields it has.
TEST(TrainerTest, ResumeModelCheckNamesTheChangedField) {
  const config::Model base = load_config("", {}).model();
  EXPECT_EQ(changed_model_field(base, base), "");
  auto with = [](std::vector<std::string> sets) { return load_config("", sets).model(); };
  EXPECT_EQ(changed_model_field(with({"model.vocab_size=300"}), base),
            "it was written with model.vocab_size=300 and this config has model.vocab_size=256 (of "
            "the model fields only seq_len, max_positions, rope_theta and init_std may change on "
            "resume)");
  for (const char* set : {"model.norm=RMSNORM", "model.norm_placement=POST_SUBLAYER",
                          "model.mlp=SWIGLU", "model.bias=false", "model.qk_norm=L2",
                          "model.tie_embeddings=false", "model.position=ROPE"}) {
    const std::string field = std::string(set).substr(0, std::string(set).find('='));
    // d_ff explicit: SWIGLU's automatic d_ff differs from GELU's, and d_ff comes first.
    EXPECT_EQ(changed_model_field(with({set, "model.d_ff=512"}), base)
                  .rfind("it was written with " + field + "=", 0),
              0u)
        << set;
  }
  EXPECT_EQ(changed_model_field(with({"model.seq_len=64", "model.rope_theta=5e5",
                                      "model.init_std=0.01", "model.max_positions=512"}),
                                base),
            "");
  EXPECT_EQ(changed_model_field(with({"model.qk_norm=NONE", "model.qk_norm_scope=HEAD"}),
                                with({"model.qk_norm=NONE", "model.qk_norm_scope=PROJECTION"})),
            "");
  EXPECT_NE(changed_model_field(with({"model.qk_norm_scope=HEAD"}), base), "");
  // Stored before position, mlp, bias and norm_placement existed: they read as UNSPECIFIED and
  // false, and are not compared; vocab_size still is.
  config::Model legacy = base;
  legacy.clear_position();
  legacy.clear_mlp();
  legacy.clear_bias();
  legacy.clear_norm_placement();
  EXPECT_EQ(changed_model_field(legacy, base), "");
  legacy.set_vocab_size(300);
  EXPECT_NE(changed_model_field(legacy, base), "");
}

TEST(TrainerTest, DifferentSeedGivesDifferentLosses) {
  TrainerRun a(tiny_config()), b(tiny_config({"train.seed=4321"}));
  int differ = 0;
  for (int s = 1; s <= 5; ++s) differ += a->step().loss != b->step().loss;
  EXPECT_EQ(differ, 5) << "train.seed should change init and data order, so every step's loss";
  EXPECT_FALSE(same_bits(a.params(), b.params()));
}

TEST(TrainerTest, GradientAccumulationMatchesOneLargeBatch) {
  TrainerRun whole(tiny_config({"train.micro_batch=8"}));
  TrainerRun accum(tiny_config({"train.micro_batch=2"}));
  ASSERT_EQ(whole->accum_steps(), 1);
  ASSERT_EQ(accum->accum_steps(), 4);
  ASSERT_EQ(accum->micro_batch(), 2);
  for (int s = 1; s <= 3; ++s) {
    const StepResult rw = whole->step();
    const StepResult ra = accum->step();
    EXPECT_NEAR(ra.loss, rw.loss, 1e-6 * std::abs(rw.loss)) << "step " << s;
    EXPECT_NEAR(ra.z_loss, rw.z_loss, 1e-6 * std::abs(rw.z_loss)) << "step " << s;
    EXPECT_NEAR(ra.grad_norm, rw.grad_norm, 1e-5 * rw.grad_norm) << "step " << s;
    EXPECT_NEAR(ra.max_attn_logit, rw.max_attn_logit, 1e-5 * rw.max_attn_logit) << "step " << s;
    if (s == 1) {
      // Same parameters, same windows, but not the same arithmetic: the projections run as
      // matmuls of 2 or 8 sequences' rows, which BLAS may block and vectorise differently (AVX2
      // or AVX-512), so the logits may differ in their last bits: a few float32 roundings
      // (1.2e-7 each, relative) apart at most.
      EXPECT_NEAR(ra.max_attn_logit, rw.max_attn_logit, 1e-6 * std::abs(rw.max_attn_logit))
          << "same parameters, same windows";
    }
    std::printf("step %d: loss %.17g vs %.17g (rel %.2e), grad_norm rel %.2e\n", s, rw.loss,
                ra.loss, std::abs(ra.loss - rw.loss) / rw.loss,
                std::abs(ra.grad_norm - rw.grad_norm) / rw.grad_norm);
  }
  // The parameters' updates over the 3 steps agree to float32 rounding in norm. Element by
  // element AdamW amplifies rounding where a gradient is within rounding of zero (its update is
  // about lr * sign(m)), so a few elements may differ by up to the learning rate: measured on 2
  // cores, update difference 2.3e-5 in norm, 8 of 34240 elements apart by more than 1e-6 (at
  // most 2.2e-5).
  const std::vector<float> pw = whole.params(), pa = accum.params();
  TrainerRun fresh(tiny_config({"train.micro_batch=8"}));
  const std::vector<float> p0 = fresh.params();
  ASSERT_EQ(pw.size(), pa.size());
  ASSERT_EQ(pw.size(), p0.size());
  double diff2 = 0.0, update2 = 0.0;
  int64_t apart = 0;
  for (size_t i = 0; i < pw.size(); ++i) {
    const double uw = double{pw[i]} - p0[i], ua = double{pa[i]} - p0[i];
    diff2 += (uw - ua) * (uw - ua);
    update2 += uw * uw;
    apart += std::abs(uw - ua) > 1e-6;
  }
  const double rel = std::sqrt(diff2 / update2);
  std::printf(
      "updates after 3 steps: relative difference %.3g in norm, %lld of %zu elements apart "
      "by more than 1e-6\n",
      rel, static_cast<long long>(apart), pw.size());
  EXPECT_LT(rel, 1e-4) << "parameter updates after 3 steps, micro_batch 8 vs 2 x 4";
  EXPECT_LT(apart, static_cast<int64_t>(pw.size() / 1000)) << "elements apart by more than 1e-6";
  EXPECT_GT(update2, 0.0) << "the steps did not move the parameters";
}

TEST(TrainerTest, MicroBatchMustDivideTheBatch) {
  try {
    TrainerRun r(tiny_config({"train.micro_batch=3"}));
    ADD_FAILURE() << "micro_batch 3 of a batch of 8 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("train.micro_batch=3"), std::string::npos) << e.what();
  }
}

// Splits one line {"k": v, ...} of flat numbers into (key, value text) pairs, in order.
std::vector<std::pair<std::string, std::string>> parse_flat_json(const std::string& line) {
  std::vector<std::pair<std::string, std::string>> fields;
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < line.size() && line[i] == ' ') ++i;
  };
  EXPECT_EQ(line.front(), '{') << line;
  EXPECT_EQ(line.back(), '}') << line;
  i = 1;
  while (i < line.size()) {
    skip_ws();
    if (line[i] == '}') break;
    EXPECT_EQ(line[i], '"') << line;
    const size_t key_end = line.find('"', i + 1);
    std::string key = line.substr(i + 1, key_end - i - 1);
    i = key_end + 1;
    skip_ws();
    EXPECT_EQ(line[i], ':') << line;
    ++i;
    skip_ws();
    const size_t value_end = line.find_first_of(",}", i);
    std::string value = line.substr(i, value_end - i);
    while (!value.empty() && value.back() == ' ') value.pop_back();
    fields.emplace_back(std::move(key), std::move(value));
    i = value_end;
    if (line[i] == ',') ++i;
  }
  return fields;
}

// A number in full: strtod must consume all of it.
double parse_number(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  EXPECT_TRUE(!text.empty() && *end == '\0') << "not a number: '" << text << "'";
  return v;
}

TEST(TrainerTest, MetricsJsonlHasOneRoundTripLinePerLogStep) {
  // 6 steps, logged every 2 and evaluated every 3: lines for steps 2, 3 (eval), 4, 6 (eval, last).
  const config::KeelConfig cfg = tiny_config({"train.log_every=2", "train.eval_every=3"});
  TempDir dir("keel_trainer_test");
  const std::string run_dir = dir.file("run");
  {
    TrainerRun logged(cfg, run_dir);
    logged->run();
    EXPECT_EQ(logged->steps_done(), 6);
  }
  // The same run by hand, to know what each line must hold bit for bit.
  TrainerRun manual(cfg);
  std::map<int64_t, StepResult> results;
  std::map<int64_t, double> val;
  for (int s = 1; s <= 6; ++s) {
    results[s] = manual->step();
    if (s % 3 == 0) val[s] = manual->evaluate();
  }

  std::istringstream lines(read_file(run_dir + "/metrics.jsonl"));
  const std::set<std::string> base = {
      "step", "loss",   "z_loss",       "log_z",          "grad_norm",
      "lr",   "tokens", "tokens_per_s", "max_attn_logit", "max_attn_logit_layer",
      "epoch"};
  const double windows = static_cast<double>(Sampler(manual->dataset(), cfg).windows_per_epoch());
  std::vector<int64_t> steps;
  std::string line;
  while (std::getline(lines, line)) {
    SCOPED_TRACE(line);
    const auto fields = parse_flat_json(line);
    std::map<std::string, std::string> f(fields.begin(), fields.end());
    EXPECT_EQ(f.size(), fields.size()) << "a field given twice";
    ASSERT_TRUE(f.count("step"));
    const int64_t step = std::stoll(f["step"]);
    steps.push_back(step);
    std::set<std::string> want = base;
    if (val.count(step)) want.insert("val_loss");
    std::set<std::string> got;
    for (const auto& [k, v] : f) got.insert(k);
    EXPECT_EQ(got, want);
    ASSERT_TRUE(results.count(step));
    const StepResult& r = results[step];
    // Doubles and floats read back to exactly the value the trainer computed.
    EXPECT_EQ(parse_number(f["loss"]), r.loss);
    EXPECT_EQ(parse_number(f["z_loss"]), r.z_loss);
    EXPECT_EQ(parse_number(f["log_z"]), r.log_z);
    EXPECT_EQ(parse_number(f["grad_norm"]), r.grad_norm);
    EXPECT_EQ(static_cast<float>(parse_number(f["lr"])), r.lr);
    EXPECT_EQ(static_cast<float>(parse_number(f["max_attn_logit"])), r.max_attn_logit);
    // The block holding the step's largest logit: the first of the per-layer maxima equal to it.
    ASSERT_EQ(r.max_attn_logit_layers.size(), 2u);
    const int layer = std::stoi(f["max_attn_logit_layer"]);
    EXPECT_EQ(layer, r.max_attn_logit_layer);
    ASSERT_TRUE(layer == 0 || layer == 1) << layer;
    EXPECT_EQ(r.max_attn_logit_layers[layer], r.max_attn_logit);
    EXPECT_LE(r.max_attn_logit_layers[1 - layer], r.max_attn_logit);
    EXPECT_GT(r.max_attn_logit_layers[1 - layer], 0.0f);
    EXPECT_EQ(std::stoll(f["tokens"]), step * manual->tokens_per_step());
    EXPECT_EQ(f["tokens"], std::to_string(step * 8 * 16));
    // Samples read over windows per epoch (8 sequences a step).
    EXPECT_EQ(parse_number(f["epoch"]), static_cast<double>(step * 8) / windows);
    const double tps = parse_number(f["tokens_per_s"]);
    EXPECT_TRUE(std::isfinite(tps) && tps > 0) << f["tokens_per_s"];
    if (val.count(step)) {
      EXPECT_EQ(parse_number(f["val_loss"]), val[step]);
      EXPECT_TRUE(std::isfinite(val[step]) && val[step] > 0);
    }
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 3, 4, 6}));

  // config.pbtxt reproduces the config exactly when merged over the defaults.
  config::KeelConfig back = default_config();
  merge_config_text(read_file(run_dir + "/config.pbtxt"), "config.pbtxt", back);
  EXPECT_EQ(back.SerializeAsString(), cfg.SerializeAsString());
}

TEST(TrainerTest, EvaluateIsDeterministicAndLeavesTrainingStateAlone) {
  const config::KeelConfig cfg = tiny_config();
  TrainerRun with_eval(cfg), without(cfg);
  for (int s = 0; s < 2; ++s) {
    with_eval->step();
    without->step();
  }
  const std::vector<float> before = with_eval.params();
  const double v1 = with_eval->evaluate();
  const double v2 = with_eval->evaluate();
  EXPECT_EQ(v1, v2);
  EXPECT_TRUE(std::isfinite(v1) && v1 > 0);
  EXPECT_EQ(with_eval->last_val_loss(), v1);
  EXPECT_TRUE(same_bits(before, with_eval.params())) << "evaluate() changed the parameters";
  EXPECT_EQ(with_eval->steps_done(), 2);

  const StepResult a = with_eval->step();
  const StepResult b = without->step();
  EXPECT_EQ(a.loss, b.loss) << "evaluate() changed the next step's data or state";
  EXPECT_EQ(a.grad_norm, b.grad_norm);
  EXPECT_EQ(a.z_loss, b.z_loss);
  EXPECT_TRUE(same_bits(with_eval.params(), without.params()));
  EXPECT_EQ(with_eval->evaluate(), without->evaluate());
  EXPECT_NE(with_eval->evaluate(), v1) << "a training step should change the validation loss";
}

TEST(TrainerTest, ZLossAccounting) {
  TrainerRun off(tiny_config({"loss.z_loss=0"}));
  TrainerRun on(tiny_config({"loss.z_loss=1e-4"}));
  const StepResult r_off = off->step();
  const StepResult r_on = on->step();
  EXPECT_EQ(r_off.z_loss, 0.0);
  // Same init and data: the first step's cross-entropy does not include the z-loss term.
  EXPECT_EQ(r_on.loss, r_off.loss);
  // At init the logits are small, so logsumexp ~ ln(vocab) and z_loss ~ 1e-4 ln(256)^2 = 3.1e-3.
  const double expected = 1e-4 * std::log(256.0) * std::log(256.0);
  EXPECT_GT(r_on.z_loss, 0.5 * expected);
  EXPECT_LT(r_on.z_loss, 2.0 * expected);
  // log_z, the mean log-partition, is logged whether or not z-loss is on: the forward is the same,
  // so it is bit for bit equal, near ln(256) = 5.545 at init, and z_loss = 1e-4 mean(lse^2) is at
  // least 1e-4 mean(lse)^2 (Jensen), within 1% since the rows' lse hardly differ at init.
  EXPECT_EQ(r_on.log_z, r_off.log_z);
  EXPECT_NEAR(r_on.log_z, std::log(256.0), 0.1);
  EXPECT_GE(r_on.z_loss, 1e-4 * r_on.log_z * r_on.log_z);
  EXPECT_LT(r_on.z_loss, 1.01e-4 * r_on.log_z * r_on.log_z);
  for (int s = 2; s <= 3; ++s) EXPECT_EQ(off->step().z_loss, 0.0) << "step " << s;
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// The sampled text continues a 16-byte prompt; a context shorter than the prompt must slide
// (a regression test: the context buffer was once sized by seq_len and overrun).
TEST(TrainerTest, SampleWorksWithAContextShorterThanThePrompt) {
  for (const char* seq : {"model.seq_len=4", "model.seq_len=16", "model.seq_len=32"}) {
    TrainerRun run(tiny_config({seq}));
    run->step();
    const std::string a = run->sample(40, 7), b = run->sample(40, 7);
    EXPECT_EQ(a.size(), 16u + 40u) << seq;
    EXPECT_EQ(a, b) << "sampling is deterministic for a seed (" << seq << ")";
    EXPECT_NE(run->sample(40, 8), a) << seq;
  }
}

// A stop signal seen at the end of step 4 (Note [preemption]): run() saves step 4 and returns
// early; the saved checkpoint resumes to the same step-6 parameters as an uninterrupted run. A
// pending async save is committed first, and a step already saved is not saved twice.
TEST(TrainerTest, AStopSignalSavesTheStepAndStops) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    TempDir dir("keel_trainer_stop");
    const auto cfg = tiny_config({"checkpoint.every=2", "checkpoint.keep=10",
                                  std::string("checkpoint.async=") + (async ? "true" : "false")});
    std::vector<float> straight;
    {
      TrainerRun run(cfg);
      run->run();
      straight = run.params();
    }
    const std::string run_dir = dir.file("run");
    int polls = 0;
    {
      TrainerRun run(cfg, run_dir, [&] { return ++polls >= 4 ? SIGUSR1 : 0; });
      run->run();
      EXPECT_EQ(run->steps_done(), 4);
      EXPECT_EQ(run->stopped_by_signal(), SIGUSR1);
      EXPECT_FALSE(run->failed_checkpoint().has_value());
    }
    EXPECT_EQ(polls, 4);  // once per step
    const CheckpointStore store(run_dir + "/checkpoints");
    EXPECT_EQ(store.steps(), (std::vector<int64_t>{4, 2}));
    EXPECT_EQ(store.latest(), std::optional<int64_t>(4));
    TrainerRun resumed(cfg, run_dir);
    ASSERT_EQ(resumed->resumed_from(), std::optional<int64_t>(4));
    resumed->run();
    EXPECT_TRUE(same_bits(resumed.params(), straight));
  }
}

// checkpoint.async: every save is committed by the end of run(), with the same bytes as the
// synchronous save of the same run.
TEST(TrainerTest, AsyncSavesEqualSyncSaves) {
  TempDir dir("keel_trainer_async");
  for (const char* mode : {"false", "true"}) {
    TrainerRun run(tiny_config({"checkpoint.every=2", "checkpoint.keep=10",
                                std::string("checkpoint.async=") + mode}),
                   dir.file(mode));
    run->run();
    EXPECT_FALSE(run->failed_checkpoint().has_value());
  }
  for (int step : {2, 4, 6}) {
    char name[32];
    std::snprintf(name, sizeof(name), "/checkpoints/step_%08d", step);
    SCOPED_TRACE(name);
    const std::string a = dir.file("false") + name, b = dir.file("true") + name;
    EXPECT_EQ(read_file(a + "/shard_00000.bin"), read_file(b + "/shard_00000.bin"));
    // The manifests differ only in the config's checkpoint.async field.
    ckpt::Manifest ma = read_manifest(a), mb = read_manifest(b);
    mb.mutable_config()->mutable_checkpoint()->set_async(false);
    EXPECT_EQ(ma.SerializeAsString(), mb.SerializeAsString());
  }
  EXPECT_EQ(read_file(dir.file("true") + "/checkpoints/LATEST"), "step_00000006\n");
}

// debug.inject_nan_at_step: the step's gradients are NaN; the guard skips the update, so the
// parameters and AdamW's moments and step count are exactly those before the step, all finite;
// the data still advanced.
TEST(TrainerTest, AnInjectedNanIsNeverApplied) {
  TempDir dir("keel_trainer_nan");
  TrainerRun run(tiny_config({"debug.inject_nan_at_step=3", "train.log_every=1"}), dir.file("run"));
  run->step();
  run->step();
  const std::vector<float> before = run.params();
  const std::vector<float> m_before(run->optimizer().m().f32(),
                                    run->optimizer().m().f32() + run->optimizer().m().numel());
  const int64_t t_before = run->optimizer().t();
  const uint64_t sample_before = run->state().sampler.next_sample;
  const StepResult r = run->step();
  EXPECT_TRUE(std::isnan(r.grad_norm));
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(r.guard.anomaly, Anomaly::kNonfiniteGrad);
  EXPECT_TRUE(same_bits(run.params(), before));
  EXPECT_EQ(
      std::memcmp(run->optimizer().m().f32(), m_before.data(), m_before.size() * sizeof(float)), 0);
  EXPECT_EQ(run->optimizer().t(), t_before);
  EXPECT_EQ(run->steps_done(), 3);
  EXPECT_EQ(run->state().sampler.next_sample, sample_before + 8);
  for (float p : run.params()) ASSERT_TRUE(std::isfinite(p));
  run->step();  // step 4 is healthy again and applies
  EXPECT_FALSE(same_bits(run.params(), before));
  EXPECT_EQ(run->optimizer().t(), t_before + 1);
}

// A non-finite value stays valid JSON in metrics.jsonl: null, named in "nonfinite", with the
// guard's verdict beside it; a flagged step is logged off the log_every grid.
TEST(TrainerTest, MetricsWriteNullForNonFiniteValues) {
  TempDir dir("keel_trainer_nan_metrics");
  {
    // log_every 100: step 3 is logged because the guard flagged it (and step 6 as the last).
    TrainerRun run(tiny_config({"debug.inject_nan_at_step=3", "train.log_every=100"}),
                   dir.file("run"));
    run->run();
  }
  std::istringstream lines(read_file(dir.file("run") + "/metrics.jsonl"));
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line.rfind("{\"step\": 3, ", 0), 0u) << line;
  EXPECT_NE(line.find("\"grad_norm\": null,"), std::string::npos) << line;
  EXPECT_NE(line.find("\"nonfinite\": \"grad_norm=nan\", \"anomaly\": \"nonfinite_grad\", "
                      "\"guard\": \"skip\"}"),
            std::string::npos)
      << line;
  EXPECT_EQ(line.find("nan,"), std::string::npos) << line;
  const std::string alerts = read_file(dir.file("run") + "/alerts.jsonl");
  EXPECT_NE(alerts.find("\"step\": 3, \"kind\": \"nonfinite_grad\", \"action\": \"skip\""),
            std::string::npos)
      << alerts;
}

}  // namespace
}  // namespace keel
