// Whole-file writes that never leave a half-written file behind: the bytes go to a temporary file
// beside the target, are fsynced, and are renamed over it (rename is atomic within a file
// system). Used for config.pbtxt now and for checkpoint manifests next.
//
// Note [EINTR]: keel-train's stop-signal handlers are installed without SA_RESTART
// (launch/train/stop_signals.cc), so a system call that blocks when a SIGTERM or SIGUSR1 arrives on
// its thread (a write to a pipe or a slow file system, an open of a FIFO, an fsync on NFS) may
// fail with EINTR. Every write, fsync, ftruncate and open here retries on EINTR; a close that
// fails with EINTR has still released the descriptor on Linux, so it is not retried (a retry
// could close a descriptor another thread has just been given) and counts as closed, its data
// having been fsynced first. The helpers below do the same for other writers.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

namespace keel {

// open(2), retried while it fails with EINTR.
int open_retrying(const char* path, int flags, mode_t mode = 0);
// fsync(2), retried while it fails with EINTR. Returns 0, or the errno of the failure.
int fsync_retrying(int fd);
// close(2), with EINTR counted as closed (Note [EINTR]). Returns 0, or the errno of the failure.
int close_once(int fd);

// Replaces `path` with `bytes` atomically. On failure `path` keeps its old content (or stays
// absent), the temporary file is removed, and kIo names the path and the OS reason.
void write_file_atomic(const std::string& path, std::string_view bytes);

// What a stat(2) mode is, for "not a regular file" messages: "a directory", "a FIFO", ...
const char* file_type_name(mode_t mode);

// Appends `bytes` (whole lines) to the file open as `fd`, whose complete content is `size` bytes;
// advances `size`. A short write (a full disk) cuts the partial bytes off again, so readers only
// ever see whole lines, and throws kIo naming `path` and the OS reason.
void append_whole(int fd, const std::string& path, std::string_view bytes, int64_t& size);

}  // namespace keel
