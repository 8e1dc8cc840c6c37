// ParamStore layout and layout-independent initialisation.
#include "layers/params.h"

#include <algorithm>
#include <vector>

#include "framework/error.h"
#include "framework/philox.h"

namespace keel {

int ParamStore::add(ParamSpec spec) {
  KEEL_ASSERT(!allocated_);
  KEEL_CHECK(find(spec.name) < 0, kInternal, "duplicate parameter name ", spec.name);
  ParamInfo info;
  info.spec = std::move(spec);
  infos_.push_back(std::move(info));
  return static_cast<int>(infos_.size()) - 1;
}

int ParamStore::find(const std::string& name) const {
  for (size_t i = 0; i < infos_.size(); ++i) {
    if (infos_[i].spec.name == name) return static_cast<int>(i);
  }
  return -1;
}

void ParamStore::allocate(int tp_rank, int tp_size, int pad_multiple, Device device) {
  KEEL_ASSERT(!allocated_);
  int64_t offset = 0;
  for (auto& info : infos_) {
    info.local = info.spec.logical;
    const int d = info.spec.shard_dim;
    if (d >= 0 && tp_size > 1) {
      const int64_t full = info.spec.logical.at(d);
      KEEL_CHECK(full % tp_size == 0, kLayout, "parameter ", info.spec.name, " dimension ", d, " (",
                 full, ") is not divisible by parallel.tp=", tp_size);
      info.local[d] = full / tp_size;
      info.shard_begin = tp_rank * info.local[d];
    }
    info.offset = offset;
    offset += (info.numel() + 15) / 16 * 16;  // keep every tensor 64-byte aligned
  }
  const int64_t quantum = 16 * static_cast<int64_t>(std::max(1, pad_multiple));
  total_ = (offset + quantum - 1) / quantum * quantum;
  params_ = Tensor::zeros({total_}, DType::kF32, device);
  grads_ = Tensor::zeros({total_}, DType::kF32, device);
  allocated_ = true;
}

int64_t ParamStore::logical_index(int id, int64_t j) const {
  const ParamInfo& info = infos_[id];
  const int d = info.spec.shard_dim;
  if (d < 0 || info.local == info.spec.logical) return j;
  int64_t inner = 1;
  for (size_t k = d + 1; k < info.local.size(); ++k) inner *= info.local[k];
  const int64_t local_d = info.local[d];
  const int64_t outer = j / (inner * local_d);
  const int64_t rem = j % (inner * local_d);
  const int64_t idx_d = rem / inner, in = rem % inner;
  return (outer * info.spec.logical[d] + info.shard_begin + idx_d) * inner + in;
}

void ParamStore::init(uint64_t seed) {
  KEEL_ASSERT(allocated_);
  // Drawn on the host, one parameter at a time, then copied to wherever the arena lives.
  std::vector<float> host;
  for (int id = 0; id < size(); ++id) {
    const ParamInfo& info = infos_[id];
    const int64_t n = info.numel();
    host.resize(static_cast<size_t>(n));
    float* p = host.data();
    if (info.spec.init == ParamInit::kConstant) {
      std::fill(p, p + n, info.spec.value);
    } else {
      const uint64_t stream = fnv1a64(info.spec.name);
      const double stdv = info.spec.value;
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < n; ++j) {
        p[j] = static_cast<float>(stdv * philox_normal(seed, stream, logical_index(id, j)));
      }
    }
    params_.copy_from_host(info.offset, n, p);
  }
}

}  // namespace keel

#include "parallel/communicator.h"

namespace keel {

std::vector<float> gather_logical(const ParamStore& ps, int id, const float* local,
                                  Communicator& tp) {
  const ParamInfo& info = ps.info(id);
  const int64_t n = info.numel();
  if (!info.sharded()) return std::vector<float>(local, local + n);
  const int d = info.spec.shard_dim;
  std::vector<float> all(static_cast<size_t>(n) * tp.size());
  tp.all_gather(local, all.data(), n);
  // all = [rank][outer][local_d][inner]  ->  logical [outer][rank * local_d + i][inner]
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= info.local[k];
  for (size_t k = d + 1; k < info.local.size(); ++k) inner *= info.local[k];
  const int64_t ld = info.local[d];
  std::vector<float> out(all.size());
  for (int r = 0; r < tp.size(); ++r) {
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < ld; ++i) {
        const float* src = all.data() + ((r * outer + o) * ld + i) * inner;
        float* dst = out.data() + (o * ld * tp.size() + r * ld + i) * inner;
        std::copy(src, src + inner, dst);
      }
    }
  }
  return out;
}

}  // namespace keel
