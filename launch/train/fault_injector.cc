// Fault injection at named points (see header).
#include "launch/train/fault_injector.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "framework/error.h"

namespace keel {

namespace {
config::FaultPoint config_point(FaultPoint p) {
  switch (p) {
    case FaultPoint::kStepBegin:
      return config::STEP_BEGIN;
    case FaultPoint::kSaveMidShard:
      return config::SAVE_MID_SHARD;
    case FaultPoint::kSaveBeforeManifest:
      return config::SAVE_BEFORE_MANIFEST;
    case FaultPoint::kSaveBeforeLatest:
      return config::SAVE_BEFORE_LATEST;
    case FaultPoint::kAfterRewind:
      return config::AFTER_REWIND;
  }
  return config::FAULT_POINT_UNSPECIFIED;
}
}  // namespace

void FaultInjector::at(FaultPoint point, int64_t step) const {
  if (cfg_.kill_at_step() <= 0 || cfg_.kill_at_step() != step || cfg_.kill_rank() != world_rank_ ||
      cfg_.fault_point() != config_point(point)) {
    return;
  }
  if (cfg_.fault() == config::THROW) {
    KEEL_FAIL(kInternal, "debug.kill_rank=", world_rank_, ": injected error at step ", step, " (",
              config::FaultPoint_Name(cfg_.fault_point()), ")");
  }
  const bool stall = cfg_.fault() == config::STALL;
  std::fprintf(stderr, "keel-train: debug.kill_rank=%d: %s this rank at step %lld (%s)\n",
               world_rank_, stall ? "stalling" : "killing", static_cast<long long>(step),
               config::FaultPoint_Name(cfg_.fault_point()).c_str());
  std::fflush(stderr);
  if (!stall) std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

FaultInjector::Injection FaultInjector::inject(int64_t step, const std::vector<int64_t>& rewinds) {
  const int64_t replayed_up_to =
      rewinds.empty() ? 0 : *std::max_element(rewinds.begin(), rewinds.end());
  auto injected = [&](int32_t at, int64_t& fired) {
    const bool due = at > 0 && (step == at || (cfg_.inject_every() > 0 && step > at &&
                                               (step - at) % cfg_.inject_every() == 0));
    if (!due || step <= fired || step <= replayed_up_to) return false;
    fired = step;
    return true;
  };
  Injection in;
  in.spike = injected(cfg_.inject_spike_at_step(), spike_fired_);
  in.nan = injected(cfg_.inject_nan_at_step(), nan_fired_);
  in.bitflip = injected(cfg_.inject_bitflip_at_step(), bitflip_fired_) &&
               world_rank_ == cfg_.inject_bitflip_rank();
  in.param_bitflip = injected(cfg_.inject_param_bitflip_at_step(), param_bitflip_fired_) &&
                     world_rank_ == cfg_.inject_bitflip_rank();
  return in;
}

}  // namespace keel
