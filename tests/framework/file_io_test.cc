// Writes that never leave a half-written file: write_file_atomic (framework/file_io.h) and
// JsonlWriter's whole-line writes (framework/metrics.h), provoked with a missing directory,
// /dev/full and a file-size limit (RLIMIT_FSIZE, what a nearly full disk looks like to a writer:
// a short write, then an error).
#include "framework/file_io.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "framework/metrics.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;
using testing::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

size_t entries(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// Sets a file-size limit for its lifetime, with SIGXFSZ ignored so writes fail with EFBIG.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

TEST(WriteFileAtomic, ReplacesTheFileAndLeavesNothingElse) {
  TempDir dir;
  const std::string path = dir.file("config.pbtxt");
  write_file_atomic(path, "first\n");
  EXPECT_EQ(slurp(path), "first\n");
  write_file_atomic(path, "second, longer\n");
  EXPECT_EQ(slurp(path), "second, longer\n");
  write_file_atomic(path, "");
  EXPECT_EQ(slurp(path), "");
  EXPECT_EQ(entries(dir.path()), 1u);
}

TEST(WriteFileAtomic, AMissingDirectoryNamesThePathAndTheReason) {
  TempDir dir;
  const std::string path = dir.file("no_such_dir/config.pbtxt");
  const std::string m = error_of(ErrorKind::kIo, [&] { write_file_atomic(path, "x"); });
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find("No such file or directory"), std::string::npos) << m;
}

TEST(WriteFileAtomic, AFailedWriteKeepsTheOldContentAndRemovesTheTemporary) {
  TempDir dir;
  const std::string path = dir.file("config.pbtxt");
  write_file_atomic(path, "old\n");
  {
    FileSizeLimit limit(1000);
    const std::string m =
        error_of(ErrorKind::kIo, [&] { write_file_atomic(path, std::string(5000, 'x')); });
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("File too large"), std::string::npos) << m;
  }
  EXPECT_EQ(slurp(path), "old\n");
  EXPECT_EQ(entries(dir.path()), 1u);  // no temporary left behind
  {
    FileSizeLimit limit(1000);
    EXPECT_THROW(write_file_atomic(dir.file("fresh.pbtxt"), std::string(5000, 'x')), Error);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("fresh.pbtxt")));  // never half-written
  EXPECT_EQ(entries(dir.path()), 1u);
}

TEST(JsonlWriter, AFullDiskNamesTheFileAndTheReason) {
  JsonlWriter w("/dev/full");
  JsonObject o;
  o.add("step", int64_t{1});
  const std::string m = error_of(ErrorKind::kIo, [&] { w.write(o); });
  EXPECT_NE(m.find("/dev/full: write failed: No space left on device"), std::string::npos) << m;
}

TEST(JsonlWriter, AShortWriteIsRolledBackToTheLastWholeLine) {
  TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  JsonlWriter w(path);
  JsonObject o;
  o.add("step", int64_t{12345}).add("loss", 1.25);
  const std::string line = o.str() + "\n";
  int written = 0;
  {
    // Room for 3.5 lines: the fourth write is cut short by the limit and must be undone.
    FileSizeLimit limit(static_cast<rlim_t>(line.size() * 7 / 2));
    for (; written < 10; ++written) {
      try {
        w.write(o);
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kIo);
        EXPECT_NE(std::string(e.what()).find(path + ": write failed: File too large"),
                  std::string::npos)
            << e.what();
        break;
      }
    }
  }
  EXPECT_EQ(written, 3);
  std::string expected;
  for (int i = 0; i < 3; ++i) expected += line;
  EXPECT_EQ(slurp(path), expected);
  // With room again, the writer carries on after the last whole line.
  w.write(o);
  EXPECT_EQ(slurp(path), expected + line);
}

}  // namespace
}  // namespace keel
