// The spike guard's alert sink: alerts.jsonl, the stderr line, and the hook worker
// (Note [alert hooks] in alerts.h).
#include "launch/alerts.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>

#include "framework/error.h"
#include "framework/file_io.h"
#include "framework/metrics.h"

extern char** environ;

namespace keel {

namespace {

// `s` on one line: control characters become spaces.
std::string one_line(std::string s) {
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  return s;
}

// The command as log lines echo it: one line, at most 64 bytes (clip_echo).
std::string echo_command(const std::string& command) { return one_line(clip_echo(command)); }

void log_line(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

using Clock = std::chrono::steady_clock;

// Milliseconds until `deadline` for poll(), at least 0.
int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1000 * 1000));
}

// Writes `data` to the non-blocking pipe `fd` until all of it is written, the reader is gone
// (EPIPE: the hook did not read its stdin, which is allowed) or `deadline` passes.
void write_until(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w > 0) {
      done += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) {
      pollfd p = {fd, POLLOUT, 0};
      const int ms = ms_until(deadline);
      if (ms == 0) return;
      ::poll(&p, 1, ms);  // POLLERR (reader gone) shows up as EPIPE on the next write
      continue;
    }
    return;  // EPIPE or another error: the hook gets what was written
  }
}

// A SIGPIPE raised by a write on this thread while it was blocked stays pending on the thread;
// take it off so it is never delivered later.
void discard_pending_sigpipe() {
  sigset_t pipe_only;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  const timespec zero = {0, 0};
  while (sigtimedwait(&pipe_only, nullptr, &zero) == SIGPIPE) {
  }
}

}  // namespace

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string alert_json(const Alert& a) {
  JsonObject o;
  o.add("time", a.time)
      .add("step", a.step)
      .add("kind", a.kind)
      .add("action", a.action)
      .add("loss", a.loss)
      .add("baseline", a.baseline)
      .add("threshold", a.threshold)
      .add("grad_norm", a.grad_norm)
      .add("max_attn_logit", a.max_attn_logit);
  if (a.max_attn_logit_layer >= 0) {
    o.add("max_attn_logit_layer", static_cast<int64_t>(a.max_attn_logit_layer));
  } else {
    o.add_null("max_attn_logit_layer");
  }
  o.add("checkpoint", a.checkpoint);
  if (a.rewound_to) {
    o.add("rewound_to", *a.rewound_to);
  } else {
    o.add_null("rewound_to");
  }
  o.add("batches_skipped", a.batches_skipped)
      .add("rewinds", static_cast<int64_t>(a.rewinds))
      .add("message", a.message);
  return o.str();
}

std::string alert_human_line(const Alert& a) {
  std::string s = "keel-train: ALERT step " + std::to_string(a.step) + ": ";
  if (!a.message.empty()) {
    s += one_line(a.message);
    s += ' ';
  }
  s += '[';
  s += one_line(a.kind);
  s += " -> ";
  s += one_line(a.action);
  s += ']';
  return s;
}

AlertSink::AlertSink(const std::string& run_dir, const config::Alert& cfg, bool is_rank0,
                     AlertFileMode mode)
    : active_(is_rank0), command_(cfg.command()), timeout_s_(cfg.timeout_s()) {
  if (!active_) return;
  KEEL_CHECK(command_.empty() || (timeout_s_ > 0 && std::isfinite(timeout_s_)), kConfig,
             "alert.timeout_s=", timeout_s_, ": must be > 0 when alert.command is set");
  if (!run_dir.empty()) {
    path_ = run_dir + "/alerts.jsonl";
    const int trunc = mode == AlertFileMode::kTruncate ? O_TRUNC : 0;
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | trunc, 0644);
    KEEL_CHECK(fd_ >= 0, kIo, path_, ": cannot open for writing: ", std::strerror(errno));
    const off_t end = ::lseek(fd_, 0, SEEK_END);
    KEEL_CHECK(end >= 0, kIo, path_, ": cannot seek: ", std::strerror(errno));
    size_ = end;
  }
  if (command_.empty()) return;
  // The worker starts with every signal blocked: process signals (SIGTERM, SIGUSR1) go to the
  // training threads, and a SIGPIPE from a hook that closed its stdin becomes EPIPE.
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  worker_ = std::thread([this] { worker_loop(); });
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
}

AlertSink::~AlertSink() {
  if (worker_.joinable()) {
    size_t not_run = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      not_run = queue_.size();
      queue_.clear();
    }
    wake_.notify_all();
    worker_.join();
    if (not_run > 0) {
      log_line("keel-train: " + std::to_string(not_run) +
               " alert hook(s) not run: the run ended first (" + echo_command(command_) + ")");
    }
    if (dropped_ > 0) {
      log_line("keel-train: " + std::to_string(dropped_) +
               " alert(s) in all were not given to the hook: it fell behind");
    }
  }
  if (fd_ >= 0) ::close(fd_);
}

void AlertSink::emit(const Alert& alert) {
  if (!active_) return;
  log_line(alert_human_line(alert));
  const std::string line = alert_json(alert) + "\n";
  // The file first, so a hook that reads alerts.jsonl finds the line there; a failed write
  // still hands the alert to the hook before it is reported.
  std::exception_ptr file_error;
  if (fd_ >= 0) {
    try {
      append_line(line);
    } catch (const Error&) {
      file_error = std::current_exception();
    }
  }
  if (worker_.joinable()) {
    bool first_drop = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(line);
      if (queue_.size() > kMaxPendingHooks) {
        queue_.pop_front();
        first_drop = dropped_++ == 0;
      }
    }
    wake_.notify_one();
    if (first_drop) {
      log_line("keel-train: alert hook falling behind: more than " +
               std::to_string(kMaxPendingHooks) +
               " alerts waiting, dropping the oldest (said once; counted at the end)");
    }
  }
  if (file_error) std::rethrow_exception(file_error);
}

void AlertSink::drain() {
  if (!worker_.joinable()) return;
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return queue_.empty() && !running_hook_; });
}

void AlertSink::append_line(const std::string& line) { append_whole(fd_, path_, line, size_); }

void AlertSink::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) break;
    std::string line = std::move(queue_.front());
    queue_.pop_front();
    running_hook_ = true;
    lock.unlock();
    run_hook(line);
    lock.lock();
    running_hook_ = false;
    if (queue_.empty()) idle_.notify_all();
  }
  running_hook_ = false;
  idle_.notify_all();
}

void AlertSink::run_hook(const std::string& json_line) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s_));
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    log_line(std::string("keel-train: alert hook not run: cannot make a pipe: ") +
             std::strerror(errno) + ": " + echo_command(command_));
    return;
  }
  const int read_end = fds[0], write_end = fds[1];
  ::fcntl(write_end, F_SETFL, O_NONBLOCK);

  // The child: stdin from the pipe, stdout to keel-train's stderr, every other descriptor
  // closed, its own process group, no blocked signals, SIGPIPE back to its default action.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, read_end, STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none, pipe_only;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  posix_spawnattr_setsigdefault(&attr, &pipe_only);

  std::string command = command_;
  char sh[] = "/bin/sh", dash_c[] = "-c";
  char* argv[] = {sh, dash_c, command.data(), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(read_end);
  if (rc != 0) {
    ::close(write_end);
    log_line(std::string("keel-train: alert hook not run: cannot start /bin/sh: ") +
             std::strerror(rc) + ": " + echo_command(command_));
    return;
  }

  write_until(write_end, json_line, deadline);
  ::close(write_end);
  discard_pending_sigpipe();

  // Wait for it, polling: a short sleep doubling up to 20 ms keeps a quick hook quick.
  int status = 0;
  int nap_ms = 1;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return;  // reaped by someone else: nothing to report
    const int left = ms_until(deadline);
    if (left == 0) {
      ::kill(-pid, SIGKILL);  // the hook's whole process group
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%g", timeout_s_);
      log_line(std::string("keel-train: alert hook timed out after ") + secs +
               " s (killed): " + echo_command(command_));
      return;
    }
    ::poll(nullptr, 0, std::min(nap_ms, left));
    nap_ms = std::min(nap_ms * 2, 20);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    log_line("keel-train: alert hook exited with code " + std::to_string(WEXITSTATUS(status)) +
             ": " + echo_command(command_));
  } else if (WIFSIGNALED(status)) {
    log_line("keel-train: alert hook killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
             strsignal(WTERMSIG(status)) + "): " + echo_command(command_));
  }
}

}  // namespace keel
