// keel-ckpt through the real binaries: info describes a checkpoint that keel-train wrote at
// TP2xDP2 with ZeRO-1 (step, layout, tensors and their slices), verify passes on it and names the
// file, tensor and reason (exit 2) after a byte is flipped, and PATH may be the checkpoint, the
// checkpoints directory or the run directory (LATEST decides).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::command_line;
using testing::CommandResult;
using testing::run_command;
using testing::shell_quote;
using testing::TempDir;

class KeelCkpt : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("keel_ckpt_tool");
    const std::vector<std::string> args = {
        "--set", "model.d_model=32",      "--set",     "model.n_layers=1",
        "--set", "model.n_heads=2",       "--set",     "model.seq_len=16",
        "--set", "train.global_batch=4",  "--set",     "data.builtin_bytes=50000",
        "--set", "train.steps=6",         "--set",     "train.eval_every=0",
        "--set", "train.sample_chars=0",  "--set",     "checkpoint.every=3",
        "--set", "train.threads=1",       "--set",     "parallel.tp=2",
        "--set", "parallel.zero_stage=1", "--run-dir", dir_->file("run")};
    const CommandResult r =
        run_command("env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
                        shell_quote(KEEL_MPIEXEC) + " -n 4 --oversubscribe --bind-to none " +
                        command_line(KEEL_TRAIN_BIN, args),
                    *dir_);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  static void TearDownTestSuite() { delete dir_; }
  static CommandResult ckpt(const std::vector<std::string>& args) {
    return run_command(command_line(KEEL_CKPT_BIN, args), *dir_);
  }
  static std::string step(int s) {
    return dir_->file("run") + "/checkpoints/step_0000000" + std::to_string(s);
  }
  static TempDir* dir_;
};
TempDir* KeelCkpt::dir_ = nullptr;

TEST_F(KeelCkpt, InfoDescribesTheCheckpoint) {
  const CommandResult r = ckpt({"info", step(6)});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const std::string& part :
       {std::string("checkpoint ") + step(6) + "\n", std::string("| step 6 | 384 tokens |"),
        std::string("next sample 24 | AdamW t 6"),
        std::string("written by 4 ranks = dp 2 x tp 2 (ZeRO-1)"), std::string("4 shard files"),
        std::string("data: train xxh3:")}) {
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  }
  // The embedding is vocab-parallel: a param slice per TP rank, a moment slice per rank.
  EXPECT_NE(r.out.find("wte                          param   f32   [256, 32]          2 slice(s)"),
            std::string::npos)
      << r.out;
}

TEST_F(KeelCkpt, PathMayBeTheRunOrItsCheckpointsDirectory) {
  for (const std::string& path : {dir_->file("run"), dir_->file("run") + "/checkpoints"}) {
    const CommandResult r = ckpt({"verify", path});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(r.out.rfind(step(6) + ": ok (step 6, ", 0), 0u) << r.out;
  }
}

TEST_F(KeelCkpt, VerifyNamesACorruptSlice) {
  const CommandResult ok = ckpt({"verify", step(3)});
  ASSERT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  const std::string shard = step(3) + "/shard_00002.bin";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('\x7f');
  }
  const CommandResult bad = ckpt({"verify", step(3)});
  EXPECT_EQ(bad.exit_code, 2) << bad.out << bad.err;
  EXPECT_EQ(bad.err.rfind("keel-ckpt: data error: " + shard + ": tensor ", 0), 0u) << bad.err;
  EXPECT_NE(bad.err.find("checksum mismatch"), std::string::npos) << bad.err;
  EXPECT_EQ(bad.err.find('\n'), bad.err.size() - 1) << "one line: " << bad.err;
}

TEST_F(KeelCkpt, BadUsageExits2) {
  EXPECT_EQ(ckpt({}).exit_code, 2);
  EXPECT_EQ(ckpt({"fix", step(6)}).exit_code, 2);
  const CommandResult missing = ckpt({"info", dir_->file("nowhere")});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.err.find("no such directory"), std::string::npos) << missing.err;
  EXPECT_EQ(ckpt({"--help"}).exit_code, 0);
}

}  // namespace
}  // namespace keel
