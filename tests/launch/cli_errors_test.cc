// keel-train's error contract (DESIGN.md "Contracts"), checked on the real binary: every bad
// command line, config, data source or process layout exits 2 with exactly one line on stderr
// that names the file position or the field / file and the reason, prints no stack trace or
// "terminate called", and leaves no run directory (so no metrics.jsonl) behind when the error is
// caught before training. That covers inputs that used to hang (a FIFO as config or data, 2^31
// layers, batches or evaluation batches, far too many threads) or end in "out of memory" (sizes
// no machine holds: refused by the memory estimate). Also: --help exits 0; under mpiexec -n 2
// such an error ends every rank with 2 and is printed once; valid shards / text train (so the
// bad-input cases fail for the stated reason); and a run whose stdout is closed by `| head`
// trains to the end.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;
using testing::write_file;

// A model and job small enough that a run that should have been refused still ends in seconds.
const std::vector<std::string> kTiny = {
    "--set", "train.steps=2",           "--set", "model.d_model=32",
    "--set", "model.n_layers=1",        "--set", "model.n_heads=2",
    "--set", "model.seq_len=16",        "--set", "train.global_batch=4",
    "--set", "train.eval_batches=1",    "--set", "train.sample_chars=0",
    "--set", "data.builtin_bytes=20000"};

// What a crash, an escaped exception or an MPI abort would print.
const std::vector<std::string> kCrashMarkers = {
    "terminate called", "what():",     "Aborted",   "Segmentation fault", "core dumped",
    "Backtrace",        "stack trace", "MPI_ABORT", "internal error"};

// llm.c shard: int32 header[256] = {magic, version, n_tokens, 0...} little-endian, uint16 tokens.
struct Shard {
  int32_t magic = 20240520;
  int32_t version = 1;
  int64_t header_tokens = -1;  // -1: the true count
  int64_t drop_bytes = 0;      // cut this many bytes off the end
};

std::string shard_bytes(const std::vector<uint16_t>& tokens, Shard spec = {}) {
  auto put32 = [](std::string& s, uint32_t v) {
    for (int b = 0; b < 4; ++b) s += static_cast<char>((v >> (8 * b)) & 0xff);
  };
  std::string bytes;
  std::vector<int64_t> header(256, 0);
  header[0] = spec.magic;
  header[1] = spec.version;
  header[2] = spec.header_tokens < 0 ? static_cast<int64_t>(tokens.size()) : spec.header_tokens;
  for (int64_t h : header) put32(bytes, static_cast<uint32_t>(h));
  for (uint16_t t : tokens) {
    bytes += static_cast<char>(t & 0xff);
    bytes += static_cast<char>(t >> 8);
  }
  bytes.resize(bytes.size() - spec.drop_bytes);
  return bytes;
}

std::vector<uint16_t> valid_tokens(int n) {
  std::vector<uint16_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * 7 + i / 13) % 200);
  return t;
}

class KeelTrainCli : public ::testing::Test {
 protected:
  std::string run_dir() const { return dir_.file("run"); }

  // keel-train with `args`, the tiny job's overrides after them, and --run-dir run_dir().
  CommandResult train(std::vector<std::string> args, bool tiny = true) {
    if (tiny) args.insert(args.end(), kTiny.begin(), kTiny.end());
    args.push_back("--run-dir");
    args.push_back(run_dir());
    return run_command(command_line(KEEL_TRAIN_BIN, args), dir_);
  }

  // keel-train with the tiny job's overrides first and `sets` after them (so they may change a
  // field the tiny job sets), then --run-dir run_dir().
  CommandResult train_overriding(const std::vector<std::string>& sets) {
    std::vector<std::string> args = kTiny;
    args.insert(args.end(), sets.begin(), sets.end());
    return train(args, false);
  }

  std::string write(const std::string& name, const std::string& bytes) {
    const std::string path = dir_.file(name);
    write_file(path, bytes);
    return path;
  }

  // Exit 2, nothing on stdout, exactly one line on stderr "keel-train: <kind> error: ..." holding
  // every one of `parts`, no crash output, and no run directory or metrics.jsonl left behind.
  void expect_refused(const CommandResult& r, const std::string& kind,
                      const std::vector<std::string>& parts) {
    EXPECT_EQ(r.exit_code, 2) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
    EXPECT_EQ(r.out, "") << "the run started or printed before refusing";
    ASSERT_FALSE(r.err.empty()) << "nothing on stderr";
    EXPECT_EQ(r.err.back(), '\n') << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line:\n" << r.err;
    EXPECT_EQ(r.err.rfind("keel-train: " + kind + " error: ", 0), 0u) << r.err;
    for (const std::string& part : parts) {
      EXPECT_NE(r.err.find(part), std::string::npos) << "'" << part << "' not in: " << r.err;
    }
    for (const std::string& marker : kCrashMarkers) {
      EXPECT_EQ((r.out + r.err).find(marker), std::string::npos) << marker << " in:\n"
                                                                 << r.out << r.err;
    }
    EXPECT_FALSE(std::filesystem::exists(run_dir() + "/metrics.jsonl"));
    EXPECT_FALSE(std::filesystem::exists(run_dir()))
        << "a refused run created its run directory " << run_dir();
  }

  TempDir dir_{"keel_cli_errors_test"};
};

TEST_F(KeelTrainCli, HelpExitsZeroAndPrintsUsage) {
  for (const char* flag : {"--help", "-h"}) {
    const CommandResult r = train({flag}, false);
    EXPECT_EQ(r.exit_code, 0) << flag << ": " << r.err;
    EXPECT_EQ(r.out.rfind("usage: keel-train", 0), 0u) << flag << ":\n" << r.out;
    for (const char* part : {"CONFIG.pbtxt", "--set", "--run-dir"}) {
      EXPECT_NE(r.out.find(part), std::string::npos) << part << " not in usage:\n" << r.out;
    }
    EXPECT_EQ(r.err, "") << flag;
    EXPECT_FALSE(std::filesystem::exists(run_dir())) << "--help created the run directory";
  }
}

TEST_F(KeelTrainCli, ConfigUnknownFieldNamesFileLineColumn) {
  const std::string cfg = write("unknown.pbtxt", "model {\n  n_layer: 4\n}\n");
  expect_refused(train({cfg}), "config", {cfg + ":2:3: ", "n_layer"});
}

TEST_F(KeelTrainCli, ConfigBadEnumValueNamesFieldAndValue) {
  const std::string cfg = write("enum.pbtxt", "model {\n  d_model: 32\n  qk_norm: RSM\n}\n");
  const CommandResult r = train({cfg});
  expect_refused(r, "config", {cfg + ":", "RSM", "qk_norm"});
}

// The usual layout of a config file puts each field on its own line; the position must still be
// the bad value's, not the next token's (the parser reports errors after reading one more token).
TEST_F(KeelTrainCli, ConfigBadEnumValuePositionIsTheValues) {
  const std::string cfg = write("enum.pbtxt", "model {\n  d_model: 32\n  qk_norm: RSM\n}\n");
  const CommandResult r = train({cfg});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find(cfg + ":3:12: "), std::string::npos)
      << "expected " << cfg << ":3:12 (where RSM is) in: " << r.err;
}

TEST_F(KeelTrainCli, ConfigSyntaxErrorNamesLineColumn) {
  const std::string cfg = write("syntax.pbtxt", "model {\n  d_model: 64\n  n_heads 4\n}\n");
  expect_refused(train({cfg}), "config", {cfg + ":3:11: ", "Expected \":\""});
}

TEST_F(KeelTrainCli, ConfigBadValueTypeNamesLineColumn) {
  const std::string cfg = write("type.pbtxt", "train {\n  steps: \"many\"\n}\n");
  expect_refused(train({cfg}), "config", {cfg + ":2:10: ", "integer", "many"});
  const std::string cfg2 = write("float.pbtxt", "model { d_model: 1.5 }\n");
  expect_refused(train({cfg2}), "config", {cfg2 + ":1:18: ", "integer", "1.5"});
}

TEST_F(KeelTrainCli, ConfigUnterminatedSection) {
  const std::string cfg = write("open.pbtxt", "model {\n  d_model: 32\n");
  expect_refused(train({cfg}), "config", {cfg + ":1:7: ", "'model'", "never closed"});
}

// Some editors start a UTF-8 file with a byte-order mark: it is skipped, and positions on the
// first line are the ones the editor shows.
TEST_F(KeelTrainCli, ConfigWithByteOrderMark) {
  const std::string bom = "\xEF\xBB\xBF";
  const std::string bad = write("bom_bad.pbtxt", bom + "model { d_modle: 32 }\n");
  expect_refused(train({bad}), "config", {bad + ":1:9: ", "d_modle"});
  const std::string good = write("bom.pbtxt", bom + "model {\n  d_model: 32\n}\n");
  const CommandResult r = train({good});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("d_model 32"), std::string::npos) << r.out;
}

// A 10 MB misspelt field name is echoed cut, not whole.
TEST_F(KeelTrainCli, ConfigHugeUnknownFieldNameGivesShortMessage) {
  const std::string cfg =
      write("huge.pbtxt", "model {\n  " + std::string(10 << 20, 'q') + ": 1\n}\n");
  const CommandResult r = train({cfg});
  expect_refused(r, "config", {cfg + ":2:3: ", "no field named", std::string(64, 'q') + "..."});
  EXPECT_LT(r.err.size(), 400u) << r.err.substr(0, 400);
}

// Text format would read 010 as octal 8 and 0x20 as 32: a config takes decimal only.
TEST_F(KeelTrainCli, IntegersAreDecimalOnly) {
  expect_refused(train({"--set", "train.steps=010"}), "config",
                 {"--set train.steps=010", "octal", "decimal"});
  expect_refused(train({"--set", "train.global_batch=0x20"}), "config",
                 {"--set train.global_batch=0x20", "hexadecimal"});
  const std::string cfg = write("octal.pbtxt", "train {\n  steps: 010\n}\n");
  expect_refused(train({cfg}), "config", {cfg + ":2:10: ", "train.steps", "010", "octal"});
}

// "--set --run-dir out": --set's value is missing; --run-dir is not an override.
TEST_F(KeelTrainCli, SetValueThatIsAnOption) {
  const CommandResult r =
      run_command(command_line(KEEL_TRAIN_BIN, {"--set", "--run-dir", run_dir()}), dir_);
  expect_refused(r, "usage", {"--set needs a value", "--run-dir"});
  EXPECT_FALSE(std::filesystem::exists(dir_.file("runs"))) << "the default run directory was made";
  expect_refused(train({"--set", "train.steps"}), "usage",
                 {"--set train.steps", "expected dotted.path=value"});
}

// Fields whose feature does not exist yet are refused, not silently ignored.
TEST_F(KeelTrainCli, BadSpikeGuardFields) {
  expect_refused(train({"--set", "spike.patience=0"}), "config",
                 {"spike.patience=0", "must be >= 1"});
  expect_refused(train({"--set", "alert.timeout_s=-1"}), "config",
                 {"alert.timeout_s=-1", "must be in (0, 3600] seconds"});
}

TEST_F(KeelTrainCli, ConfigFieldGivenTwice) {
  const std::string cfg = write("twice.pbtxt", "model {\n  d_model: 32\n  d_model: 64\n}\n");
  expect_refused(train({cfg}), "config", {cfg + ":3:", "d_model"});
}

TEST_F(KeelTrainCli, MissingConfigFile) {
  const std::string cfg = dir_.file("absent.pbtxt");
  expect_refused(train({cfg}), "config", {cfg, "cannot open", "No such file or directory"});
}

// Opening a FIFO for reading waits for a writer: a FIFO given as the config, data.path (text or
// a shard glob) or data.val_path must be refused at once, naming it.
TEST_F(KeelTrainCli, FifoAsConfigOrDataIsRefused) {
  const std::string fifo = dir_.file("pipe.txt");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(train({fifo}), "config", {fifo, "FIFO"});
  expect_refused(train({"--set", "data.path=" + fifo}), "data",
                 {fifo, "not a regular file", "FIFO"});
  const std::string shard = dir_.file("pipe_000.bin");
  ASSERT_EQ(mkfifo(shard.c_str(), 0600), 0);
  expect_refused(train({"--set", "data.path=" + dir_.file("pipe_*.bin")}), "data", {shard, "FIFO"});
  std::string text;
  while (text.size() < 3000) text += "the quick brown fox jumps over the lazy dog. ";
  const std::string ok = write("ok.txt", text);
  expect_refused(train({"--set", "data.path=" + ok, "--set", "data.val_path=" + fifo}), "data",
                 {fifo, "FIFO"});
}

// Sizes no machine holds are refused before anything is allocated, naming what the job needs and
// what the machine has (instead of "internal error: out of memory", or hours spent building
// 2^31 layers).
TEST_F(KeelTrainCli, SizesNoMachineHoldsAreRefusedByTheMemoryEstimate) {
  for (const char* set :
       {"model.n_layers=2147483647", "model.vocab_size=2147483647", "model.d_ff=2147483647",
        "model.max_positions=2147483647", "train.global_batch=2147483647"}) {
    SCOPED_TRACE(set);
    expect_refused(train_overriding({"--set", set}), "config",
                   {"this job needs about", "per rank", "this machine has", "of memory",
                    "or recompute activations (train.recompute_layers)"});
  }
  // The estimate is printed at start-up for jobs that fit.
  const CommandResult r = train({});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| memory about "), std::string::npos) << r.out;
}

TEST_F(KeelTrainCli, EvalBatchesBeyondTheValidationSplit) {
  // kTiny: 20000 bytes, 5% held out = 1000 tokens = 62 windows of 16: 16 batches of 4 at most.
  expect_refused(train_overriding({"--set", "train.eval_batches=2147483647"}), "config",
                 {"train.eval_batches=2147483647", "62 distinct windows", "use at most 16"});
  expect_refused(train_overriding({"--set", "train.eval_batches=17"}), "config",
                 {"train.eval_batches=17", "use at most 16"});
  const CommandResult r = train_overriding({"--set", "train.eval_batches=16"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  // Evaluation off: eval_batches is not used, so not checked.
  const CommandResult off =
      train_overriding({"--set", "train.eval_batches=2147483647", "--set", "train.eval_every=0"});
  EXPECT_EQ(off.exit_code, 0) << off.err;
}

TEST_F(KeelTrainCli, ThreadsFarAboveTheCores) {
  for (const char* set : {"train.threads=2147483647", "train.threads=100000"}) {
    SCOPED_TRACE(set);
    expect_refused(train({"--set", set}), "config", {set});
  }
  // docs/config.md's two caps (train.threads): OpenBLAS's compiled limit (64 in Debian's build) and
  // 4 x the machine's hardware threads, each named with its number.
  expect_refused(train({"--set", "train.threads=65"}), "config",
                 {"train.threads=65 exceeds OpenBLAS's limit of 64 threads"});
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (4 * hw + 1 <= 64) {
    const std::string set = "train.threads=" + std::to_string(4 * hw + 1);
    expect_refused(
        train({"--set", set}), "config",
        {set + " is more than 4 x this machine's " + std::to_string(hw) + " hardware threads"});
  }
}

TEST_F(KeelTrainCli, SampleCharsIsCapped) {
  expect_refused(train_overriding({"--set", "train.sample_chars=2147483647"}), "config",
                 {"train.sample_chars=2147483647", "exceeds 1000000"});
}

// debug.kill_rank names a world rank: outside [0, world size) it is refused (here: 1 rank).
TEST_F(KeelTrainCli, KillRankOutsideTheWorld) {
  expect_refused(train({"--set", "debug.kill_rank=1", "--set", "debug.kill_at_step=1"}), "config",
                 {"debug.kill_rank=1", "world size 1"});
  expect_refused(train({"--set", "debug.kill_rank=-1", "--set", "debug.kill_at_step=1"}), "config",
                 {"debug.kill_rank=-1", "world size 1"});
  // With kill_at_step 0 nothing is killed and kill_rank is not used.
  const CommandResult r = train({"--set", "debug.kill_rank=5"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// A training job survives its log pipe closing (keel-train ... | head): the writes to stdout
// fail, training goes on, and metrics.jsonl gets every step.
TEST_F(KeelTrainCli, SurvivesStdoutClosedByHead) {
  std::vector<std::string> args = kTiny;
  args.insert(args.end(), {"--set", "train.steps=12", "--set", "train.log_every=1", "--set",
                           "train.sample_chars=64", "--run-dir", run_dir()});
  // bash: the pipeline's exit status would be head's; PIPESTATUS[0] is keel-train's.
  const std::string pipeline =
      command_line(KEEL_TRAIN_BIN, args) + " | head -c 1 >/dev/null; exit ${PIPESTATUS[0]}";
  const CommandResult r = run_command("bash -c " + shell_quote(pipeline), dir_);
  EXPECT_EQ(r.exit_code, 0) << "141 = killed by SIGPIPE\n" << r.err;
  EXPECT_EQ(r.err, "");
  const std::string metrics = read_file(run_dir() + "/metrics.jsonl");
  int lines = 0;
  for (char c : metrics) lines += c == '\n';
  EXPECT_EQ(lines, 12) << metrics;
  EXPECT_NE(metrics.find("\"step\": 12"), std::string::npos) << metrics;
}

TEST_F(KeelTrainCli, SetUnknownPath) {
  expect_refused(train({"--set", "model.n_layer=3"}), "config",
                 {"--set model.n_layer", "no such field", "n_layers"});
  expect_refused(train({"--set", "modle.d_model=3"}), "config",
                 {"--set modle.d_model", "no such field", "model"});
  expect_refused(train({"--set", "model=3"}), "config", {"--set model", "section"});
  expect_refused(train({"--set", "model.d_model.x=3"}), "config",
                 {"--set model.d_model.x", "not a section"});
}

TEST_F(KeelTrainCli, SetBadValue) {
  // The tiny job's own overrides come after these and set other fields only.
  expect_refused(train({"--set", "model.n_layers=abc"}), "config",
                 {"--set model.n_layers=abc", "invalid value", "int32"});
  expect_refused(train({"--set", "model.n_layers=1.5"}), "config",
                 {"--set model.n_layers=1.5", "invalid value"});
  expect_refused(train({"--set", "model.qk_norm=RSM"}), "config",
                 {"--set model.qk_norm=RSM", "invalid value", "NONE, RMS, LAYER, L2"});
  expect_refused(train({"--set", "model.tie_embeddings=maybe"}), "config",
                 {"--set model.tie_embeddings=maybe", "invalid value"});
  expect_refused(train({"--set", "optim.lr=-1"}), "config", {"optim.lr=-1", "must be > 0"});
}

TEST_F(KeelTrainCli, SetWithoutEquals) {
  expect_refused(train({"--set", "model.d_model"}), "usage",
                 {"--set model.d_model", "expected dotted.path=value"});
}

// Without the --run-dir that train() appends: it would be taken as the missing value.
TEST_F(KeelTrainCli, FlagWithoutValue) {
  for (const char* flag : {"--set", "--run-dir"}) {
    const CommandResult r = run_command(command_line(KEEL_TRAIN_BIN, {flag}), dir_);
    expect_refused(r, "usage", {flag, "needs a value"});
  }
  const CommandResult r = run_command(command_line(KEEL_TRAIN_BIN, {"--run-dir="}), dir_);
  expect_refused(r, "usage", {"--run-dir", "must not be empty"});
  EXPECT_FALSE(std::filesystem::exists(dir_.file("runs"))) << "the default run directory was made";
}

TEST_F(KeelTrainCli, UnknownFlag) {
  expect_refused(train({"--stpes=3"}), "usage", {"--stpes=3", "unknown option"});
}

TEST_F(KeelTrainCli, TwoConfigFiles) {
  const std::string a = write("a.pbtxt", "");
  const std::string b = write("b.pbtxt", "");
  expect_refused(train({a, b}), "usage", {"more than one config file", a, b});
}

TEST_F(KeelTrainCli, HeadsMustDivideDModel) {
  expect_refused(train({"--set", "model.n_heads=5"}, false), "config",
                 {"model.n_heads=5", "model.d_model=128", "does not divide"});
  // From a file too (a tiny job, in case the check were missed).
  const std::string cfg = write("heads.pbtxt",
                                "model {\n  d_model: 32\n  n_heads: 3\n  n_layers: 1\n"
                                "  seq_len: 16\n}\ntrain {\n  steps: 2\n  global_batch: 4\n}\n");
  expect_refused(train({cfg}, false), "config", {"model.n_heads=3", "model.d_model=32"});
}

TEST_F(KeelTrainCli, SeqLenAboveMaxPositions) {
  expect_refused(train({"--set", "model.max_positions=8"}), "config",
                 {"model.seq_len=16", "model.max_positions=8"});
}

TEST_F(KeelTrainCli, MissingDataFile) {
  expect_refused(train({"--set", "data.path=/nonexistent.txt"}), "data",
                 {"/nonexistent.txt", "cannot open", "No such file"});
  const std::string glob = dir_.file("none_*.bin");
  expect_refused(train({"--set", "data.path=" + glob}), "data",
                 {"data.path", "no file matches", glob});
  expect_refused(train({"--set", "data.path=" + dir_.path()}), "data",
                 {dir_.path(), "not a regular file"});
}

TEST_F(KeelTrainCli, TruncatedShard) {
  const std::string short_body =
      write("short_body.bin", shard_bytes(valid_tokens(2000), {.drop_bytes = 100}));
  expect_refused(train({"--set", "data.path=" + short_body}), "data",
                 {short_body, "truncated", "2000 tokens", "1950"});
  const std::string short_header = write("short_header.bin", std::string(600, '\0'));
  expect_refused(train({"--set", "data.path=" + short_header}), "data",
                 {short_header, "truncated", "600 bytes", "header"});
}

TEST_F(KeelTrainCli, ShardHeaderCountDisagreesWithFile) {
  const std::string trailing =
      write("trailing.bin", shard_bytes(valid_tokens(2000), {.header_tokens = 1000}));
  expect_refused(train({"--set", "data.path=" + trailing}), "data",
                 {trailing, "header says 1000 tokens", "trailing bytes"});
  const std::string zero = write("zero.bin", shard_bytes(valid_tokens(2000), {.header_tokens = 0}));
  expect_refused(train({"--set", "data.path=" + zero}), "data", {zero, "header says 0 tokens"});
}

TEST_F(KeelTrainCli, ShardWrongMagic) {
  const std::string path = write("magic.bin", shard_bytes(valid_tokens(2000), {.magic = 20240519}));
  expect_refused(train({"--set", "data.path=" + path}), "data",
                 {path, "magic 20240519", "20240520"});
}

TEST_F(KeelTrainCli, ShardWrongVersion) {
  const std::string path = write("version.bin", shard_bytes(valid_tokens(2000), {.version = 2}));
  expect_refused(train({"--set", "data.path=" + path}), "data", {path, "version 2"});
}

TEST_F(KeelTrainCli, ShardTokenOutOfVocab) {
  std::vector<uint16_t> tokens = valid_tokens(2000);
  tokens[1234] = 256;
  const std::string path = write("oov.bin", shard_bytes(tokens));
  expect_refused(train({"--set", "data.path=" + path}), "data",
                 {path, "token 256", "index 1234", "model.vocab_size=256"});
  // Also in a later shard of a glob, and in data.val_path.
  write("multi_000.bin", shard_bytes(valid_tokens(2000)));
  tokens[1234] = 60000;
  const std::string second = write("multi_001.bin", shard_bytes(tokens));
  expect_refused(train({"--set", "data.path=" + dir_.file("multi_*.bin")}), "data",
                 {second, "token 60000", "index 1234"});
  expect_refused(train({"--set", "data.path=" + dir_.file("multi_000.bin"), "--set",
                        "data.val_path=" + second}),
                 "data", {second, "token 60000"});
}

TEST_F(KeelTrainCli, TextByteOutOfVocab) {
  // validate() does not tie a text file to vocab 256: a smaller vocabulary is accepted and each
  // byte is checked against it when the file is opened.
  std::string text;
  while (text.size() < 3000) text += "the quick brown fox jumps over the lazy dog. ";
  text[2500] = static_cast<char>(200);
  const std::string path = write("high.txt", text);
  expect_refused(train({"--set", "data.path=" + path, "--set", "model.vocab_size=128"}), "data",
                 {path, "byte 200", "index 2500", "model.vocab_size=128"});
}

// Positive controls: the same files without the fault train, so each refusal above is caused by
// the fault it names.
TEST_F(KeelTrainCli, ValidShardsAndTextTrain) {
  write("ok_000.bin", shard_bytes(valid_tokens(2000)));
  write("ok_001.bin", shard_bytes(valid_tokens(1500)));
  CommandResult r = train({"--set", "data.path=" + dir_.file("ok_*.bin")});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("3500"), std::string::npos) << "token count not reported:\n" << r.out;
  const std::string metrics = read_file(run_dir() + "/metrics.jsonl");
  EXPECT_NE(metrics.find("\"step\": 2"), std::string::npos) << metrics;

  std::string text;
  while (text.size() < 3000) text += "the quick brown fox jumps over the lazy dog. ";
  const std::string path = write("ok.txt", text);
  // A finished run ends with a checkpoint (checkpoint.every_minutes), which a run on other data
  // in the same directory refuses to resume: this one starts afresh.
  std::filesystem::remove_all(run_dir());
  r = train({"--set", "data.path=" + path, "--set", "model.vocab_size=128"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
}

// Under mpiexec, an error every rank finds alike (usage, config, data, layout) ends every rank
// with status 2, and only rank 0 prints it: one message, not one per rank.
TEST_F(KeelTrainCli, MpiErrorsEndEveryRankWithOneMessage) {
  struct Case {
    std::vector<std::string> sets;  // after kTiny's
    std::string kind;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      // 2 ranks cannot hold tp=4 (a layout a single process would not even reach).
      {{"--set", "model.n_heads=4", "--set", "parallel.tp=4"}, "layout", {"parallel.tp"}},
      {{"--set", "model.n_heads=5"}, "config", {"model.n_heads=5", "does not divide"}},
      {{"--set", "data.path=/nonexistent.txt"}, "data", {"/nonexistent.txt", "cannot open"}},
  };
  // The variables let Open MPI run as root (containers, CI); ctest's ENVIRONMENT property may not
  // carry them through gtest_discover_tests, so the command sets them itself.
  const std::string mpiexec = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
                              shell_quote(KEEL_MPIEXEC) + " --oversubscribe -n 2 ";
  for (const Case& c : cases) {
    std::vector<std::string> args = kTiny;
    args.insert(args.end(), c.sets.begin(), c.sets.end());
    args.insert(args.end(), {"--run-dir", run_dir()});
    // Each rank's exit status, printed by a shell around it; the shell passes it on to mpiexec.
    const std::string script = command_line(KEEL_TRAIN_BIN, args) +
                               "; rc=$?; echo \"rank ${OMPI_COMM_WORLD_RANK:-$PMI_RANK} exit $rc\";"
                               " exit $rc";
    SCOPED_TRACE(c.sets.back());
    // mpiexec ends the job at the first non-zero exit, which may kill the other rank's shell
    // before it prints; with that turned off, every rank's own status shows.
    const CommandResult each = run_command(
        mpiexec + "--mca orte_abort_on_non_zero_status 0 sh -c " + shell_quote(script), dir_);
    EXPECT_NE(each.out.find("rank 0 exit 2\n"), std::string::npos) << each.out << each.err;
    EXPECT_NE(each.out.find("rank 1 exit 2\n"), std::string::npos) << each.out << each.err;
    // As users launch it: the job's status is 2.
    const CommandResult r = run_command(mpiexec + "sh -c " + shell_quote(script), dir_);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    // mpiexec adds its own banner; of keel-train's lines there is exactly one, on stderr.
    const std::string all = r.out + r.err;
    size_t keel_lines = 0;
    for (size_t at = all.find("keel-train: "); at != std::string::npos;
         at = all.find("keel-train: ", at + 1)) {
      ++keel_lines;
    }
    EXPECT_EQ(keel_lines, 1u) << all;
    const size_t line = r.err.find("keel-train: " + c.kind + " error: ");
    ASSERT_NE(line, std::string::npos) << r.err;
    const std::string message = r.err.substr(line, r.err.find('\n', line) - line);
    for (const std::string& part : c.parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
    for (const char* marker : {"terminate called", "what():", "Segmentation fault", "MPI_ABORT"}) {
      EXPECT_EQ(all.find(marker), std::string::npos) << all;
    }
    EXPECT_FALSE(std::filesystem::exists(run_dir() + "/metrics.jsonl"));
  }
}

// train.device, train.precision and parallel.tp_comm_dtype: a misspelt value, BF16 on the CPU, and
// a GPU run on a machine (or a build) without one are refused before anything is built; so is a
// train.recompute_layers outside [0, model.n_layers].
TEST_F(KeelTrainCli, DeviceAndPrecisionRefusals) {
  expect_refused(train({"--set", "train.device=GPU"}), "config",
                 {"train.device=GPU", "AUTO, CPU or CUDA"});
  expect_refused(train({"--set", "train.precision=FP16"}), "config",
                 {"train.precision=FP16", "AUTO, FP32 or BF16"});
  expect_refused(train({"--set", "train.device=CPU", "--set", "train.precision=BF16"}), "config",
                 {"train.precision=BF16", "FP32 only"});
  expect_refused(train({"--set", "parallel.tp_comm_dtype=FP16"}), "config",
                 {"parallel.tp_comm_dtype=FP16", "AUTO, FP32 or BF16"});
  // Activation recomputation covers at most every block.
  expect_refused(train({"--set", "train.recompute_layers=-1"}), "config",
                 {"train.recompute_layers=-1", "must be in [0, model.n_layers="});
  expect_refused(train({"--set", "train.recompute_layers=99"}), "config",
                 {"train.recompute_layers=99", "must be in [0, model.n_layers="});
  if (std::filesystem::exists("/dev/nvidia0")) {
    GTEST_SKIP() << "this machine has a GPU: train.device=CUDA would run";
  }
  // A build without CUDA says so; a CUDA build says it found no usable GPU.
  const CommandResult r = train({"--set", "train.device=CUDA"});
  expect_refused(r, "config", {"train.device=CUDA: "});
  EXPECT_TRUE(r.err.find("built without CUDA") != std::string::npos ||
              r.err.find("no usable GPU") != std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace keel
