// CheckpointStore (checkpoints/store.h): names, listing, LATEST read defensively, stale saves and
// interrupted LATEST updates removed, and the one rule for "current" (Note [lineage]): lineage()
// and off_lineage() for an interrupted commit, an abandoned branch, an unreadable manifest and an
// unusable LATEST; remove_newer_than() and retention over the lineage only.
#include "checkpoints/store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoints/manifest_io.h"
#include "tests/test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The sorted names in `dir`.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A committed checkpoint of `step` whose manifest names `parent` (no tensors: the store reads
// only the manifest); `parent` nullopt writes a format-1 manifest, which has no parent_step.
void commit(const CheckpointStore& store, int64_t step, std::optional<int64_t> parent) {
  ckpt::Manifest m;
  m.set_format_version(parent ? kCheckpointFormatVersion : 1);
  m.set_step(step);
  if (parent) m.set_parent_step(*parent);
  m.mutable_layout()->set_world(1);
  m.mutable_layout()->set_tp(1);
  m.mutable_layout()->set_dp(1);
  fs::create_directories(store.path_of(step));
  write_file(store.path_of(step) + "/manifest.pb",
             parent ? serialize_manifest(m) : m.SerializeAsString());
}

// Steps first..last, each the child of the one before (the first of `first_parent`).
void chain(const CheckpointStore& store, int64_t first, int64_t last, int64_t first_parent = -1) {
  for (int64_t s = first; s <= last; ++s) commit(store, s, s == first ? first_parent : s - 1);
}

using Steps = std::vector<int64_t>;

// ---- names, LATEST, stale saves ----------------------------------------------------------------

TEST(CheckpointStore, PathOfNamesTheStepWithEightDigits) {
  const CheckpointStore store("/runs/a/checkpoints");
  EXPECT_EQ(store.root(), "/runs/a/checkpoints");
  EXPECT_EQ(store.path_of(42), "/runs/a/checkpoints/step_00000042");
  EXPECT_EQ(store.path_of(0), "/runs/a/checkpoints/step_00000000");
  EXPECT_EQ(store.path_of(12345678), "/runs/a/checkpoints/step_12345678");
}

TEST(CheckpointStore, StepsListsOnlyCommittedCheckpointsNewestFirst) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  EXPECT_TRUE(store.steps().empty());  // no directory yet
  for (const char* d :
       {"step_00000003", "step_00000010", "step_00000001", "step_00000007.tmp", "step_0000000x",
        "step_000000020", "step_0000002", "other", "Step_00000004", "step_123456789"}) {
    fs::create_directories(store.root() + "/" + d);
  }
  write_file(store.root() + "/step_00000005", "a file, not a checkpoint");
  write_file(store.root() + "/LATEST", "step_00000010\n");
  // step_000000020 is not how step 20 is spelt; step 123456789 needs its 9 digits.
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{123456789, 10, 3, 1}));
  EXPECT_EQ(store.path_of(123456789), store.root() + "/step_123456789");
}

TEST(CheckpointStore, LatestNamesOnlyAnExistingCheckpoint) {
  const TempDir td;
  const CheckpointStore store(td.path());
  const std::string latest = td.path() + "/LATEST";
  fs::create_directories(store.path_of(3));
  fs::create_directories(store.path_of(10));
  EXPECT_EQ(store.latest(), std::nullopt);  // no LATEST file

  store.set_latest(10);
  EXPECT_EQ(read_file(latest), "step_00000010\n");
  EXPECT_EQ(store.latest(), std::optional<int64_t>(10));
  store.set_latest(3);
  EXPECT_EQ(read_file(latest), "step_00000003\n");
  EXPECT_EQ(store.latest(), std::optional<int64_t>(3));
  EXPECT_EQ(entries(td.path()), (std::vector<std::string>{"LATEST", "step_00000003",
                                                          "step_00000010"}));  // no temp left

  write_file(latest, "step_00000010");  // no newline
  EXPECT_EQ(store.latest(), std::optional<int64_t>(10));
  write_file(latest, "garbage\n");
  EXPECT_EQ(store.latest(), std::nullopt);
  write_file(latest, "step_0000001x\n");
  EXPECT_EQ(store.latest(), std::nullopt);
  write_file(latest, "");
  EXPECT_EQ(store.latest(), std::nullopt);
  write_file(latest, "step_00000004\n");  // names a step that was never saved
  EXPECT_EQ(store.latest(), std::nullopt);
  store.set_latest(3);
  fs::remove_all(store.path_of(3));  // names a deleted checkpoint
  EXPECT_EQ(store.latest(), std::nullopt);
  fs::create_directories(store.path_of(3));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(3));
}

TEST(CheckpointStore, RemoveStaleRemovesUnfinishedSavesOnly) {
  const TempDir td;
  const CheckpointStore store(td.path());
  fs::create_directories(store.path_of(2) + ".tmp");
  write_file(store.path_of(2) + ".tmp/shard_00000.bin", "half a shard");
  fs::create_directories(store.path_of(4) + ".tmp");
  fs::create_directories(store.path_of(6));
  fs::create_directories(store.path_of(6) + ".old");  // a re-save's moved-aside copy: replaced
  // A crash between a re-save's two renames: step_8 is missing, its moved-aside copy is whole.
  fs::create_directories(store.path_of(8) + ".old");
  write_file(store.path_of(8) + ".old/manifest.pb", "m");
  fs::create_directories(td.path() + "/other.tmp");
  fs::create_directories(td.path() + "/step_42.tmp");
  // Interrupted set_latest calls (write_file_atomic's temporary): removed, not counted.
  write_file(td.path() + "/LATEST.tmp.4242", "step_00000006\n");
  write_file(td.path() + "/LATEST.tmp.17", "step_000");
  EXPECT_EQ(store.remove_stale(), 3);
  EXPECT_EQ(entries(td.path()), (std::vector<std::string>{"other.tmp", "step_00000006",
                                                          "step_00000008", "step_42.tmp"}));
  EXPECT_EQ(read_file(store.path_of(8) + "/manifest.pb"), "m");  // put back, not deleted
  EXPECT_EQ(store.remove_stale(), 0);
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{8, 6}));
  EXPECT_EQ(CheckpointStore(td.path() + "/absent").remove_stale(), 0);
}

// ---- the lineage (Note [lineage]) --------------------------------------------------------------

TEST(CheckpointStore, TheLineageIsLatestThenOlderCheckpoints) {
  const TempDir td;
  const CheckpointStore store(td.path());
  EXPECT_EQ(store.lineage(), Steps{});
  chain(store, 1, 4);
  store.set_latest(4);
  EXPECT_EQ(store.lineage(), (Steps{4, 3, 2, 1}));
  EXPECT_EQ(store.off_lineage(), Steps{});
  store.set_latest(2);  // older ones are on it whatever their parents; 3 is LATEST's child
  EXPECT_EQ(store.lineage(), (Steps{3, 2, 1}));
  EXPECT_EQ(store.off_lineage(), (Steps{4}));
}

TEST(CheckpointStore, ACommitWhoseLatestUpdateWasLostIsOnTheLineage) {
  const TempDir td;
  const CheckpointStore store(td.path());
  chain(store, 10, 10);
  commit(store, 20, 10);
  store.set_latest(20);
  // Two commits after 20 whose LATEST updates a crash cut off: both name 20 as their parent.
  commit(store, 30, 20);
  commit(store, 25, 20);
  EXPECT_EQ(store.latest(), std::optional<int64_t>(20));
  EXPECT_EQ(store.lineage(), (Steps{30, 25, 20, 10}));
  EXPECT_EQ(store.off_lineage(), Steps{});
}

TEST(CheckpointStore, AnAbandonedBranchIsOffTheLineage) {
  // The case: 10, 15, 20 written; --resume-from 10 then committed 13 and LATEST names it.
  const TempDir td;
  const CheckpointStore store(td.path());
  commit(store, 10, -1);
  commit(store, 15, 10);
  commit(store, 20, 15);
  commit(store, 13, 10);
  store.set_latest(13);
  EXPECT_EQ(store.lineage(), (Steps{13, 10}));
  EXPECT_EQ(store.off_lineage(), (Steps{20, 15}));
  // A newer checkpoint whose manifest does not read, or of format 1 (no parent_step), or whose
  // parent is another step, cannot be shown to descend from LATEST.
  fs::create_directories(store.path_of(40));
  write_file(store.path_of(40) + "/manifest.pb", "garbage");
  commit(store, 41, std::nullopt);
  fs::create_directories(store.path_of(42));  // no manifest at all
  EXPECT_EQ(store.lineage(), (Steps{13, 10}));
  EXPECT_EQ(store.off_lineage(), (Steps{42, 41, 40, 20, 15}));
}

TEST(CheckpointStore, WithoutAUsableLatestEveryCheckpointIsOnTheLineageNewestFirst) {
  const TempDir td;
  const CheckpointStore store(td.path());
  commit(store, 10, -1);
  commit(store, 20, 10);
  commit(store, 15, 10);
  const std::string latest = td.path() + "/LATEST";
  const Steps all{20, 15, 10};
  EXPECT_EQ(store.lineage(), all);  // missing
  for (const char* text : {"garbage\n", "step_00000012\n", ""}) {
    write_file(latest, text);  // garbage, a step that does not exist, empty
    EXPECT_EQ(store.lineage(), all) << text;
    EXPECT_EQ(store.off_lineage(), Steps{}) << text;
  }
  fs::remove(latest);
  fs::create_directory(latest);  // a directory
  EXPECT_EQ(store.lineage(), all);
  fs::remove(latest);
  ASSERT_EQ(::mkfifo(latest.c_str(), 0644), 0);  // a FIFO: never opened in a way that blocks
  ::alarm(30);  // a hang ends the test binary instead of the test suite's time
  EXPECT_EQ(store.latest(), std::nullopt);
  EXPECT_EQ(store.lineage(), all);
  EXPECT_EQ(store.off_lineage(), Steps{});
  ::alarm(0);
  fs::remove(latest);
  fs::create_symlink("/dev/zero", latest);  // endless: refused as a character device
  EXPECT_EQ(store.latest(), std::nullopt);
  EXPECT_EQ(store.lineage(), all);
  fs::remove(latest);
  write_file(latest, std::string(1 << 20, 's'));  // too long for a LATEST keel writes
  EXPECT_EQ(store.latest(), std::nullopt);
}

// ---- removal --------------------------------------------------------------------------------

TEST(CheckpointStore, RemoveNewerThanStartsANewLineage) {
  const TempDir td;
  const CheckpointStore store(td.path());
  commit(store, 10, -1);
  commit(store, 15, 10);
  commit(store, 20, 15);
  commit(store, 13, 10);  // an abandoned branch (15, 20) beside the lineage 13 <- 10
  store.set_latest(13);
  EXPECT_EQ(store.remove_newer_than(13), (Steps{20, 15}));
  EXPECT_EQ(store.steps(), (Steps{13, 10}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(13));  // LATEST named a kept one: unchanged
  EXPECT_EQ(store.remove_newer_than(13), Steps{});
  // --resume-from 10: 13 goes, and LATEST (naming it) now names 10.
  EXPECT_EQ(store.remove_newer_than(10), (Steps{13}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(10));
  EXPECT_EQ(store.lineage(), (Steps{10}));
  EXPECT_EQ(entries(td.path()), (std::vector<std::string>{"LATEST", "step_00000010"}));
}

TEST(CheckpointStore, RemoveNewerThanTakesAnInterruptedCommitAndRepointsLatest) {
  const TempDir td;
  const CheckpointStore store(td.path());
  chain(store, 1, 3);
  store.set_latest(3);
  commit(store, 4, 3);  // on the lineage (its LATEST update was lost)
  commit(store, 9, 7);  // off it
  ASSERT_EQ(store.lineage(), (Steps{4, 3, 2, 1}));
  EXPECT_EQ(store.remove_newer_than(2), (Steps{9, 4, 3}));
  EXPECT_EQ(store.steps(), (Steps{2, 1}));
  EXPECT_EQ(read_file(td.path() + "/LATEST"), "step_00000002\n");
  EXPECT_EQ(store.off_lineage(), Steps{});
  // Everything removed: LATEST would name nothing, so it goes too.
  EXPECT_EQ(store.remove_newer_than(0), (Steps{2, 1}));
  EXPECT_EQ(entries(td.path()), std::vector<std::string>{});
  EXPECT_EQ(store.lineage(), Steps{});
  // A missing directory has nothing to remove.
  EXPECT_EQ(CheckpointStore(td.path() + "/absent").remove_newer_than(0), Steps{});
}

TEST(CheckpointStore, RemoveNewerThanNamesTheDirectoryWhenItCannotRemove) {
  const TempDir td;
  const CheckpointStore store(td.path());
  chain(store, 1, 2);
  store.set_latest(2);
  // A read-only store: the rename that starts a removal fails.
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  fs::permissions(td.path(), fs::perms::owner_read | fs::perms::owner_exec);
  const std::string message =
      testing::error_of(ErrorKind::kIo, [&] { store.remove_newer_than(1); });
  fs::permissions(td.path(), fs::perms::owner_all);
  EXPECT_EQ(message.rfind(store.path_of(2) + ": cannot remove", 0), 0u) << message;
  EXPECT_EQ(store.steps(), (Steps{2, 1}));
}

TEST(CheckpointStore, RetainKeepsNewestMultiplesPinnedAndLatest) {
  const TempDir td;
  const CheckpointStore store(td.path());
  chain(store, 1, 10);
  store.set_latest(10);
  // Newest 2: 10, 9; multiples of 3: 9, 6, 3; pinned: 5; LATEST: 10.
  EXPECT_EQ(store.retain(2, 3, [](int64_t s) { return s == 5; }), (Steps{8, 7, 4, 2, 1}));
  EXPECT_EQ(store.steps(), (Steps{10, 9, 6, 5, 3}));
  // keep_every = 0 keeps no multiples, and no pinned function pins nothing.
  EXPECT_EQ(store.retain(1, 0), (Steps{9, 6, 5, 3}));
  EXPECT_EQ(store.steps(), (Steps{10}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(10));
  EXPECT_TRUE(store.retain(1, 0).empty());
  EXPECT_TRUE(fs::exists(td.path() + "/LATEST"));
}

TEST(CheckpointStore, RetainCountsOnlyTheLineage) {
  const TempDir td;
  const CheckpointStore store(td.path());
  chain(store, 1, 4);
  commit(store, 12, 3);  // an abandoned branch: not counted, not removed
  commit(store, 11, 3);
  store.set_latest(4);
  commit(store, 5, 4);  // a commit whose LATEST update was lost: counted, the newest
  EXPECT_EQ(store.retain(2, 0), (Steps{3, 2, 1}));
  EXPECT_EQ(store.steps(), (Steps{12, 11, 5, 4}));
  // LATEST is kept even when the keep count is spent on a newer one.
  EXPECT_EQ(store.retain(1, 0), Steps{});
  EXPECT_EQ(store.steps(), (Steps{12, 11, 5, 4}));
}

}  // namespace
}  // namespace keel
