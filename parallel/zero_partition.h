// Which part of the flat parameter arena this DP rank owns (Note [ZeRO-1 partition]). One object
// answers the question for everything that needs it: the trainer's reduce-scatter and all-gather,
// the global gradient norm, AdamW's segments and the checkpoint writer (each DP rank saves the
// optimizer moments of its own slice).
#pragma once

#include <cstdint>

namespace keel {

// A range [offset, offset + n) of arena elements.
struct ArenaSlice {
  int64_t offset = 0;
  int64_t n = 0;
  int64_t end() const { return offset + n; }
  bool empty() const { return n == 0; }
  bool operator==(const ArenaSlice&) const = default;
};

// Note [ZeRO-1 partition]: with ZeRO-1 on and dp > 1, the arena (its total already padded to a
// multiple of dp by ParamStore::allocate) is cut into dp equal contiguous slices, and DP rank d
// owns slice d: it keeps the reduce-scattered gradients and the AdamW moments of that slice only,
// updates those parameters, and all-gathers them back. Otherwise every rank owns the whole arena.
class ZeroPartition {
 public:
  ZeroPartition() = default;
  // total: arena elements (a multiple of dp when sharded); throws kInternal otherwise.
  ZeroPartition(int64_t total, int dp, int dp_rank, bool sharded);

  bool sharded() const { return sharded_; }
  int dp() const { return dp_; }
  int64_t total() const { return total_; }
  // This rank's slice, and that of DP rank r.
  ArenaSlice mine() const { return slice_of(dp_rank_); }
  ArenaSlice slice_of(int r) const;
  // [offset, offset + n) intersected with this rank's slice ({0, 0} when disjoint).
  ArenaSlice clip(int64_t offset, int64_t n) const;

 private:
  int64_t total_ = 0;
  int dp_ = 1, dp_rank_ = 0;
  bool sharded_ = false;
};

}  // namespace keel
