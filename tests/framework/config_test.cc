// Tests for framework/config: defaults, file merge, --set overrides, validation and its one-line
// errors (each must name the file position or the dotted field), and the to_text round trip.
#include "framework/config/config.h"

#include <fcntl.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "framework/error.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using config::KeelConfig;
using testing::error_of;
using testing::TempDir;

void expect_contains(const std::string& message, const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

TEST(Config, DefaultsValidateAndResolve) {
  KeelConfig cfg = default_config();
  EXPECT_EQ(cfg.model().d_ff(), 0);
  EXPECT_EQ(cfg.data().format(), config::AUTO);
  validate(cfg);
  EXPECT_EQ(cfg.model().vocab_size(), 256);
  EXPECT_EQ(cfg.model().d_ff(), 4 * cfg.model().d_model());
  EXPECT_EQ(cfg.model().max_positions(), cfg.model().seq_len());
  EXPECT_EQ(cfg.model().qk_norm(), config::RMS);
  EXPECT_EQ(cfg.model().qk_norm_scope(), config::HEAD_SHARED);
  EXPECT_TRUE(cfg.model().tie_embeddings());
  EXPECT_EQ(cfg.data().format(), config::BUILTIN);
  EXPECT_EQ(cfg.data().builtin_seed(), 7u);
  EXPECT_FLOAT_EQ(cfg.optim().lr(), 3e-3f);
  EXPECT_DOUBLE_EQ(cfg.loss().z_loss(), 1e-4);
  EXPECT_EQ(cfg.checkpoint().keep(), 3);
  EXPECT_TRUE(cfg.spike().enabled());  // the spike guard is on by default
  EXPECT_EQ(cfg.spike().window(), 100);
  EXPECT_EQ(cfg.spike().patience(), 2);
  EXPECT_DOUBLE_EQ(cfg.alert().timeout_s(), 10.0);
  EXPECT_TRUE(cfg.train().deterministic());  // bitwise repeatable steps, which replay needs
  // validate is idempotent.
  KeelConfig again = cfg;
  validate(again);
  EXPECT_EQ(again.SerializeAsString(), cfg.SerializeAsString());
  // load_config with no file and no overrides is the validated defaults.
  EXPECT_EQ(load_config("", {}).SerializeAsString(), cfg.SerializeAsString());
}

// train.deterministic=false lets a GPU's cuDNN backward use atomics, so its steps no longer
// repeat bit for bit: refused with the spike guard's replay on a device that may be a GPU, in one
// line naming both fields and the way out (a config error: exit 2); free on the CPU and without
// replays.
TEST(Config, NonDeterministicStepsAreRefusedWithReplayOnAGpu) {
  for (const std::string device : {"CUDA", "AUTO"}) {
    const std::string msg = error_of(ErrorKind::kConfig, [&] {
      load_config("", {"train.deterministic=false", "train.device=" + device});
    });
    expect_contains(msg,
                    {"train.deterministic=false", "spike.replay=true", "train.device=" + device,
                     "bitwise repeatable", "set train.deterministic=true, or spike.replay=false"});
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(exit_code_for(ErrorKind::kConfig), 2);
  }
  expect_contains(error_of(ErrorKind::kConfig,
                           [] {
                             load_config("", {"train.deterministic=false", "spike.replay=false",
                                              "spike.replay_every=10", "train.device=CUDA"});
                           }),
                  {"spike.replay_every=10"});
  EXPECT_FALSE(
      load_config("", {"train.deterministic=false", "train.device=CPU"}).train().deterministic());
  EXPECT_FALSE(
      load_config("", {"train.deterministic=false", "spike.replay=false", "train.device=CUDA"})
          .train()
          .deterministic());
}

TEST(Config, FileMergesOverDefaults) {
  TempDir dir;
  const std::string file = dir.write("run.pbtxt",
                                     "# a comment\n"
                                     "model { d_model: 64 n_heads: 2 tie_embeddings: false }\n"
                                     "optim { lr: 1e-3 }\n"
                                     "data { path: \"/data/x.bin\" }\n");
  KeelConfig cfg = load_config(file, {});
  EXPECT_EQ(cfg.model().d_model(), 64);
  EXPECT_EQ(cfg.model().n_heads(), 2);
  EXPECT_FALSE(cfg.model().tie_embeddings());  // an explicit false overrides the default true
  EXPECT_EQ(cfg.model().d_ff(), 256);          // resolved from the merged d_model
  EXPECT_EQ(cfg.model().n_layers(), 4);        // untouched defaults survive
  EXPECT_EQ(cfg.model().seq_len(), 128);
  EXPECT_FLOAT_EQ(cfg.optim().lr(), 1e-3f);
  EXPECT_FLOAT_EQ(cfg.optim().beta2(), 0.95f);
  EXPECT_EQ(cfg.data().format(), config::SHARDS);
}

TEST(Config, SetOverridesEveryKindOfField) {
  KeelConfig cfg = load_config(
      "", {"model.n_heads=8", "optim.lr=0.01", "model.qk_norm=L2", "model.qk_norm_scope=PROJECTION",
           "model.tie_embeddings=false", "spike.enabled=false", "data.path=/tmp/some file.txt",
           "train.seed=18446744073709551615", "loss.z_loss=0"});
  EXPECT_EQ(cfg.model().n_heads(), 8);
  EXPECT_FLOAT_EQ(cfg.optim().lr(), 0.01f);
  EXPECT_EQ(cfg.model().qk_norm(), config::L2);
  EXPECT_EQ(cfg.model().qk_norm_scope(), config::PROJECTION);
  EXPECT_FALSE(cfg.model().tie_embeddings());
  EXPECT_FALSE(cfg.spike().enabled());
  EXPECT_EQ(cfg.data().path(), "/tmp/some file.txt");  // strings verbatim, no quotes needed
  EXPECT_EQ(cfg.data().format(), config::TEXT);
  EXPECT_EQ(cfg.train().seed(), 18446744073709551615ull);
  EXPECT_EQ(cfg.loss().z_loss(), 0.0);
}

TEST(Config, SetsApplyInOrderAfterTheFile) {
  TempDir dir;
  const std::string file = dir.write("a.pbtxt", "train { steps: 50 }\n");
  KeelConfig cfg = load_config(file, {"train.steps=60", "train.steps=70"});
  EXPECT_EQ(cfg.train().steps(), 70);
}

TEST(Config, DataFormatAutoResolution) {
  auto format_of = [](const std::string& path) {
    return load_config("", {"data.path=" + path}).data().format();
  };
  EXPECT_EQ(format_of("/d/train_000001.bin"), config::SHARDS);
  EXPECT_EQ(format_of("/d/train_*.dat"), config::SHARDS);
  EXPECT_EQ(format_of("/d/shard_?"), config::SHARDS);
  EXPECT_EQ(format_of("/d/shard_[0-3]"), config::SHARDS);
  EXPECT_EQ(format_of("/d/tiny_shakespeare.txt"), config::TEXT);
  EXPECT_EQ(load_config("", {}).data().format(), config::BUILTIN);
  // An explicit format is kept.
  EXPECT_EQ(load_config("", {"data.path=/d/a.bin", "data.format=TEXT"}).data().format(),
            config::TEXT);
}

TEST(Config, UnknownFieldInFileNamesLineAndColumn) {
  TempDir dir;
  const std::string file = dir.write("bad.pbtxt", "model {\n  seq_len: 64\n  d_modle: 32\n}\n");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(file, {}); });
  expect_contains(msg, {file + ":3:3: ", "d_modle"});
}

TEST(Config, SyntaxErrorNamesLineAndColumn) {
  TempDir dir;
  const std::string file = dir.write("bad.pbtxt", "train {\n  steps: 10\n\n  seed 12 }\n}\n");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(file, {}); });
  expect_contains(msg, {file + ":4:"});
  const std::string msg2 =
      error_of(ErrorKind::kConfig, [&] { load_config(dir.write("b.pbtxt", "model {"), {}); });
  expect_contains(msg2, {":1:"});
}

TEST(Config, BadEnumInFileNamesTheField) {
  TempDir dir;
  const std::string file = dir.write("bad.pbtxt", "model { qk_norm: RSM }\n");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(file, {}); });
  expect_contains(msg, {file + ":1:18: ", "RSM", "qk_norm"});
}

TEST(Config, WrongTypeAndDuplicateFieldInFile) {
  TempDir dir;
  const std::string typed = dir.write("t.pbtxt", "train {\n steps: \"ten\"\n}\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(typed, {}); }), {typed + ":2:"});
  const std::string twice = dir.write("d.pbtxt", "train { steps: 1 steps: 2 }\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(twice, {}); }),
                  {twice + ":1:", "steps"});
}

TEST(Config, MissingFileNamesIt) {
  const std::string msg =
      error_of(ErrorKind::kConfig, [] { load_config("/nonexistent/keel.pbtxt", {}); });
  expect_contains(
      msg, {"/nonexistent/keel.pbtxt", "cannot open config file", "No such file or directory"});
  TempDir dir;
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(dir.path(), {}); }),
                  {dir.path(), "directory"});
}

// A FIFO as the config file: opening it for reading would wait for a writer forever. If the
// loader does block, the test opens the FIFO's write end itself (which releases it) and fails.
TEST(Config, FifoIsRefusedNotWaitedOn) {
  TempDir dir;
  const std::string fifo = dir.file("config.pbtxt");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  auto load = std::async(std::launch::async, [&] {
    return error_of(ErrorKind::kConfig, [&] { load_config(fifo, {}); });
  });
  if (load.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    const int fd = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) close(fd);
    ADD_FAILURE() << "load_config blocked opening a FIFO";
  }
  expect_contains(load.get(), {fifo, "FIFO", "not a regular config file"});
}

TEST(Config, ByteOrderMarkIsSkipped) {
  TempDir dir;
  const std::string bom = "\xEF\xBB\xBF";
  KeelConfig cfg = load_config(dir.write("bom.pbtxt", bom + "model { d_model: 64 }\n"), {});
  EXPECT_EQ(cfg.model().d_model(), 64);
  // Positions on the first line count from after the mark, as an editor shows them.
  const std::string bad = dir.write("bad.pbtxt", bom + "model { d_modle: 64 }\n");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(bad, {}); });
  expect_contains(msg, {bad + ":1:9: ", "d_modle"});
  EXPECT_EQ(msg.find("non ascii"), std::string::npos) << msg;
}

TEST(Config, UnclosedBlockNamesItAndWhereItOpened) {
  TempDir dir;
  const std::string file = dir.write("open.pbtxt", "# run\nmodel {\n  d_model: 32\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(file, {}); }),
                  {file + ":2:7: ", "'model'", "never closed", "missing '}'"});
  const std::string second =
      dir.write("second.pbtxt", "model { d_model: 32 }\ntrain {\n  steps: 5\n  seed: 1\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(second, {}); }),
                  {second + ":2:7: ", "'train'", "never closed"});
  // A block that is closed is not blamed for another error at the end.
  const std::string value = dir.write("value.pbtxt", "model {\n  d_model:");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(value, {}); });
  expect_contains(msg, {value + ":"});
  EXPECT_EQ(msg.find("never closed"), std::string::npos) << msg;
}

TEST(Config, EchoedTokensAreClipped) {
  TempDir dir;
  const std::string name(10 << 20, 'x');  // a 10 MB field name
  const std::string file = dir.write("long.pbtxt", "model {\n  " + name + ": 1\n}\n");
  const std::string msg = error_of(ErrorKind::kConfig, [&] { load_config(file, {}); });
  expect_contains(msg, {file + ":2:3: ", "no field named", std::string(64, 'x') + "..."});
  EXPECT_LT(msg.size(), file.size() + 200) << msg.substr(0, 400);
  const std::string set =
      error_of(ErrorKind::kConfig, [&] { load_config("", {"model." + name + "=1"}); });
  expect_contains(set, {"--set model.xxx", "...: no such field"});
  EXPECT_LT(set.size(), 400u) << set.substr(0, 400);
  const std::string value =
      error_of(ErrorKind::kConfig, [&] { load_config("", {"model.d_model=" + name}); });
  expect_contains(value, {"--set model.d_model=xxx", "...: invalid value for int32 field"});
  EXPECT_LT(value.size(), 400u) << value.substr(0, 400);
  const std::string usage = error_of(ErrorKind::kUsage, [&] { load_config("", {name}); });
  EXPECT_LT(usage.size(), 400u) << usage.substr(0, 400);
}

// Text format reads 010 as octal 8 and 0x20 as 32; keel takes decimal only, in files and --set.
TEST(Config, IntegersAreDecimalOnly) {
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"train.steps=010"}); }),
                  {"--set train.steps=010", "leading zero", "octal", "decimal"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"train.steps=0x20"}); }),
                  {"--set train.steps=0x20", "hexadecimal"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.d_model=-010"}); }),
                  {"model.d_model=-010", "octal"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"train.seed=0X1F"}); }),
                  {"train.seed=0X1F", "hexadecimal"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"optim.lr=010"}); }),
                  {"optim.lr=010", "octal"});
  // Whitespace the parser would skip does not hide a leading zero.
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"train.steps= 010"}); }),
                  {"train.steps", "octal"});
  TempDir dir;
  const std::string octal = dir.write("octal.pbtxt", "train {\n  steps: 010\n}\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(octal, {}); }),
                  {octal + ":2:10: ", "train.steps", "010", "octal"});
  const std::string hex = dir.write("hex.pbtxt", "model { d_model: 0x20 }\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(hex, {}); }),
                  {hex + ":1:18: ", "model.d_model", "0x20", "hexadecimal"});
  const std::string nine = dir.write("nine.pbtxt", "train { seed: 09 }\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(nine, {}); }),
                  {nine + ":1:15: ", "train.seed", "09"});
  // Plain decimal, zero, negative zero and floats that start with 0 are fine.
  KeelConfig cfg = load_config(
      dir.write("ok.pbtxt", "train { steps: 10 seed: 0 }\noptim { lr: 0.001 min_lr_ratio: 0 }\n"),
      {"train.log_every=10", "optim.eps=0.5e-8", "loss.z_loss=0", "train.micro_batch=-0"});
  EXPECT_EQ(cfg.train().steps(), 10);
  EXPECT_EQ(cfg.train().seed(), 0u);
  EXPECT_EQ(cfg.train().log_every(), 10);
  EXPECT_FLOAT_EQ(cfg.optim().lr(), 0.001f);
  EXPECT_FLOAT_EQ(cfg.optim().eps(), 0.5e-8f);
}

// Until the feature behind a field exists, setting it is an error that says what is missing.
TEST(Config, SpikeGuardAndAlertFieldsAreValidated) {
  struct Case {
    std::string set, expected;
  };
  const std::vector<Case> cases = {
      {"spike.window=2", "spike.window=2 must be in [5, 100000] steps"},
      {"spike.patience=0", "spike.patience=0 must be >= 1"},
      {"spike.sigma=0", "spike.sigma=0 and spike.grad_sigma=10 must be > 0"},
      {"spike.min_ratio=-1", "spike.min_ratio=-1 and spike.grad_min_ratio=4 must be >= 0"},
      {"spike.rewind_margin=0", "spike.rewind_margin=0 must be >= 1"},
      {"spike.lr_scale=2", "spike.lr_scale=2 must be in (0, 1]"},
      {"spike.max_rewinds=-1", "spike.max_rewinds=-1 must be >= 0"},
      {"spike.rewind_window=0", "spike.rewind_window=0 must be >= 1 step"},
      {"alert.drain_timeout_s=0",
       "alert.drain_timeout_s=0 must be in (0, 3600] seconds (the end of the run waits at most "
       "this long for alert hooks)"},
      {"spike.max_skipped_steps=1",
       "spike.max_skipped_steps=1 must be >= spike.patience=2 (a streak must be able to reach a "
       "rewind before it halts)"},
      {"alert.timeout_s=0", "alert.timeout_s=0 must be in (0, 3600] seconds"},
      {"debug.inject_every=-1", "debug.inject_every=-1 must be >= 0"},
      {"debug.inject_factor=0", "debug.inject_factor=0 must be > 0"},
  };
  TempDir dir;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.set);
    expect_contains(error_of(ErrorKind::kConfig, [&] { load_config("", {c.set}); }), {c.expected});
    // The same from a file.
    const std::string section = c.set.substr(0, c.set.find('.'));
    const std::string field = c.set.substr(c.set.find('.') + 1);
    const std::string file =
        dir.write(section + ".pbtxt", section + " { " + field.substr(0, field.find('=')) + ": " +
                                          field.substr(field.find('=') + 1) + " }\n");
    expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(file, {}); }), {c.expected});
  }
  EXPECT_NO_THROW(load_config("", {"spike.enabled=false", "debug.inject_spike_at_step=5",
                                   "debug.inject_nan_at_step=7", "alert.command=cat"}));
}

TEST(Config, SampleCharsIsCapped) {
  expect_contains(
      error_of(ErrorKind::kConfig, [] { load_config("", {"train.sample_chars=2147483647"}); }),
      {"train.sample_chars=2147483647 exceeds 1000000"});
  expect_contains(
      error_of(ErrorKind::kConfig, [] { load_config("", {"train.sample_chars=1000001"}); }),
      {"train.sample_chars=1000001"});
  EXPECT_EQ(load_config("", {"train.sample_chars=1000000"}).train().sample_chars(), 1000000);
}

TEST(Config, SetErrors) {
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.foo=1"}); }),
                  {"--set model.foo: no such field (model has: vocab_size, seq_len, d_model"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"modle.seq_len=1"}); }),
                  {"--set modle.seq_len: no such field (the config has: model, parallel"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.n_heads=abc"}); }),
                  {"--set model.n_heads=abc: invalid value for int32 field"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.n_heads=4x"}); }),
                  {"model.n_heads=4x", "int32"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"optim.lr=fast"}); }),
                  {"optim.lr=fast", "float"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"spike.enabled=maybe"}); }),
                  {"spike.enabled=maybe", "bool"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.qk_norm=RSM"}); }),
                  {"model.qk_norm=RSM", "NONE, RMS, LAYER, L2"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model=3"}); }),
                  {"--set model", "section"});
  expect_contains(error_of(ErrorKind::kConfig, [] { load_config("", {"model.seq_len.x=3"}); }),
                  {"model.seq_len", "not a section"});
  expect_contains(error_of(ErrorKind::kUsage, [] { load_config("", {"model.n_heads"}); }),
                  {"--set model.n_heads", "path=value"});
}

// With model.head_dim set, n_heads need not divide d_model: the heads' width is their own.
TEST(Config, HeadDimFreesTheHeadsFromDModel) {
  const config::KeelConfig cfg = load_config("", {"model.n_heads=5", "model.head_dim=8"});
  EXPECT_EQ(cfg.model().n_heads(), 5);
  EXPECT_EQ(cfg.model().head_dim(), 8);
}

TEST(Config, ValidationErrorsNameTheField) {
  struct Case {
    std::vector<std::string> sets;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"model.n_heads=5"}, "model.n_heads=5 does not divide model.d_model=128"},
      {{"model.head_dim=-2"}, "model.head_dim=-2 must be >= 0 (0: d_model / n_heads)"},
      {{"model.n_heads=5", "model.head_dim=7", "model.position=ROPE", "model.rope_theta=10000"},
       "model.position=ROPE needs an even head_dim; model.head_dim=7 is odd"},
      {{"model.seq_len=300", "model.max_positions=256"},
       "model.seq_len=300 exceeds model.max_positions=256 (the position table)"},
      {{"model.vocab_size=0"}, "model.vocab_size"},
      {{"model.d_model=-8"}, "model.d_model"},
      {{"model.n_layers=0"}, "model.n_layers"},
      {{"model.d_ff=-1"}, "model.d_ff"},
      {{"model.init_std=0"}, "model.init_std"},
      {{"parallel.tp=0"}, "parallel.tp"},
      {{"train.steps=0"}, "train.steps=0"},
      {{"train.global_batch=0"}, "train.global_batch=0"},
      {{"train.log_every=0"}, "train.log_every"},
      {{"train.eval_batches=0"}, "train.eval_batches"},
      {{"train.micro_batch=-1"}, "train.micro_batch"},
      {{"optim.lr=0"}, "optim.lr=0"},
      {{"optim.lr=nan"}, "optim.lr=nan is not a finite number"},
      {{"optim.beta1=1"}, "optim.beta1=1"},
      {{"optim.beta2=-0.1"}, "optim.beta2"},
      {{"optim.eps=0"}, "optim.eps"},
      {{"optim.min_lr_ratio=1.5"}, "optim.min_lr_ratio"},
      {{"optim.weight_decay=-1"}, "optim.weight_decay"},
      {{"optim.grad_clip=-1"}, "optim.grad_clip"},
      {{"loss.z_loss=-1e-4"}, "loss.z_loss"},
      {{"data.val_fraction=1"}, "data.val_fraction=1"},
      {{"data.val_fraction=-0.5"}, "data.val_fraction"},
      {{"data.val_fraction=0"}, "train.eval_every=100 needs a validation split"},
      {{"data.builtin_bytes=0"}, "data.builtin_bytes"},
      {{"data.format=BUILTIN", "data.path=/x.txt"}, "data.path='/x.txt'"},
      {{"data.format=SHARDS"}, "data.path is empty but data.format=SHARDS"},
      {{"checkpoint.keep=0"}, "checkpoint.keep"},
      {{"checkpoint.every=-1"}, "checkpoint.every"},
      {{"debug.inject_nan_at_step=-1"}, "debug.inject_nan_at_step"},
      {{"model.position=ROPE", "model.rope_theta=1"},
       "model.rope_theta=1 must be > 1 with model.position=ROPE"},
      {{"model.position=ROPE", "model.d_model=132", "model.n_heads=4"},
       "model.position=ROPE needs an even head_dim"},
      {{"train.recompute_layers=-1"}, "train.recompute_layers=-1 must be in [0, model.n_layers=4]"},
      {{"train.recompute_layers=5"}, "train.recompute_layers=5 must be in [0, model.n_layers=4]"},
      {{"optim.schedule=COSINE", "optim.decay_steps=10"},
       "optim.decay_steps=10 applies to optim.schedule WSD and WSD_SQRT only (this one is COSINE)"},
      {{"optim.schedule=WSD", "optim.decay_steps=-1"}, "optim.decay_steps=-1 must be >= 0"},
      {{"optim.schedule=WSD_SQRT", "optim.decay_steps=361"},
       "optim.warmup_steps=40 + optim.decay_steps=361 exceed train.steps=400"},
      {{"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_comm_dtype=BF16"},
       "parallel.tp_comm_dtype=BF16: the all-gathers and reduce-scatters of "
       "parallel.sequence_parallel move fp32 (use AUTO or FP32)"},
      {{"optim.schedule=STEP"},
       "invalid value for enum field (choose one of COSINE, LINEAR, WSD, WSD_SQRT, CONSTANT)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    expect_contains(error_of(ErrorKind::kConfig, [&] { load_config("", c.sets); }), {c.expected});
  }
  // The boundaries that are allowed.
  EXPECT_NO_THROW(load_config("", {"data.val_fraction=0", "train.eval_every=0"}));
  EXPECT_NO_THROW(load_config("", {"optim.beta1=0", "loss.z_loss=0", "optim.grad_clip=0"}));
  EXPECT_NO_THROW(load_config("", {"model.seq_len=256", "model.max_positions=256"}));
  EXPECT_NO_THROW(load_config("", {"train.recompute_layers=4"}));
  // Sequence parallelism moves fp32; at tp = 1 it changes nothing, so any wire is accepted.
  EXPECT_NO_THROW(load_config("", {"parallel.tp=2", "parallel.sequence_parallel=true"}));
  EXPECT_NO_THROW(
      load_config("", {"parallel.sequence_parallel=true", "parallel.tp_comm_dtype=BF16"}));
  EXPECT_NO_THROW(load_config("", {"optim.schedule=WSD", "optim.decay_steps=360"}));
  // WSD's decay_steps 0 resolves to a fifth of train.steps (at least 1).
  EXPECT_EQ(load_config("", {"optim.schedule=WSD"}).optim().decay_steps(), 80);
  EXPECT_EQ(load_config("", {"optim.schedule=WSD", "train.steps=3", "optim.warmup_steps=0"})
                .optim()
                .decay_steps(),
            1);
  EXPECT_EQ(load_config("", {}).optim().schedule(), config::COSINE);
}

TEST(Config, ModernBlockFieldsDefaultToGpt2AndSizeGatedMlps) {
  const KeelConfig cfg = load_config("", {});
  EXPECT_EQ(cfg.model().position(), config::LEARNED);
  EXPECT_DOUBLE_EQ(cfg.model().rope_theta(), 10000.0);
  EXPECT_EQ(cfg.model().mlp(), config::GELU);
  EXPECT_TRUE(cfg.model().bias());
  EXPECT_EQ(cfg.model().norm_placement(), config::PRE);
  // Gated MLPs: d_ff 0 resolves to 8/3 d_model rounded up to a multiple of 64
  // (128 -> 341.3 -> 384; 768 -> 2048; 4096 -> 10922.7 -> 10944).
  EXPECT_EQ(load_config("", {"model.mlp=SWIGLU"}).model().d_ff(), 384);
  EXPECT_EQ(load_config("", {"model.mlp=GEGLU", "model.d_model=768"}).model().d_ff(), 2048);
  EXPECT_EQ(load_config("", {"model.mlp=SWIGLU", "model.d_model=4096", "model.n_heads=32"})
                .model()
                .d_ff(),
            10944);
  // An explicit d_ff is kept.
  EXPECT_EQ(load_config("", {"model.mlp=SWIGLU", "model.d_ff=320"}).model().d_ff(), 320);
  EXPECT_NO_THROW(load_config("", {"model.position=ROPE", "model.rope_theta=500000"}));
}

TEST(Config, UnspecifiedOrUnknownEnumIsAnError) {
  KeelConfig cfg = default_config();
  cfg.mutable_model()->set_qk_norm(config::QK_NORM_UNSPECIFIED);
  expect_contains(error_of(ErrorKind::kConfig, [&] { validate(cfg); }),
                  {"model.qk_norm is unspecified", "NONE, RMS, LAYER, L2"});
  cfg = default_config();
  cfg.mutable_data()->set_format(config::DATA_FORMAT_UNSPECIFIED);
  expect_contains(error_of(ErrorKind::kConfig, [&] { validate(cfg); }), {"data.format"});
  cfg = default_config();
  cfg.mutable_model()->set_norm(static_cast<config::NormKind>(9));
  expect_contains(error_of(ErrorKind::kConfig, [&] { validate(cfg); }),
                  {"model.norm=9 is not a valid value"});
  // A file that leaves an enum at its zero name is caught the same way.
  TempDir dir;
  const std::string file = dir.write("z.pbtxt", "model { norm: NORM_KIND_UNSPECIFIED }\n");
  expect_contains(error_of(ErrorKind::kConfig, [&] { load_config(file, {}); }),
                  {"model.norm is unspecified"});
}

// The "Config fields" table of docs/config.md names every field a user can set (as
// `section.field`), so a new field cannot land undocumented; and names no field the config does
// not have.
TEST(Config, ReadmeDocumentsEveryField) {
  std::ifstream in(std::string(KEEL_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "cannot read docs/config.md";
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t begin = doc.find("\n## Config fields\n");
  ASSERT_NE(begin, std::string::npos);
  const size_t end = doc.find("\n## ", begin + 1);
  const std::string table = doc.substr(begin, end - begin);
  const KeelConfig cfg = default_config();
  const google::protobuf::Descriptor* top = cfg.GetDescriptor();
  std::vector<std::string> fields;
  for (int i = 0; i < top->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* section = top->field(i);
    ASSERT_NE(section->message_type(), nullptr) << section->name();
    for (int j = 0; j < section->message_type()->field_count(); ++j) {
      fields.push_back(section->name() + "." + section->message_type()->field(j)->name());
    }
  }
  EXPECT_GT(fields.size(), 60u);
  for (const std::string& f : fields) {
    EXPECT_NE(table.find("`" + f + "`"), std::string::npos)
        << f << " is missing from docs/config.md's \"Config fields\" table";
  }
  // Every `a.b` the table's first column names is a field.
  size_t pos = 0;
  int named = 0;
  while ((pos = table.find("\n| `", pos)) != std::string::npos) {
    const size_t cell_end = table.find(" | ", pos + 3);
    const std::string cell = table.substr(pos + 3, cell_end - pos - 3);
    for (size_t q = cell.find('`'); q != std::string::npos; q = cell.find('`', q + 1)) {
      const size_t close = cell.find('`', q + 1);
      const std::string name = cell.substr(q + 1, close - q - 1);
      EXPECT_NE(std::find(fields.begin(), fields.end(), name), fields.end())
          << "docs/config.md documents " << name << ", which is not a config field";
      ++named;
      q = close;
    }
    pos = cell_end;
  }
  EXPECT_EQ(named, static_cast<int>(fields.size()));
}

// Every default the "Config fields" table (docs/config.md) prints is the built-in default
// (kDefaultsText), and kDefaultsText sets every field explicitly (so it is the one place the
// defaults live). A cell naming several fields lists their defaults in the same order; "0 (auto:
// ...)" compares its 0.
TEST(Config, ReadmeDefaultsAreTheDefaults) {
  namespace pb = google::protobuf;
  std::ifstream in(std::string(KEEL_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "cannot read docs/config.md";
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t begin = doc.find("\n## Config fields\n");
  ASSERT_NE(begin, std::string::npos);
  const std::string table = doc.substr(begin, doc.find("\n## ", begin + 1) - begin);
  const KeelConfig cfg = default_config();
  auto trim = [](std::string t) {
    const size_t paren = t.find(" (");
    if (paren != std::string::npos) t.resize(paren);
    while (!t.empty() && t.back() == ' ') t.pop_back();
    while (!t.empty() && t.front() == ' ') t.erase(0, 1);
    return t;
  };
  int checked = 0;
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t c1 = line.find(" | "), c2 = line.find(" | ", c1 + 3);
    ASSERT_NE(c2, std::string::npos) << line;
    const std::string names = line.substr(2, c1 - 2), values = line.substr(c1 + 3, c2 - c1 - 3);
    std::vector<std::string> fields, defaults;
    for (size_t q = names.find('`'); q != std::string::npos; q = names.find('`', q + 1)) {
      const size_t close = names.find('`', q + 1);
      fields.push_back(names.substr(q + 1, close - q - 1));
      q = close;
    }
    // Values split at ", " only outside parentheses ("0 (auto: a, b)" is one value).
    std::string cur;
    int depth = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i] == '(') ++depth;
      if (values[i] == ')') --depth;
      if (depth == 0 && values.compare(i, 2, ", ") == 0) {
        defaults.push_back(trim(cur));
        cur.clear();
        ++i;
        continue;
      }
      cur += values[i];
    }
    defaults.push_back(trim(cur));
    ASSERT_EQ(fields.size(), defaults.size()) << line;
    for (size_t k = 0; k < fields.size(); ++k) {
      const std::string& name = fields[k];
      const size_t dot = name.find('.');
      const pb::FieldDescriptor* sf = cfg.GetDescriptor()->FindFieldByName(name.substr(0, dot));
      ASSERT_NE(sf, nullptr) << name;
      const pb::Message& section = cfg.GetReflection()->GetMessage(cfg, sf);
      const pb::FieldDescriptor* f = section.GetDescriptor()->FindFieldByName(name.substr(dot + 1));
      ASSERT_NE(f, nullptr) << name;
      std::string actual;
      pb::TextFormat::PrintFieldValueToString(section, f, -1, &actual);
      std::string want = defaults[k];
      if (f->type() == pb::FieldDescriptor::TYPE_STRING) {
        if (want.size() < 2 || want.front() != '"') want = "\"" + want + "\"";
      }
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_FLOAT ||
          f->cpp_type() == pb::FieldDescriptor::CPPTYPE_DOUBLE) {
        EXPECT_NEAR(std::stod(actual), std::stod(want), 1e-6 * std::abs(std::stod(want)))
            << name << ": docs/config.md says " << want << ", the default is " << actual;
      } else {
        EXPECT_EQ(actual, want) << name << ": docs/config.md says " << want << ", the default is "
                                << actual;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, [&] {
    int n = 0;
    for (int i = 0; i < cfg.GetDescriptor()->field_count(); ++i) {
      n += cfg.GetDescriptor()->field(i)->message_type()->field_count();
    }
    return n;
  }());
  // The built-in defaults set every field, zeros and falses included: each section's block names
  // each of its fields.
  const std::string text = default_config_text();
  for (int i = 0; i < cfg.GetDescriptor()->field_count(); ++i) {
    const std::string section = cfg.GetDescriptor()->field(i)->name();
    const size_t open = text.find("\n" + section + " {");
    ASSERT_NE(open, std::string::npos) << section;
    const std::string block = text.substr(open, text.find("\n}", open) - open);
    const pb::Descriptor* d = cfg.GetDescriptor()->field(i)->message_type();
    for (int j = 0; j < d->field_count(); ++j) {
      EXPECT_NE(block.find("\n  " + d->field(j)->name() + ":"), std::string::npos)
          << section << "." << d->field(j)->name() << " is not set in the built-in defaults";
    }
  }
}

TEST(Config, ToTextRoundTripsIncludingZerosAndFalses) {
  KeelConfig cfg = load_config(
      "", {"model.tie_embeddings=false", "loss.z_loss=0", "data.path=/d/a \"quoted\".txt",
           "optim.lr=0.1", "train.eval_every=0", "data.val_fraction=0"});
  const std::string text = to_text(cfg);
  EXPECT_NE(text.find("tie_embeddings: false"), std::string::npos) << text;
  EXPECT_NE(text.find("z_loss: 0"), std::string::npos) << text;
  TempDir dir;
  KeelConfig back = load_config(dir.write("config.pbtxt", text), {});
  EXPECT_EQ(back.SerializeAsString(), cfg.SerializeAsString()) << text;
  EXPECT_FLOAT_EQ(back.optim().lr(), 0.1f);
}

}  // namespace
}  // namespace keel
