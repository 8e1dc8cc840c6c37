// Data-parallel gradient synchronisation with communication/compute overlap.
// The gradient arena is cut into buckets (~parallel.bucket_mb each) of whole parameters, in the
// order backward finishes them (reverse registration order). When the last parameter of a bucket
// is reported ready, that bucket's non-blocking all-reduce starts at once, so it runs while
// backward computes the earlier layers; finish() waits for the rest before the optimizer step.
// MPI on host memory progresses only inside MPI calls, so every ready() also tests the
// outstanding requests (drives the transfers forward). Each bucket records whether its all-reduce
// was issued during backward (from ready()) or only by finish(), so tests can check the overlap.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace keel {

struct ArenaRange {
  int64_t offset;
  int64_t n;
};

class GradSync {
 public:
  // params: the arena range of every parameter, in registration order.
  GradSync(Communicator& dp, float* grads, std::vector<ArenaRange> params, int64_t bucket_bytes);

  void begin();              // a new step: no parameter is ready
  void ready(int param_id);  // parameter's gradient is final for this step
  void finish();             // start what is left, wait for everything
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Bucket b's arena range; buckets are numbered in backward order (bucket 0 holds the last
  // registered parameters).
  ArenaRange bucket_range(int b) const { return {buckets_.at(b).offset, buckets_.at(b).n}; }
  // This step: whether bucket b's all-reduce was issued by ready() while backward was still
  // running (its last parameter had been reported), rather than by finish().
  bool issued_during_backward(int b) const { return buckets_.at(b).during_backward; }
  int buckets_issued_during_backward() const;
  // Seconds finish() spent waiting: communication not hidden behind backward.
  double exposed_seconds() const { return exposed_s_; }
  // Seconds from the first bucket's launch to the end of finish() (the communication window).
  double window_seconds() const { return window_s_; }

 private:
  struct Bucket {
    int64_t offset = 0, n = 0;
    int pending = 0;  // parameters not yet ready this step
    int total = 0;
    bool during_backward = false;  // issued by ready() this step
    std::unique_ptr<CommRequest> req;
  };
  void launch(Bucket& b, bool during_backward);

  Communicator& dp_;
  float* grads_;
  std::vector<int> bucket_of_;  // parameter -> bucket
  std::vector<Bucket> buckets_;
  double exposed_s_ = 0.0, window_s_ = 0.0, first_launch_ = 0.0;
};

}  // namespace keel
