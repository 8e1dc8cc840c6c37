// Collective watchdog thread.
#include "parallel/watchdog.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace keel {

namespace {
double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Watchdog::Watchdog(double timeout_s, int world_rank) : timeout_s_(timeout_s), rank_(world_rank) {
  if (timeout_s_ > 0) thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
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
  const auto period = std::chrono::milliseconds(timeout_s_ < 2 ? 50 : 200);
  while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
    const double t0 = started_.load();
    if (t0 > 0 && now_s() - t0 > timeout_s_) {
      std::fprintf(stderr,
                   "keel-train: communication error: rank %d: %s over the %s group at step %lld "
                   "did not complete within parallel.timeout_s=%g s (a peer rank died or hangs); "
                   "ending the job\n",
                   rank_, op_.load(), group_.load(), step_.load(), timeout_s_);
      std::fflush(stderr);
      std::_Exit(1);  // MPI_Abort may not be called from this thread; the launcher ends the rest
    }
  }
}

}  // namespace keel
