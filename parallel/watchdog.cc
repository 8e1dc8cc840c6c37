// Collective watchdog thread and launcher-SIGTERM report.
//
// Note [launcher SIGTERM]: when a rank dies (killed, out of memory, a crash), the survivors sit
// in a collective that cannot complete. Open MPI's mpirun notices the death within about a
// second and ends every other rank with SIGTERM, then SIGKILL one second later
// (odls_base_sigkill_timeout); srun does the same. That is far sooner than any useful
// parallel.timeout_s, and MPI on shared memory returns no error to the waiting collective (not
// even with MPI_ERRORS_RETURN), so without this handler the job's only words would be the
// launcher's "process rank 1 exited on signal 9". The handler prints one line per surviving rank
// naming the collective, group and step it was waiting in, then lets the signal end the process
// as before (the previous disposition is restored and the signal re-raised), so the launcher sees
// the exit it expects. It only reads atomics and calls write(2), sigaction and raise, which are
// async-signal-safe.
//
// Note [stop signal]: keel-train takes SIGTERM and SIGUSR1 as "save and stop" (launch/
// stop_signals.h), so a rank that the launcher ends because a peer died would wait in its
// collective until SIGKILL, silently. The stop-signal handler calls note_stop_signal(): if a
// collective has been in flight for over kStuckAfterSignal it prints the line at once, and the
// watchdog thread prints it when the collective in flight is still there kStuckAfterSignal after
// the signal (or after it began, if later). Either way once, well inside mpirun's one second
// before SIGKILL. A healthy collective finishes long before that; the rank then saves and exits.
//
// Note [abort hooks]: ending the process with _Exit is enough for MPI, whose peers the launcher
// then ends. An NCCL collective is different: its kernel spins on the GPU and NCCL's proxy thread
// keeps driving the network, and a process that exits under them may leave the device busy or
// its peers waiting on a connection that never closes cleanly. ncclCommAbort stops both and makes
// the blocked NCCL call return, so NcclCommunicator::abort() is registered as an abort hook and
// runs after the timeout line, before _Exit. A hook may hang too (ncclCommAbort waits for the
// proxy thread, which may sit in a dead network call), and the watchdog's one promise is that the
// job ends: each hook runs on a thread of its own, and the watchdog thread waits for it at most
// abort_hook_grace_s(), then leaves it running and goes on (_Exit ends it with the process). The
// grace is short against the timeout (a quarter of it, at most 2 s), so the job ends within about
// timeout_s plus one grace per hook. Once released, the stuck thread may end the process itself
// (e.g. with the communicator's own "aborted" error) before the last hooks ran; either way the
// job ends with the watchdog's line first.
#include "parallel/watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <system_error>

namespace keel {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// A line built without allocation or locale (usable in a signal handler), written to stderr in
// one write(2) so lines from different threads or ranks do not interleave.
class Line {
 public:
  Line& add(const char* s) {
    while (s && *s && n_ < kCap) buf_[n_++] = *s++;
    return *this;
  }
  Line& add(long long v) {
    char digits[24];
    int k = 0;
    unsigned long long u = v < 0 ? 0ull - static_cast<unsigned long long>(v) : v;
    do {
      digits[k++] = static_cast<char>('0' + u % 10);
      u /= 10;
    } while (u != 0);
    if (v < 0) digits[k++] = '-';
    while (k > 0 && n_ < kCap) buf_[n_++] = digits[--k];
    return *this;
  }
  void write_stderr() {
    buf_[n_++] = '\n';
    ssize_t rc;
    do {
      rc = ::write(STDERR_FILENO, buf_, n_);
    } while (rc < 0 && errno == EINTR);
  }

 private:
  static constexpr size_t kCap = 511;  // one byte kept for the newline
  char buf_[kCap + 1];
  size_t n_ = 0;
};

// "at step S", or "during start-up" before the first step.
Line& add_step(Line& line, long long step) {
  if (step > 0) return line.add("at step ").add(step);
  return line.add("during start-up");
}

// "keel-train: communication error: rank R: OP over the GROUP group at step S"
Line& add_collective(Line& line, int rank, const char* op, const char* group, long long step) {
  line.add("keel-train: communication error: rank ").add(static_cast<long long>(rank)).add(": ");
  line.add(op).add(" over the ").add(group).add(" group ");
  return add_step(line, step);
}

// The watchdog whose SIGTERM handler is installed (at most one at a time), and what it replaced.
std::atomic<Watchdog*> g_sigterm_owner{nullptr};
struct sigaction g_previous_sigterm;
// The watchdog that note_stop_signal() tells (the one running, at most one at a time).
std::atomic<Watchdog*> g_stop_owner{nullptr};

constexpr double kStuckAfterSignal = 0.25;  // seconds (Note [stop signal])

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGINT:
      return "SIGINT";
    default:
      return "a stop signal";
  }
}

}  // namespace

Watchdog::Watchdog(double timeout_s, int world_rank) : timeout_s_(timeout_s), rank_(world_rank) {
  if (timeout_s_ <= 0) return;
  thread_ = std::thread([this] { loop(); });
  Watchdog* no_owner = nullptr;
  g_stop_owner.compare_exchange_strong(no_owner, this);
  struct sigaction current;
  Watchdog* none = nullptr;
  if (sigaction(SIGTERM, nullptr, &current) == 0 && current.sa_handler != SIG_IGN &&
      g_sigterm_owner.compare_exchange_strong(none, this)) {
    g_previous_sigterm = current;
    struct sigaction act = {};
    act.sa_handler = &Watchdog::on_sigterm;
    sigemptyset(&act.sa_mask);
    handles_sigterm_ = sigaction(SIGTERM, &act, nullptr) == 0;
    if (!handles_sigterm_) g_sigterm_owner.store(nullptr);
  }
}

Watchdog::~Watchdog() {
  Watchdog* self = this;
  g_stop_owner.compare_exchange_strong(self, nullptr);
  if (handles_sigterm_) {
    // Only while ours is still the handler: one installed on top of it since (keel-train's stop
    // signals, which stay installed after a stop so that a repeat SIGTERM during shutdown is
    // ignored) is not undone here.
    struct sigaction current;
    if (sigaction(SIGTERM, nullptr, &current) == 0 && current.sa_handler == &Watchdog::on_sigterm) {
      sigaction(SIGTERM, &g_previous_sigterm, nullptr);
    }
    g_sigterm_owner.store(nullptr);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::begin(const char* op, const char* group) {
  op_.store(op);
  group_.store(group);
  started_.store(now_s());
}

void Watchdog::end() { started_.store(0.0); }

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  const auto period = std::chrono::milliseconds(50);
  while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
    const double t0 = started_.load();
    const double signal_at = signal_at_.load();
    if (signal_at > 0 && t0 > 0 && now_s() - std::max(signal_at, t0) > kStuckAfterSignal) {
      report_stuck_after_signal();
    }
    if (t0 > 0 && now_s() - t0 > timeout_s_) {
      char timeout[32];
      std::snprintf(timeout, sizeof(timeout), "%g", timeout_s_);
      Line line;
      add_collective(line, rank_, op_.load(), group_.load(), step_.load())
          .add(" did not complete within parallel.timeout_s=")
          .add(timeout)
          .add(" s (a peer rank died or hangs); ending the job")
          .write_stderr();
      run_abort_hooks();
      std::_Exit(1);  // MPI_Abort may not be called from this thread; the launcher ends the rest
    }
  }
}

int Watchdog::add_abort_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mu_);
  const int id = next_hook_id_++;
  hooks_.emplace_back(id, std::move(hook));
  return id;
}

void Watchdog::remove_abort_hook(int id) {
  // The hooks are running and _Exit follows them: wait for it rather than let the caller free
  // what a hook may be using.
  while (ending_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::lock_guard<std::mutex> lock(hooks_mu_);
  hooks_.erase(
      std::remove_if(hooks_.begin(), hooks_.end(), [id](const auto& h) { return h.first == id; }),
      hooks_.end());
}

double Watchdog::abort_hook_grace_s(double timeout_s) { return std::min(2.0, timeout_s / 4); }

// Note [abort hooks]. Runs on the watchdog thread, which ends the process right after.
void Watchdog::run_abort_hooks() {
  ending_.store(true);
  std::vector<std::pair<int, std::function<void()>>> hooks;
  {
    // A copy, so that an abandoned hook keeps its own (remove_abort_hook now waits for the end).
    std::lock_guard<std::mutex> lock(hooks_mu_);
    hooks = hooks_;
  }
  const double grace = abort_hook_grace_s(timeout_s_);
  char grace_text[32];
  std::snprintf(grace_text, sizeof(grace_text), "%g", grace);
  // Shared with the hook's thread, which outlives this function when abandoned.
  struct Run {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
  };
  for (size_t i = 0; i < hooks.size(); ++i) {
    const long long number = static_cast<long long>(i) + 1;
    auto run = std::make_shared<Run>();
    try {
      std::thread([run, hook = std::move(hooks[i].second)] {
        std::string error;
        try {
          hook();
        } catch (const std::exception& e) {
          error = e.what();
        } catch (...) {
          error = "an exception that is not a std::exception";
        }
        std::lock_guard<std::mutex> lock(run->mu);
        run->done = true;
        run->error = std::move(error);
        run->cv.notify_all();
      }).detach();
    } catch (const std::system_error& e) {
      Line line;
      line.add("keel-train: rank ").add(static_cast<long long>(rank_)).add(": abort hook ");
      line.add(number).add(" not run: cannot start its thread: ").add(e.what()).write_stderr();
      continue;
    }
    std::unique_lock<std::mutex> lock(run->mu);
    const bool returned =
        run->cv.wait_for(lock, std::chrono::duration<double>(grace), [&run] { return run->done; });
    Line line;
    line.add("keel-train: rank ").add(static_cast<long long>(rank_)).add(": abort hook ");
    if (!returned) {
      line.add(number).add(" did not return within ").add(grace_text);
      line.add(" s; abandoned").write_stderr();
    } else if (!run->error.empty()) {
      line.add(number).add(" failed: ").add(run->error.c_str()).write_stderr();
    }
  }
}

void Watchdog::report_stuck_after_signal() {
  if (stuck_reported_.exchange(true)) return;
  static_assert(kStuckAfterSignal == 0.25, "the line names the value");
  Line line;
  add_collective(line, rank_, op_.load(), group_.load(), step_.load())
      .add(" did not complete within 0.25 s of ")
      .add(signal_name(signal_.load()))
      .add(
          " (another rank failed or was killed, or the job was cancelled); waiting for it, to "
          "save the checkpoint if it completes")
      .write_stderr();
}

void Watchdog::note_stop_signal(int sig) {
  Watchdog* w = g_stop_owner.load();
  if (!w) return;
  w->signal_.store(sig);
  const double now = now_s();
  w->signal_at_.store(now);
  const double t0 = w->started_.load();
  if (t0 > 0 && now - t0 > 2 * kStuckAfterSignal) w->report_stuck_after_signal();
}

void Watchdog::on_sigterm(int sig) {
  const int saved_errno = errno;
  if (Watchdog* w = g_sigterm_owner.load()) {
    Line line;
    const long long step = w->step_.load();
    const char* why = " (another rank failed or was killed, or the job was cancelled)";
    if (w->started_.load() > 0) {
      add_collective(line, w->rank_, w->op_.load(), w->group_.load(), step)
          .add(" did not complete: the launcher ended this rank (SIGTERM) while it waited")
          .add(why);
    } else {
      line.add("keel-train: rank ").add(static_cast<long long>(w->rank_));
      add_step(line.add(": ended by the launcher (SIGTERM) "), step)
          .add(", outside any collective")
          .add(why);
    }
    line.write_stderr();
  }
  // End the process as the signal would have: restore what was there and re-raise (delivered
  // when this handler returns, since SIGTERM is blocked while it runs).
  sigaction(sig, &g_previous_sigterm, nullptr);
  raise(sig);
  errno = saved_errno;
}

}  // namespace keel
