// Note [run-directory lock]: one job per run directory. Rank 0 takes an exclusive flock(2) on
// RUN/.lock before it reads or changes anything else in RUN, and holds it for the life of the
// process; the kernel releases it when the process ends however it ends (exit, crash, kill -9),
// so no stale lock is ever left to clean up. The file holds "host pid unix-seconds" of the
// holder, for the refusal message of a second job (a requeued Slurm job overlapping its
// predecessor, or a user starting the same command twice). On a file system whose locks do not
// work (flock fails with ENOLCK, EOPNOTSUPP, ENOSYS or EINVAL: some Lustre and old NFS mounts)
// nothing can be enforced: the lock says so once and the job goes on.
#pragma once

#include <string>

namespace keel {

class RunDirLock {
 public:
  // Creates `run_dir` (and its parents) when missing, opens run_dir/.lock and locks it without
  // waiting. Throws kUsage naming the host and pid of the job holding it, kIo when the directory
  // or the file cannot be made.
  explicit RunDirLock(const std::string& run_dir);
  ~RunDirLock();  // releases the lock (the file stays: removing it would race with a new job)
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  // Empty while the lock is held; otherwise why this file system could not lock (the job runs
  // unprotected).
  const std::string& unsupported() const { return unsupported_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::string unsupported_;
};

}  // namespace keel
