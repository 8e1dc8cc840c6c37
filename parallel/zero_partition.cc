// ZeroPartition: contiguous 1/dp slices of the arena (Note [ZeRO-1 partition]).
#include "parallel/zero_partition.h"

#include <algorithm>

#include "framework/error.h"

namespace keel {

ZeroPartition::ZeroPartition(int64_t total, int dp, int dp_rank, bool sharded)
    : total_(total), dp_(dp), dp_rank_(dp_rank), sharded_(sharded && dp > 1) {
  KEEL_ASSERT(dp >= 1 && dp_rank >= 0 && dp_rank < dp && total >= 0);
  KEEL_ASSERT(!sharded_ || total % dp == 0);
}

ArenaSlice ZeroPartition::slice_of(int r) const {
  if (!sharded_) return {0, total_};
  const int64_t n = total_ / dp_;
  return {r * n, n};
}

ArenaSlice ZeroPartition::clip(int64_t offset, int64_t n) const {
  const ArenaSlice m = mine();
  const int64_t lo = std::max(offset, m.offset), hi = std::min(offset + n, m.end());
  return hi > lo ? ArenaSlice{lo, hi - lo} : ArenaSlice{};
}

}  // namespace keel
