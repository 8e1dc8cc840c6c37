// "Every rank reads the same data", checked by content: under mpiexec's MPMD syntax each rank is
// given its own data.path, and a file of the same length but other tokens on one rank must end
// the job with exit 2 and one line naming that rank and both fingerprints (a size comparison alone
// would pass it). The same file on both ranks trains. Runs the real binary.
#include <gtest/gtest.h>

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
using testing::write_file;

const std::vector<std::string> kTiny = {
    "--set", "train.steps=2",      "--set", "model.d_model=32",     "--set", "model.n_layers=1",
    "--set", "model.n_heads=2",    "--set", "model.seq_len=16",     "--set", "train.global_batch=4",
    "--set", "train.eval_every=0", "--set", "train.sample_chars=0", "--set", "train.threads=1"};

std::string text(int n, int salt) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>('a' + (i * 7 + i / 5 + salt) % 26);
  return s;
}

class DataAgreement : public ::testing::Test {
 protected:
  // Two ranks in one job, rank r reading `paths[r]` (mpiexec -n 1 A : -n 1 B).
  CommandResult run_two(const std::vector<std::string>& paths,
                        const std::vector<std::string>& extra = {}) {
    std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
                      shell_quote(KEEL_MPIEXEC) + " --oversubscribe --bind-to none";
    for (size_t r = 0; r < paths.size(); ++r) {
      std::vector<std::string> args = kTiny;
      args.insert(args.end(), extra.begin(), extra.end());
      args.insert(args.end(), {"--set", "data.path=" + paths[r], "--run-dir", dir_.file("run")});
      cmd += (r ? " : -n 1 " : " -n 1 ") + command_line(KEEL_TRAIN_BIN, args);
    }
    return run_command(cmd, dir_);
  }
  TempDir dir_{"keel_data_agreement"};
};

TEST_F(DataAgreement, SameFileOnEveryRankTrains) {
  const std::string a = dir_.file("a.txt");
  write_file(a, text(4000, 0));
  const CommandResult r = run_two({a, a});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("done: 2 steps"), std::string::npos) << r.out << r.err;
}

TEST_F(DataAgreement, SameLengthOtherTokensOnOneRankIsRefused) {
  const std::string a = dir_.file("a.txt"), b = dir_.file("b.txt");
  write_file(a, text(4000, 0));
  std::string other = text(4000, 0);
  other[1234] = other[1234] == 'q' ? 'r' : 'q';  // one token differs, the length does not
  write_file(b, other);
  const CommandResult r = run_two({a, b});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const std::string all = r.out + r.err;
  const std::string head =
      "keel-train: data error: data.path: rank 1 reads different training "
      "tokens from rank 0 (3800 tokens, xxh3:";
  EXPECT_NE(r.err.find(head), std::string::npos) << all;
  EXPECT_NE(r.err.find("every rank must read the same data"), std::string::npos) << all;
  // One message, from rank 0; no training happened.
  size_t lines = 0;
  for (size_t at = all.find("keel-train: "); at != std::string::npos;
       at = all.find("keel-train: ", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 1u) << all;
  EXPECT_EQ(all.find("step "), std::string::npos) << all;
}

TEST_F(DataAgreement, OtherValidationTokensNameTheValidationSplit) {
  const std::string a = dir_.file("a.txt"), b = dir_.file("b.txt");
  std::string other = text(4000, 0);
  write_file(a, other);
  other[3990] = other[3990] == 'q' ? 'r' : 'q';  // in the held-out tail (val_fraction 0.05)
  write_file(b, other);
  const CommandResult r = run_two({a, b});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("data.path: rank 1 reads different validation tokens from rank 0 (200 "
                       "tokens, xxh3:"),
            std::string::npos)
      << r.out << r.err;
}

}  // namespace
}  // namespace keel
