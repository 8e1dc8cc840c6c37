// write_file_atomic: temporary file + fsync + rename + directory fsync; append_whole; the
// EINTR-safe system-call helpers (Note [EINTR] in file_io.h).
#include "framework/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "framework/error.h"

namespace keel {

int open_retrying(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

int fsync_retrying(int fd) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

int close_once(int fd) {
  if (::close(fd) == 0 || errno == EINTR) return 0;
  return errno;
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  // Built with += rather than operator+ chains: GCC 12 warns falsely (-Wrestrict) on those.
  std::string tmp = path;
  tmp += ".tmp.";
  tmp += std::to_string(::getpid());
  const int fd = open_retrying(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KEEL_CHECK(fd >= 0, kIo, path, ": cannot write: ", std::strerror(errno));
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    KEEL_FAIL(kIo, path, ": ", what, ": ", std::strerror(err));
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("write failed", w < 0 ? errno : ENOSPC);
    done += static_cast<size_t>(w);
  }
  if (const int err = fsync_retrying(fd)) fail("fsync failed", err);
  if (const int err = close_once(fd)) {
    ::unlink(tmp.c_str());
    KEEL_FAIL(kIo, path, ": write failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    KEEL_FAIL(kIo, path, ": cannot rename the temporary file into place: ", std::strerror(err));
  }
  // Make the rename itself durable.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const int dfd =
      open_retrying(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync_retrying(dfd);
    ::close(dfd);
  }
}

const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a plain file";
}

void append_whole(int fd, const std::string& path, std::string_view bytes, int64_t& size) {
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      int rc;
      do {
        rc = ::ftruncate(fd, size);
      } while (rc != 0 && errno == EINTR);
      if (rc == 0) ::lseek(fd, size, SEEK_SET);
      KEEL_FAIL(kIo, path, ": write failed: ", std::strerror(err));
    }
    done += static_cast<size_t>(w);
  }
  size += static_cast<int64_t>(bytes.size());
}

}  // namespace keel
