// TrainState: the run's state and its tensor walker (Note [run state]).
#include "checkpoints/train_state.h"

#include "framework/error.h"

namespace keel {

TrainState::TrainState(ParamStore& params, AdamW& optimizer, ZeroPartition partition)
    : params_(params), optimizer_(optimizer), partition_(partition) {
  KEEL_ASSERT(partition_.total() == params_.total_elems());
  KEEL_ASSERT(optimizer_.m().numel() == partition_.mine().n);
  for (int id = 0; id < params_.size(); ++id) {
    const ParamInfo& info = params_.info(id);
    StateParam p;
    p.id = id;
    p.info = &info;
    p.values = {info.offset, info.numel()};
    p.moments = partition_.clip(info.offset, info.numel());
    tensors_.push_back(p);
  }
}

void TrainState::read_values(const StateParam& p, float* values) const {
  params_.params().copy_to_host(p.values.offset, p.values.n, values);
}

void TrainState::write_values(const StateParam& p, const float* values) const {
  params_.params().copy_from_host(p.values.offset, p.values.n, values);
}

void TrainState::read_moments(const StateParam& p, float* m, float* v) const {
  if (p.moments.empty()) return;
  const int64_t at = p.moments.offset - partition_.mine().offset;
  if (m) optimizer_.m().copy_to_host(at, p.moments.n, m);
  if (v) optimizer_.v().copy_to_host(at, p.moments.n, v);
}

void TrainState::write_moments(const StateParam& p, const float* m, const float* v) const {
  if (p.moments.empty()) return;
  const int64_t at = p.moments.offset - partition_.mine().offset;
  if (m) optimizer_.m().copy_from_host(at, p.moments.n, m);
  if (v) optimizer_.v().copy_from_host(at, p.moments.n, v);
}

uint64_t first_unskipped_sample(uint64_t next_sample, uint64_t global_batch,
                                const std::vector<SkippedRange>& skipped) {
  uint64_t first = next_sample;
  for (bool moved = true; moved;) {
    moved = false;
    for (const SkippedRange& sk : skipped) {
      if (first < sk.first_sample + sk.n && sk.first_sample < first + global_batch) {
        first = sk.first_sample + sk.n;
        moved = true;
      }
    }
  }
  return first;
}

}  // namespace keel
