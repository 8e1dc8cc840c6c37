// Bucketed, overlapped DP gradient all-reduce.
#include "parallel/grad_sync.h"

#include <omp.h>

#include <algorithm>

#include "framework/error.h"

namespace keel {

GradSync::GradSync(Communicator& dp, float* grads, std::vector<ArenaRange> params,
                   int64_t bucket_bytes)
    : dp_(dp), grads_(grads) {
  bucket_of_.assign(params.size(), -1);
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // Walk parameters in backward order; a bucket is a contiguous arena range [lo, hi).
  Bucket cur;
  int64_t lo = 0, hi = 0;
  for (int id = static_cast<int>(params.size()) - 1; id >= 0; --id) {
    const ArenaRange& r = params[id];
    if (cur.total == 0) {
      lo = r.offset;
      hi = r.offset + r.n;
    }
    lo = std::min(lo, r.offset);
    hi = std::max(hi, r.offset + r.n);
    bucket_of_[id] = static_cast<int>(buckets_.size());
    ++cur.total;
    if (hi - lo >= cap || id == 0) {
      cur.offset = lo;
      cur.n = hi - lo;
      buckets_.push_back(std::move(cur));
      cur = Bucket();
    }
  }
}

void GradSync::begin() {
  for (Bucket& b : buckets_) {
    b.pending = b.total;
    b.during_backward = false;
    b.req.reset();
  }
  exposed_s_ = 0.0;
  window_s_ = 0.0;
  first_launch_ = 0.0;
}

void GradSync::launch(Bucket& b, bool during_backward) {
  if (first_launch_ == 0.0) first_launch_ = omp_get_wtime();
  b.during_backward = during_backward;
  b.req = dp_.iall_reduce(grads_ + b.offset, b.n);
}

void GradSync::ready(int param_id) {
  Bucket& b = buckets_.at(bucket_of_.at(param_id));
  KEEL_ASSERT(b.pending > 0);
  if (--b.pending == 0) launch(b, /*during_backward=*/true);
  for (Bucket& o : buckets_) {
    if (o.req) o.req->test();
  }
}

void GradSync::finish() {
  const double t0 = omp_get_wtime();
  for (Bucket& b : buckets_) {
    if (!b.req) {
      b.pending = 0;
      launch(b, /*during_backward=*/false);
    }
  }
  for (Bucket& b : buckets_) b.req->wait();
  const double t1 = omp_get_wtime();
  exposed_s_ = t1 - t0;
  window_s_ = t1 - first_launch_;
}

int GradSync::buckets_issued_during_backward() const {
  int n = 0;
  for (const Bucket& b : buckets_) n += b.during_backward ? 1 : 0;
  return n;
}

}  // namespace keel
