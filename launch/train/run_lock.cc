// The run-directory lock (Note [run-directory lock]).
#include "launch/train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>

#include "framework/error.h"
#include "launch/train/forensics.h"

namespace keel {

namespace {

// The holder's "host pid seconds" line, at most 4 KiB of it (the file is ours, but a run
// directory is user input: it may have been replaced by anything).
std::string read_holder(int fd) {
  char buf[4096];
  ssize_t n;
  do {
    n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return "";
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return s;
}

std::string describe_holder(const std::string& line) {
  char host[256] = {};
  long long pid = 0, since = 0;
  if (std::sscanf(line.c_str(), "%255s %lld %lld", host, &pid, &since) == 3 && pid > 0) {
    const long long age = static_cast<long long>(std::time(nullptr)) - since;
    return "host " + std::string(host) + ", pid " + std::to_string(pid) + ", for " +
           std::to_string(age < 0 ? 0 : age) + " s";
  }
  return line.empty() ? "an unknown job" : "\"" + line + "\"";
}

}  // namespace

RunDirLock::RunDirLock(const std::string& run_dir) : path_(run_dir + "/.lock") {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  KEEL_CHECK(!ec, kIo, run_dir, ": cannot create run directory: ", ec.message());
  // O_NOFOLLOW | O_NONBLOCK: a symlink or a FIFO planted in place of the lock is refused, not
  // followed or waited on.
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  KEEL_CHECK(fd_ >= 0, kIo, path_,
             ": cannot open the run directory's lock: ", std::strerror(errno));
  struct stat st = {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    KEEL_FAIL(kUsage, path_, ": not a regular file (the run directory's lock)");
  }
  int rc;
  do {
    rc = ::flock(fd_, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      const std::string holder = describe_holder(read_holder(fd_));
      ::close(fd_);
      fd_ = -1;
      KEEL_FAIL(kUsage, run_dir, ": another keel-train job is using this run directory (", holder,
                "): one job per run directory; wait for it to end, stop it, or pass another "
                "--run-dir");
    }
    // No working locks on this file system: nothing can be enforced.
    unsupported_ = std::string("flock: ") + std::strerror(err);
    return;
  }
  const std::string line = host_name() + " " + std::to_string(::getpid()) + " " +
                           std::to_string(static_cast<long long>(std::time(nullptr))) + "\n";
  // Best effort: the lock itself is what protects the directory; the line only names us.
  if (::ftruncate(fd_, 0) == 0) {
    ssize_t w;
    do {
      w = ::pwrite(fd_, line.data(), line.size(), 0);
    } while (w < 0 && errno == EINTR);
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace keel
