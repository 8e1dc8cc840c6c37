// keel-ckpt through the real binaries: info describes a checkpoint that keel-train wrote at
// TP2xDP2 with ZeRO-1 (step, layout, tensors and their slices), verify passes on it and names the
// file, tensor and reason (exit 2) after a byte is flipped, and PATH may be the checkpoint, the
// checkpoints directory or the run directory (the first on LATEST's lineage that reads). Every
// damaged or forged manifest (a step that contradicts the directory, n = -1, shard_len 0, a huge
// shard_dim, a duplicated slice, a file outside the directory or not listed, a FIFO, /dev/zero, a
// flipped bit) is one line and exit 2 from info, verify and export, never a hang or a crash.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "checkpoints/manifest_io.h"
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
  // A copy of step 6 as `where`/step_NNNNNNNN (step `as`), its manifest edited by `edit` and
  // re-serialized with a valid checksum, so that the edit reaches the check it aims at.
  static std::string forged(const std::string& where, int as,
                            const std::function<void(ckpt::Manifest&)>& edit) {
    const std::string dir = dir_->file(where) + "/" + step_name(as);
    std::filesystem::create_directories(dir_->file(where));
    std::filesystem::copy(step(6), dir, std::filesystem::copy_options::recursive);
    ckpt::Manifest m = read_manifest(dir_->file("run") + "/checkpoints/step_00000006");
    if (edit) edit(m);
    write_file(dir + "/manifest.pb", serialize_manifest(m));
    return dir;
  }
  // info and verify on `dir` both exit 2 with the one line "keel-ckpt: data error: DIR/manifest.pb:
  // ..." containing `reason`.
  static void expect_refused(const std::string& dir, const std::string& reason) {
    for (const char* cmd : {"info", "verify"}) {
      const CommandResult r = ckpt({cmd, dir});
      EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << r.out << r.err;
      const std::string head = "keel-ckpt: data error: " + dir + "/manifest.pb: ";
      EXPECT_EQ(r.err.rfind(head, 0), 0u) << cmd << ": " << r.err;
      EXPECT_NE(r.err.find(reason), std::string::npos) << cmd << ": " << r.err;
      EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << cmd << ": one line: " << r.err;
    }
  }
  static TempDir* dir_;
};
TempDir* KeelCkpt::dir_ = nullptr;

// The first sharded slice's address in `m`.
ckpt::Slice* sharded_slice(ckpt::Manifest& m) {
  for (ckpt::TensorRecord& t : *m.mutable_tensors()) {
    for (ckpt::Slice& s : *t.mutable_slices()) {
      if (s.shard_dim() >= 0) return &s;
    }
  }
  return nullptr;
}

TEST_F(KeelCkpt, InfoDescribesTheCheckpoint) {
  const CommandResult r = ckpt({"info", step(6)});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const std::string& part :
       {std::string("checkpoint ") + step(6) + "\n", std::string("| step 6 | 384 tokens |"),
        std::string("next sample 24 | AdamW t 6"), std::string("\nparent: step 3\n"),
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

TEST_F(KeelCkpt, AForgedManifestIsOneLineAndExit2) {
  expect_refused(forged("step7", 6, [](ckpt::Manifest& m) { m.set_step(7); }),
                 "step 7 does not match the directory name step_00000006");
  expect_refused(
      forged("n", 6, [](ckpt::Manifest& m) { m.mutable_tensors(0)->mutable_slices(0)->set_n(-1); }),
      ": slice 0: elements [");
  expect_refused(forged("dim", 6,
                        [](ckpt::Manifest& m) {
                          m.mutable_tensors(0)->mutable_slices(0)->set_shard_dim(1 << 30);
                        }),
                 "shard_dim 1073741824 is out of range");
  expect_refused(forged("dup", 6,
                        [](ckpt::Manifest& m) {
                          ckpt::TensorRecord* t = m.mutable_tensors(0);
                          *t->add_slices() = t->slices(0);
                        }),
                 " overlaps slice ");
  expect_refused(forged("up", 6,
                        [](ckpt::Manifest& m) {
                          m.mutable_tensors(0)->mutable_slices(0)->set_file("../../x");
                        }),
                 "file is not a plain name within the checkpoint directory");
  expect_refused(forged("unlisted", 6,
                        [](ckpt::Manifest& m) {
                          m.mutable_tensors(0)->mutable_slices(0)->set_file("shard_00099.bin");
                        }),
                 "file shard_00099.bin is not listed in the manifest's files");
}

TEST_F(KeelCkpt, AZeroShardLengthIsRefusedByExportToo) {
  bool found = false;
  const std::string dir = forged("len0", 6, [&](ckpt::Manifest& m) {
    ckpt::Slice* s = sharded_slice(m);
    ASSERT_NE(s, nullptr);
    s->set_shard_len(0);
    found = true;
  });
  ASSERT_TRUE(found);
  expect_refused(dir, "is empty or outside dimension");
  const CommandResult r = ckpt({"export", dir, dir_->file("len0_out")});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;  // once a SIGFPE (136)
  EXPECT_EQ(r.err.rfind("keel-ckpt: data error: " + dir + "/manifest.pb: ", 0), 0u) << r.err;
}

TEST_F(KeelCkpt, AFlippedBitAFifoOrADeviceIsOneLineAndExit2) {
  const std::string flipped = forged("flip", 6, nullptr);
  std::string bytes = read_file(flipped + "/manifest.pb");
  // format_version 2, then step 6: step 6 -> 14 still parses, so only the checksum catches it.
  ASSERT_EQ(bytes.substr(0, 4), std::string("\x08\x02\x10\x06", 4));
  bytes[3] = static_cast<char>(bytes[3] ^ 0x08);
  write_file(flipped + "/manifest.pb", bytes);  // the checksum left as it was
  expect_refused(flipped, "checksum mismatch (the manifest is corrupt or was edited)");

  const std::string fifo = forged("fifo", 6, nullptr);
  std::filesystem::remove(fifo + "/manifest.pb");
  ASSERT_EQ(::mkfifo((fifo + "/manifest.pb").c_str(), 0644), 0);
  expect_refused(fifo, "is a FIFO, not a regular file");  // not the 120 s timeout's 124

  const std::string zero = forged("zero", 6, nullptr);
  std::filesystem::remove(zero + "/manifest.pb");
  std::filesystem::create_symlink("/dev/zero", zero + "/manifest.pb");
  expect_refused(zero, "is a character device, not a regular file");
}

TEST_F(KeelCkpt, TheRunsCurrentCheckpointFollowsLatestsLineage) {
  // lin/checkpoints: 6 (LATEST), 9 committed after it with its LATEST update lost (parent 6),
  // and 12 of a branch abandoned at 3.
  const std::string root = dir_->file("lin") + "/checkpoints";
  forged("lin/checkpoints", 6, nullptr);
  forged("lin/checkpoints", 9, [](ckpt::Manifest& m) {
    m.set_step(9);
    m.set_parent_step(6);
  });
  forged("lin/checkpoints", 12, [](ckpt::Manifest& m) {
    m.set_step(12);
    m.set_parent_step(3);
  });
  write_file(root + "/LATEST", "step_00000006\n");
  CommandResult r = ckpt({"info", dir_->file("lin")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.rfind("note: ignored 1 checkpoint(s) newer than LATEST and not on its lineage "
                        "(steps 12)\ncheckpoint " +
                            root + "/step_00000009\n",
                        0),
            0u)
      << r.out;

  // The head of the lineage unreadable: skipped, said, and the next one taken.
  write_file(root + "/step_00000009/manifest.pb", "garbage");
  std::filesystem::remove_all(root + "/step_00000012");
  write_file(root + "/LATEST", "step_00000009\n");
  r = ckpt({"verify", root});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.rfind("skipped " + root + "/step_00000009: " + root +
                            "/step_00000009/manifest.pb: cannot parse (corrupt, or not a keel "
                            "checkpoint manifest)\n" +
                            root + "/step_00000006: ok (step 6, ",
                        0),
            0u)
      << r.out;

  // LATEST a FIFO: the documented fallback (every checkpoint, newest first), without a hang.
  std::filesystem::remove(root + "/LATEST");
  ASSERT_EQ(::mkfifo((root + "/LATEST").c_str(), 0644), 0);
  r = ckpt({"info", root});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("note: " + root + "/LATEST does not name a committed checkpoint"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("skipped " + root + "/step_00000009: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checkpoint " + root + "/step_00000006\n"), std::string::npos) << r.out;

  // Nothing on the lineage reads: one line, exit 2.
  write_file(root + "/step_00000006/manifest.pb", "garbage");
  r = ckpt({"info", root});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err,
            "keel-ckpt: data error: " + root +
                ": none of the 2 checkpoint(s) on LATEST's lineage reads (the oldest: " + root +
                "/step_00000006/manifest.pb: cannot parse (corrupt, or not a keel "
                "checkpoint manifest))\n");
}

}  // namespace
}  // namespace keel
