// Note [preemption]: a cluster ends a job with a signal and a grace period (Slurm: SIGTERM, then
// SIGKILL after KillWait; `--signal=USR1@120` asks for SIGUSR1 two minutes before the time
// limit). The first SIGTERM or SIGUSR1 only records itself here (async-signal-safe: one atomic
// store and the watchdog's note). At the end of every step the trainer all-reduces "has any rank
// been signalled" together with its async-save flag (one small collective), so every rank
// learns it at the same step, whichever rank the signal reached: they finish any pending save,
// save the current step, print one line and exit 0; running the same command resumes there. The
// same signal again within kRepeatWindowSeconds of the first is ignored, with one stderr line:
// a Slurm job step gets SIGTERM from srun and from slurmstepd, and the second must not kill the
// process in the middle of the save the first one asked for. A stop signal after that window,
// or the other stop signal, ends the process at once (default action), for a user who does not
// want to wait. The handlers are installed without SA_RESTART, so a system call interrupted by
// one fails with EINTR; the writes that matter retry (framework/file_io.cc). A rank stuck in a
// collective because a peer died would otherwise wait silently for the launcher's SIGKILL: the
// watchdog names its collective (Note [stop signal]).
#include "launch/train/stop_signals.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iterator>

#include "framework/error.h"
#include "parallel/watchdog.h"

namespace keel {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGUSR1};
std::atomic<int> g_received{0};
std::atomic<bool> g_installed{false};
struct sigaction g_previous[2];
// When the first stop signal arrived (CLOCK_MONOTONIC, ns); 0 while its handler has not yet
// stored it.
std::atomic<int64_t> g_first_ns{0};
// Built at install time: the handler only writes them.
char g_second_line[160];
size_t g_second_len = 0;
char g_repeat_line[2][200];  // per kSignals entry
size_t g_repeat_len[2] = {0, 0};

size_t line_length(int n, size_t capacity) {
  return static_cast<size_t>(std::max(0, std::min<int>(n, static_cast<int>(capacity) - 1)));
}

int64_t monotonic_ns() {
  timespec ts = {};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void write_stderr(const char* line, size_t len) {
  ssize_t rc;
  do {
    rc = ::write(STDERR_FILENO, line, len);
  } while (rc < 0 && errno == EINTR);
}

}  // namespace

StopSignals::StopSignals(int world_rank) {
  bool expected = false;
  KEEL_CHECK(g_installed.compare_exchange_strong(expected, true), kInternal,
             "StopSignals installed twice");
  g_received.store(0);
  g_first_ns.store(0);
  const int n = std::snprintf(g_second_line, sizeof(g_second_line),
                              "keel-train: rank %d: a second stop signal: ending now, without "
                              "saving\n",
                              world_rank);
  g_second_len = line_length(n, sizeof(g_second_line));
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    const bool term = kSignals[i] == SIGTERM;
    const int m = std::snprintf(
        g_repeat_line[i], sizeof(g_repeat_line[i]),
        "keel-train: rank %d: %s again within %d s of the first: ignored; saving and stopping as "
        "the first asked (%s, or %s after %d s, ends the process at once)\n",
        world_rank, term ? "SIGTERM" : "SIGUSR1", kRepeatWindowSeconds,
        term ? "SIGUSR1" : "SIGTERM", term ? "SIGTERM" : "SIGUSR1", kRepeatWindowSeconds);
    g_repeat_len[i] = line_length(m, sizeof(g_repeat_line[i]));
  }
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    struct sigaction act = {};
    act.sa_handler = &StopSignals::on_signal;
    sigemptyset(&act.sa_mask);
    for (int s : kSignals) sigaddset(&act.sa_mask, s);  // one handler at a time
    KEEL_CHECK(sigaction(kSignals[i], &act, &g_previous[i]) == 0, kInternal,
               "cannot install the stop-signal handler: ", std::strerror(errno));
  }
}

StopSignals::~StopSignals() {
  // After a stop signal the process is on its way out (its checkpoint saved): the handlers stay,
  // so that a repeat inside the window, arriving while MPI and the rest shut down, is still
  // ignored rather than turning a clean exit 0 into a death by SIGTERM.
  if (g_received.load() == 0) {
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      sigaction(kSignals[i], &g_previous[i], nullptr);
    }
  }
  g_installed.store(false);
}

int StopSignals::received() { return g_received.load(); }

void StopSignals::on_signal(int sig) {
  const int saved_errno = errno;
  const int64_t now = monotonic_ns();
  int first = 0;
  if (g_received.compare_exchange_strong(first, sig)) {
    g_first_ns.store(now);
    Watchdog::note_stop_signal(sig);
    errno = saved_errno;
    return;
  }
  // `first` is now the first signal. The handler blocks both signals only on the thread it runs
  // on, so another thread may get here before the first handler stored its time (still 0): that
  // is within the window too.
  const int64_t first_ns = g_first_ns.load();
  const bool repeat = sig == first && (first_ns == 0 ||
                                       now - first_ns < int64_t{kRepeatWindowSeconds} * 1000000000);
  if (repeat) {
    const size_t i = sig == kSignals[0] ? 0 : 1;
    write_stderr(g_repeat_line[i], g_repeat_len[i]);
  } else {
    write_stderr(g_second_line, g_second_len);
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);  // delivered when this handler returns
  }
  errno = saved_errno;
}

}  // namespace keel
