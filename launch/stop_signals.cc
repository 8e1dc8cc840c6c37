// Note [preemption]: a cluster ends a job with a signal and a grace period (Slurm: SIGTERM, then
// SIGKILL after KillWait; `--signal=USR1@120` asks for SIGUSR1 two minutes before the time
// limit). The first SIGTERM or SIGUSR1 only records itself here (async-signal-safe: one atomic
// store and the watchdog's note). At the end of every step the trainer all-reduces "has any rank
// been signalled" together with its async-save flag (one small collective), so every rank
// learns it at the same step, whichever rank the signal reached: they finish any pending save,
// save the current step, print one line and exit 0; running the same command resumes there. A
// second stop signal ends the process at once (default action), for a user who does not want to
// wait. A rank stuck in a collective because a peer died would otherwise wait silently for the
// launcher's SIGKILL: the watchdog names its collective (Note [stop signal]).
#include "launch/stop_signals.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "framework/error.h"
#include "parallel/watchdog.h"

namespace keel {

namespace {

constexpr int kSignals[] = {SIGTERM, SIGUSR1};
std::atomic<int> g_received{0};
std::atomic<bool> g_installed{false};
struct sigaction g_previous[2];
char g_second_line[160];  // built at install time: the handler only writes it
size_t g_second_len = 0;

}  // namespace

StopSignals::StopSignals(int world_rank) {
  bool expected = false;
  KEEL_CHECK(g_installed.compare_exchange_strong(expected, true), kInternal,
             "StopSignals installed twice");
  g_received.store(0);
  const int n = std::snprintf(g_second_line, sizeof(g_second_line),
                              "keel-train: rank %d: a second stop signal: ending now, without "
                              "saving\n",
                              world_rank);
  g_second_len = static_cast<size_t>(std::max(0, std::min<int>(n, sizeof(g_second_line) - 1)));
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
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
  g_installed.store(false);
}

int StopSignals::received() { return g_received.load(); }

void StopSignals::on_signal(int sig) {
  const int saved_errno = errno;
  int none = 0;
  if (g_received.compare_exchange_strong(none, sig)) {
    Watchdog::note_stop_signal(sig);
  } else {
    ssize_t rc;
    do {
      rc = ::write(STDERR_FILENO, g_second_line, g_second_len);
    } while (rc < 0 && errno == EINTR);
    struct sigaction dfl = {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);  // delivered when this handler returns
  }
  errno = saved_errno;
}

}  // namespace keel
