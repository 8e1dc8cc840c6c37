// Writes that never leave a half-written file: write_file_atomic (framework/file_io.h) and
// JsonlWriter's whole-line writes (framework/metrics.h), provoked with a missing directory,
// /dev/full and a file-size limit (RLIMIT_FSIZE, what a nearly full disk looks like to a writer:
// a short write, then an error). Note [EINTR]: append_whole goes on through writes that a
// signal handler without SA_RESTART interrupts (provoked on a full pipe, where a blocked write
// fails with EINTR; a write to a local file cannot be interrupted, so write_file_atomic's loops
// and the fsync and ftruncate retries are not provoked here).
#include "framework/file_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

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

std::atomic<int> g_interruptions{0};

// The state letter of thread `tid` of this process ('S': asleep in a system call), or 0.
char thread_state(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(") ");
  return close == std::string::npos ? 0 : stat[close + 2];
}

// Waits (up to 30 s: a bound on a hang, not a speed) for `done()`.
template <typename F>
bool wait_until(F done) {
  for (int i = 0; i < 3000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(AppendWhole, GoesOnThroughWritesASignalInterrupts) {
  // A handler installed as StopSignals installs its own: without SA_RESTART.
  struct sigaction act = {}, old = {};
  act.sa_handler = [](int) { g_interruptions.fetch_add(1); };
  sigemptyset(&act.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR2, &act, &old), 0);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  // Fill the pipe, so that the writer's next write blocks with nothing written: a signal then
  // makes it fail with EINTR (not a short write).
  ASSERT_EQ(::fcntl(p[1], F_SETFL, O_NONBLOCK), 0);
  std::string filled;
  const std::string chunk(4096, 'f');
  for (ssize_t w; (w = ::write(p[1], chunk.data(), chunk.size())) > 0;) filled.append(chunk, 0, w);
  ASSERT_EQ(errno, EAGAIN);
  ASSERT_EQ(::fcntl(p[1], F_SETFL, 0), 0);

  std::string payload;
  for (int i = 0; payload.size() < 300000; ++i)
    payload += "{\"step\": " + std::to_string(i) + "}\n";
  int64_t size = 7;
  std::string error;
  std::atomic<pid_t> tid{0};
  std::atomic<bool> done{false};
  std::thread writer([&] {
    tid = static_cast<pid_t>(::syscall(SYS_gettid));
    try {
      append_whole(p[1], "the pipe", payload, size);
    } catch (const Error& e) {
      error = e.what();
    }
    done = true;
  });
  constexpr int kInterruptions = 5;
  for (int i = 0; i < kInterruptions; ++i) {
    if (!wait_until([&] { return tid != 0 && thread_state(tid) == 'S'; })) {
      ADD_FAILURE() << "the writer never blocked";
      break;
    }
    pthread_kill(writer.native_handle(), SIGUSR2);
    if (!wait_until([&] { return g_interruptions.load() == i + 1; })) {
      ADD_FAILURE() << "the handler did not run";
      break;
    }
  }
  // Read everything: this unblocks the writer, whatever happened above.
  std::string got;
  char buf[65536];
  ASSERT_EQ(::fcntl(p[0], F_SETFL, O_NONBLOCK), 0);
  for (;;) {
    const bool writer_done = done.load();  // before the read: then an empty pipe is the end
    const ssize_t r = ::read(p[0], buf, sizeof(buf));
    if (r > 0) {
      got.append(buf, static_cast<size_t>(r));
    } else if (writer_done) {
      break;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  writer.join();
  ::close(p[0]);
  ::close(p[1]);
  sigaction(SIGUSR2, &old, nullptr);
  EXPECT_EQ(error, "");
  EXPECT_EQ(g_interruptions.load(), kInterruptions);
  EXPECT_EQ(size, 7 + static_cast<int64_t>(payload.size()));
  EXPECT_TRUE(got == filled + payload) << "the bytes that came out of the pipe differ";
}

}  // namespace
}  // namespace keel
