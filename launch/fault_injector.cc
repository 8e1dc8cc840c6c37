// Fault injection at named points (see header).
#include "launch/fault_injector.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

namespace keel {

void FaultInjector::at(FaultPoint point, int64_t step) const {
  if (point != FaultPoint::kStepBegin) return;
  if (cfg_.kill_at_step() <= 0 || cfg_.kill_at_step() != step || cfg_.kill_rank() != world_rank_) {
    return;
  }
  const bool stall = cfg_.fault() == config::STALL;
  std::fprintf(stderr, "keel-train: debug.kill_rank=%d: %s this rank at step %lld\n", world_rank_,
               stall ? "stalling" : "killing", static_cast<long long>(step));
  std::fflush(stderr);
  if (!stall) std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace keel
