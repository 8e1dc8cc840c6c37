// The spike guard's alert sink: alerts.jsonl, the stderr line, and the hook worker
// (Note [alert hooks] in alerts.h).
#include "launch/train/alerts.h"

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

// `s` seconds from now; clamped, so that no configured value overflows the clock.
Clock::time_point after_seconds(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::clamp(s, 0.0, 1e7)));
}

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", s);
  return text;
}

// Writes all of `data` to `fd`, retrying on EINTR; gives up on any other error.
void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// Writes what the non-blocking pipe `fd` takes now of `data` from `done` on. Returns false once
// there is nothing more to write: all of it is written, or the reader is gone (EPIPE: the hook
// did not read its stdin, which is allowed) or another error.
bool write_some(int fd, const std::string& data, size_t& done) {
  while (done < data.size()) {
    const ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w > 0) {
      done += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    return w < 0 && errno == EAGAIN;  // full: more when poll says so
  }
  return false;
}

// A hook's stdout and stderr on their way to keel-train's stderr: the first `cap` bytes are
// copied, the rest only counted.
class OutputCopy {
 public:
  explicit OutputCopy(size_t cap) : cap_(cap) {}
  // Copies what the non-blocking pipe `fd` holds now. Returns false at its end (or on an error).
  bool read_from(int fd) {
    for (;;) {
      const ssize_t r = ::read(fd, buf_, sizeof(buf_));
      if (r > 0) {
        take(static_cast<size_t>(r));
        return true;
      }
      if (r < 0 && errno == EINTR) continue;
      return r < 0 && errno == EAGAIN;
    }
  }
  // What is left in `fd` once the hook is gone: bounded, since a background child it left may
  // still be writing.
  void read_rest(int fd) {
    for (int i = 0; i < 64; ++i) {
      const ssize_t r = ::read(fd, buf_, sizeof(buf_));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return;
      take(static_cast<size_t>(r));
    }
  }
  // One line when something was cut.
  void finish(const std::string& command) const {
    if (dropped_ == 0) return;
    if (!ends_in_newline_) write_all(STDERR_FILENO, "\n", 1);
    log_line("keel-train: alert hook output cut at " + std::to_string(cap_) + " bytes (" +
             std::to_string(dropped_) + " more bytes not shown): " + echo_command(command));
  }

 private:
  void take(size_t n) {
    const size_t shown = std::min(n, cap_ - copied_);
    if (shown > 0) {
      write_all(STDERR_FILENO, buf_, shown);
      copied_ += shown;
      ends_in_newline_ = buf_[shown - 1] == '\n';
    }
    dropped_ += static_cast<int64_t>(n - shown);
  }

  const size_t cap_;
  size_t copied_ = 0;
  int64_t dropped_ = 0;
  bool ends_in_newline_ = true;
  char buf_[16384];
};

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
    : active_(is_rank0),
      command_(cfg.command()),
      timeout_s_(cfg.timeout_s()),
      drain_timeout_s_(cfg.drain_timeout_s()) {
  if (!active_) return;
  KEEL_CHECK(command_.empty() || (timeout_s_ > 0 && std::isfinite(timeout_s_)), kConfig,
             "alert.timeout_s=", timeout_s_, ": must be > 0 when alert.command is set");
  KEEL_CHECK(command_.empty() || (drain_timeout_s_ > 0 && std::isfinite(drain_timeout_s_)), kConfig,
             "alert.drain_timeout_s=", drain_timeout_s_, ": must be > 0 when alert.command is set");
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
    const auto deadline = after_seconds(drain_timeout_s_);
    size_t not_run = 0;
    bool killed = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      stop_ = true;
      not_run = queue_.size();
      queue_.clear();
      wake_.notify_all();
      if (!idle_.wait_until(lock, deadline, [this] { return !running_hook_; })) {
        killed = give_up_running_hook(lock);
      }
    }
    worker_.join();
    if (killed) {
      log_line(
          "keel-train: alert hook killed: alert.drain_timeout_s=" + seconds_text(drain_timeout_s_) +
          " s passed at the end of the run: " + echo_command(command_));
    }
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
  const auto deadline = after_seconds(drain_timeout_s_);
  std::unique_lock<std::mutex> lock(mu_);
  if (idle_.wait_until(lock, deadline, [this] { return queue_.empty() && !running_hook_; })) {
    return;
  }
  const size_t not_run = queue_.size();
  queue_.clear();
  const bool killed = give_up_running_hook(lock);
  lock.unlock();
  log_line("keel-train: alert hooks cut short at the end of the run (alert.drain_timeout_s=" +
           seconds_text(drain_timeout_s_) + " s): " + (killed ? "1 killed, " : "") +
           std::to_string(not_run) + " not run: " + echo_command(command_));
}

bool AlertSink::give_up_running_hook(std::unique_lock<std::mutex>& lock) {
  give_up_ = true;
  idle_.wait(lock, [this] { return !running_hook_; });
  give_up_ = false;
  const bool killed = killed_at_deadline_;
  killed_at_deadline_ = false;
  return killed;
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
    const HookEnd end = run_hook(line);
    lock.lock();
    running_hook_ = false;
    killed_at_deadline_ = end == HookEnd::kGivenUp;
    idle_.notify_all();
  }
  running_hook_ = false;
  idle_.notify_all();
}

AlertSink::HookEnd AlertSink::run_hook(const std::string& json_line) {
  const auto deadline = after_seconds(timeout_s_);
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) {
    log_line(std::string("keel-train: alert hook not run: cannot make a pipe: ") +
             std::strerror(errno) + ": " + echo_command(command_));
    return HookEnd::kFinished;
  }
  if (::pipe2(out, O_CLOEXEC) != 0) {
    log_line(std::string("keel-train: alert hook not run: cannot make a pipe: ") +
             std::strerror(errno) + ": " + echo_command(command_));
    ::close(in[0]);
    ::close(in[1]);
    return HookEnd::kFinished;
  }
  int in_fd = in[1], out_fd = out[0];  // ours; -1 once closed
  ::fcntl(in_fd, F_SETFL, O_NONBLOCK);
  ::fcntl(out_fd, F_SETFL, O_NONBLOCK);

  // The child: stdin from one pipe, stdout and stderr into the other, every other descriptor
  // closed, its own process group, no blocked signals, SIGPIPE back to its default action.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
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
  ::close(in[0]);
  ::close(out[1]);
  if (rc != 0) {
    ::close(in_fd);
    ::close(out_fd);
    log_line(std::string("keel-train: alert hook not run: cannot start /bin/sh: ") +
             std::strerror(rc) + ": " + echo_command(command_));
    return HookEnd::kFinished;
  }

  // Feed its stdin and copy its output until it exits, its timeout passes or the sink gives up
  // on it. Waiting polls the pipes with a timeout doubling from 1 ms up to 20 ms, so a quick
  // hook stays quick.
  OutputCopy output(kMaxHookOutputBytes);
  size_t written = 0;
  int status = 0;
  bool reaped = false, timed_out = false, given_up = false;
  int nap_ms = 1;
  for (;;) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      reaped = true;
      break;
    }
    if (w < 0 && errno != EINTR) break;  // reaped by someone else: nothing to report
    if (give_up_.load()) {
      given_up = true;
      break;
    }
    const int left = ms_until(deadline);
    if (left == 0) {
      timed_out = true;
      break;
    }
    pollfd p[2];
    nfds_t n = 0;
    if (in_fd >= 0) p[n++] = {in_fd, POLLOUT, 0};
    if (out_fd >= 0) p[n++] = {out_fd, POLLIN, 0};
    const int ready = ::poll(n > 0 ? p : nullptr, n, std::min(nap_ms, left));
    nap_ms = std::min(nap_ms * 2, 20);
    if (ready <= 0) continue;  // a timeout, or EINTR
    for (nfds_t i = 0; i < n; ++i) {
      if (p[i].revents == 0) continue;
      if (p[i].fd == in_fd && !write_some(in_fd, json_line, written)) {
        ::close(in_fd);  // its stdin ends here
        in_fd = -1;
      } else if (p[i].fd == out_fd && !output.read_from(out_fd)) {
        ::close(out_fd);
        out_fd = -1;
      }
    }
  }
  if (timed_out || given_up) {
    ::kill(-pid, SIGKILL);  // the hook's whole process group
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  if (in_fd >= 0) ::close(in_fd);
  discard_pending_sigpipe();
  if (out_fd >= 0) {
    output.read_rest(out_fd);
    ::close(out_fd);
  }
  output.finish(command_);
  if (given_up) return HookEnd::kGivenUp;  // drain() or the destructor says so, once
  if (timed_out) {
    log_line("keel-train: alert hook timed out after " + seconds_text(timeout_s_) +
             " s (killed): " + echo_command(command_));
  } else if (reaped && WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    log_line("keel-train: alert hook exited with code " + std::to_string(WEXITSTATUS(status)) +
             ": " + echo_command(command_));
  } else if (reaped && WIFSIGNALED(status)) {
    log_line("keel-train: alert hook killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
             strsignal(WTERMSIG(status)) + "): " + echo_command(command_));
  }
  return HookEnd::kFinished;
}

}  // namespace keel
