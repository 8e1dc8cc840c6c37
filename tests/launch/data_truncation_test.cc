// A token shard cut short while keel-train reads it, through the real binary (issue 27, section 5).
// Shards used to be memory-mapped, and the next read of a page past the new end killed the job
// with SIGBUS (exit 135 and a backtrace). They are read through pread now (Note [token files are
// read, not mapped] in framework/data/token_stream.h): the run ends with exit 2 and one line
// naming the file, on one rank and on two data-parallel ranks (where the rank that finds the cut
// may name itself).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "framework/data/token_stream.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::CommandResult;
using testing::read_file;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;
using testing::train_command;
using testing::write_file;

// An llm.c shard of `n` tokens (byte-sized values, for the default vocabulary of 256).
std::string shard_bytes(int32_t n) {
  std::vector<int32_t> header(256, 0);
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = n;
  std::string bytes(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t t = static_cast<uint16_t>((i * 7 + i / 13) % 256);
    bytes.append(reinterpret_cast<const char*>(&t), 2);
  }
  return bytes;
}

// Starts keel-train on `ranks` ranks for more steps than the test waits for, waits until it has
// logged a step (so the data was opened, validated and fingerprinted whole), cuts the shard to its
// header and 10 tokens, and waits for the run to end. stdout: "exit=N"; the run's stderr is in
// `dir`/train.err.
CommandResult train_then_truncate(const TempDir& dir, const std::string& shard, int ranks) {
  const std::string run_dir = dir.file("run");
  const std::vector<std::string> args = {"--set",     "model.d_model=32",
                                         "--set",     "model.n_layers=1",
                                         "--set",     "model.n_heads=2",
                                         "--set",     "model.seq_len=16",
                                         "--set",     "train.global_batch=4",
                                         "--set",     "train.steps=1000000",
                                         "--set",     "train.eval_every=0",
                                         "--set",     "train.sample_chars=0",
                                         "--set",     "train.log_every=1",
                                         "--set",     "train.threads=1",
                                         "--set",     "train.plot=false",
                                         "--set",     "checkpoint.every=0",
                                         "--set",     "data.val_fraction=0",
                                         "--set",     "data.path=" + shard,
                                         "--run-dir", run_dir};
  const std::string metrics = shell_quote(run_dir + "/metrics.jsonl");
  const std::string script = train_command(args, ranks) + " >train.out 2>train.err & pid=$!; " +
                             "for i in $(seq 900); do [ -s " + metrics +
                             " ] && break; sleep 0.1; done; " + "truncate -s " +
                             std::to_string(kShardHeaderBytes + 20) + " " + shell_quote(shard) +
                             "; wait $pid; echo exit=$?";
  return run_command("sh -c " + shell_quote(script), dir);
}

class DataTruncation : public ::testing::TestWithParam<int> {};

TEST_P(DataTruncation, ExitsTwoWithOneLineNamingTheFile) {
  TempDir dir;
  const std::string shard = dir.file("train_000000.bin");
  write_file(shard, shard_bytes(200000));
  const CommandResult r = train_then_truncate(dir, shard, GetParam());
  const std::string err = read_file(dir.file("train.err"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "exit=2\n") << err;
  const std::string reason = "data error: " + shard + ": truncated while in use: ";
  if (GetParam() == 1) {
    // The one line, and nothing else.
    EXPECT_EQ(err.rfind("keel-train: " + reason, 0), 0u) << err;
    EXPECT_EQ(err.find('\n'), err.size() - 1) << err;
  } else {
    // The ranks read their own windows: one may find the cut while the other already waits in
    // the step's all-reduce. Rank 0 speaks for both when they agree; a rank that finds it alone
    // names itself and ends the job (principle 5), and the other's line says it was stopped.
    EXPECT_TRUE(err.find("keel-train: " + reason) != std::string::npos ||
                err.find("keel-train: rank 1: " + reason) != std::string::npos)
        << err;
  }
  EXPECT_EQ(err.find("Bus error"), std::string::npos) << err;
  EXPECT_EQ(err.find("SIGBUS"), std::string::npos) << err;
  EXPECT_FALSE(read_file(dir.file("run/metrics.jsonl")).empty());
}

INSTANTIATE_TEST_SUITE_P(Ranks, DataTruncation, ::testing::Values(1, 2),
                         [](const auto& info) { return "np" + std::to_string(info.param); });

}  // namespace
}  // namespace keel
