// Checkpoint reading: verification of every slice's checksum, a load into any layout (only the
// slices overlapping this rank's part are read), and whole logical tensors for export. Every
// manifest is read through read_manifest (manifest_io.h), so the geometry used here is validated.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "checkpoints/slice_geometry.h"
#include "framework/error.h"

namespace keel {

using ckpt_detail::Block;
using ckpt_detail::block_of;
using ckpt_detail::Geometry;
using ckpt_detail::geometry;
using ckpt_detail::kKinds;

namespace {

// Open files of one checkpoint directory, read with pread.
class ShardReader {
 public:
  explicit ShardReader(std::string dir) : dir_(std::move(dir)) {}
  ~ShardReader() {
    for (auto& [name, fd] : fds_) ::close(fd);
  }
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  // Reads and checks one slice into out[0, n).
  void read(const ckpt::Slice& s, const std::string& what, float* out) {
    const std::string path = dir_ + "/" + s.file();
    auto it = fds_.find(s.file());
    if (it == fds_.end()) {
      it = fds_.emplace(s.file(), open_regular_file(path, what)).first;
    }
    const size_t bytes = static_cast<size_t>(s.n()) * sizeof(float);
    char* dst = reinterpret_cast<char*>(out);
    for (size_t done = 0; done < bytes;) {
      const ssize_t r = ::pread(it->second, dst + done, bytes - done,
                                static_cast<off_t>(s.offset() + static_cast<int64_t>(done)));
      if (r < 0 && errno == EINTR) continue;
      KEEL_CHECK(r > 0, kData, path, ": ", what, " at byte ", s.offset(), ": ",
                 r < 0 ? std::strerror(errno) : "the file ends early (truncated)");
      done += static_cast<size_t>(r);
    }
    KEEL_CHECK(XXH3_64bits(out, bytes) == s.xxh3(), kData, path, ": ", what, " at byte ",
               s.offset(), ": checksum mismatch (the file is corrupt)");
  }

 private:
  std::string dir_;
  std::map<std::string, int> fds_;
};

std::string describe(const ckpt::TensorRecord& rec) {
  return std::string("tensor ") + rec.name() + " (" + tensor_kind_name(rec.kind()) + ")";
}

// Fills `target` (the block `tb` of `rec`'s logical tensor along dim `dim`, laid out row-major)
// at flat elements [need_begin, need_begin + need_n) from every slice of `rec` that overlaps them,
// reading and checking only those slices. Throws kData when they do not cover the range.
void gather_block(ShardReader& reader, const std::string& dir, const ckpt::TensorRecord& rec,
                  int dim, const Block& tb, int64_t need_begin, int64_t need_n, float* target) {
  const std::string what = describe(rec);
  const Shape shape(rec.shape().begin(), rec.shape().end());
  // A replicated target (dim < 0, the whole tensor) may come from slices sharded on a dimension
  // (grouped-query k/v heads are sharded under some TP sizes and replicated under others: Note
  // [gqa layouts] in layers/attention.h): walk the slices along theirs, the target spanning it.
  if (dim < 0) {
    for (const ckpt::Slice& s : rec.slices()) {
      if (s.shard_dim() >= 0) {
        KEEL_CHECK(s.shard_dim() < static_cast<int>(shape.size()), kData, dir,
                   "/manifest.pb: ", what, ": a slice is sharded on dimension ", s.shard_dim(),
                   " of a tensor of ", shape.size());
        dim = s.shard_dim();
        break;
      }
    }
  }
  const Geometry g = geometry(shape, dim);
  const int64_t t_begin = tb.dim < 0 ? 0 : tb.begin;
  const int64_t t_len = tb.dim < 0 ? g.extent : tb.len;
  std::vector<float> src;
  int64_t filled = 0;
  for (const ckpt::Slice& s : rec.slices()) {
    const int64_t s_begin = s.shard_dim() < 0 ? 0 : s.shard_begin();
    const int64_t s_len = s.shard_dim() < 0 ? g.extent : s.shard_len();
    KEEL_CHECK(s.shard_dim() < 0 || s.shard_dim() == dim, kData, dir, "/manifest.pb: ", what,
               ": a slice is sharded on dimension ", s.shard_dim(), ", this model on ", dim);
    if (s_begin >= t_begin + t_len || t_begin >= s_begin + s_len || s.n() == 0) continue;
    src.resize(static_cast<size_t>(s.n()));
    reader.read(s, what, src.data());
    // Walk the source's flat range in runs of `inner` contiguous elements.
    const int64_t end = s.flat_begin() + s.n();
    for (int64_t e = s.flat_begin(); e < end;) {
      const int64_t i = e % g.inner;
      const int64_t j = (e / g.inner) % s_len;
      const int64_t o = e / (g.inner * s_len);
      const int64_t run = std::min(g.inner - i, end - e);
      const int64_t row = s_begin + j;
      if (row >= t_begin && row < t_begin + t_len) {
        const int64_t t0 = (o * t_len + (row - t_begin)) * g.inner + i;
        const int64_t lo = std::max(t0, need_begin), hi = std::min(t0 + run, need_begin + need_n);
        if (hi > lo) {
          std::copy(src.begin() + (e - s.flat_begin()) + (lo - t0),
                    src.begin() + (e - s.flat_begin()) + (hi - t0), target + lo);
          filled += hi - lo;
        }
      }
      e += run;
    }
  }
  KEEL_CHECK(filled == need_n, kData, dir, "/manifest.pb: ", what, ": the slices cover ", filled,
             " of the ", need_n, " elements needed");
}

}  // namespace

// ---- load and verify -------------------------------------------------------------------------

void verify_checkpoint(const std::string& dir) {
  const ckpt::Manifest m = read_manifest(dir);
  ShardReader reader(dir);
  std::vector<float> buf;
  // Coverage and bounds were checked by read_manifest: what is left is every slice's bytes.
  for (const ckpt::TensorRecord& rec : m.tensors()) {
    for (const ckpt::Slice& s : rec.slices()) {
      buf.resize(static_cast<size_t>(s.n()));
      reader.read(s, describe(rec), buf.data());
    }
  }
}

ckpt::Manifest load_checkpoint(const std::string& dir, TrainState& state) {
  const ckpt::Manifest m = read_manifest(dir);
  std::map<std::pair<std::string, int>, const ckpt::TensorRecord*> records;
  for (const ckpt::TensorRecord& rec : m.tensors()) records[{rec.name(), rec.kind()}] = &rec;
  ShardReader reader(dir);
  std::vector<float> target;
  for (const StateParam& p : state.tensors()) {
    const ParamInfo& info = *p.info;
    for (ckpt::TensorKind kind : kKinds) {
      auto it = records.find({info.spec.name, kind});
      const std::string what =
          std::string("tensor ") + info.spec.name + " (" + tensor_kind_name(kind) + ")";
      KEEL_CHECK(it != records.end(), kData, dir, "/manifest.pb: ", what,
                 " is not in the checkpoint (the model config changed?)");
      const ckpt::TensorRecord& rec = *it->second;
      const Shape shape(rec.shape().begin(), rec.shape().end());
      KEEL_CHECK(loadable_shape(info.spec, shape), kData, dir, "/manifest.pb: ", what,
                 " has shape ", shape_str(shape), " in the checkpoint but ",
                 shape_str(info.spec.logical),
                 " in this config (a shape-determining model field changed)");
      // What this rank needs: its TP block, and of it [need_begin, need_begin + need_n).
      const Block tb = block_of(info);
      const int64_t need_begin = kind == ckpt::PARAM ? 0 : p.moments.offset - p.values.offset;
      int64_t need_n = kind == ckpt::PARAM ? p.values.n : p.moments.n;
      if (need_n == 0) continue;
      target.assign(static_cast<size_t>(p.values.n), 0.0f);
      if (shape[0] < info.spec.logical[0]) {
        // Padded rows the checkpoint lacks stay zero: read only the rows it has. Dim 0 is the
        // outermost, so they are a prefix of this rank's block.
        const int64_t row = p.values.n / info.local[0];
        const int64_t first = tb.dim == 0 ? tb.begin : 0;
        const int64_t have = std::clamp<int64_t>(shape[0] - first, 0, info.local[0]) * row;
        need_n = std::max<int64_t>(0, std::min(need_begin + need_n, have) - need_begin);
      }
      if (need_n > 0) {
        gather_block(reader, dir, rec, info.spec.shard_dim, tb, need_begin, need_n, target.data());
      }
      if (kind == ckpt::PARAM) {
        state.write_values(p, target.data());
      } else {
        const float* moment = target.data() + need_begin;
        state.write_moments(p, kind == ckpt::ADAM_M ? moment : nullptr,
                            kind == ckpt::ADAM_V ? moment : nullptr);
      }
    }
  }
  state.step = m.step();
  state.sampler.next_sample = m.next_sample();
  state.optimizer().set_t(m.adam_t());
  state.guard = GuardState{};
  for (const ckpt::SkippedRange& r : m.skipped()) {
    state.guard.skipped.push_back({r.first_sample(), r.n(), r.step()});
  }
  const ckpt::GuardRecord& gr = m.guard();
  GuardState& g = state.guard;
  g.loss_history.assign(gr.loss_history().begin(), gr.loss_history().end());
  g.grad_history.assign(gr.grad_history().begin(), gr.grad_history().end());
  g.streak = gr.streak();
  g.streak_first = gr.streak_first();
  g.streak_first_sample = gr.streak_first_sample();
  g.rewinds.assign(gr.rewinds().begin(), gr.rewinds().end());
  // A checkpoint without a guard record (none written yet) has no cool-down.
  g.cooldown_from = m.has_guard() ? gr.cooldown_from() : -1;
  return m;
}

bool loadable_shape(const ParamSpec& spec, const Shape& stored) {
  if (stored == spec.logical) return true;
  if (spec.valid_rows <= 0 || stored.size() != spec.logical.size() || stored.empty()) return false;
  for (size_t i = 1; i < stored.size(); ++i) {
    if (stored[i] != spec.logical[i]) return false;
  }
  return stored[0] >= spec.valid_rows;
}

std::vector<float> read_logical_tensor(const std::string& dir, const ckpt::Manifest& m,
                                       const std::string& name, ckpt::TensorKind kind) {
  for (const ckpt::TensorRecord& rec : m.tensors()) {
    if (rec.name() != name || rec.kind() != kind) continue;
    int dim = -1;
    for (const ckpt::Slice& s : rec.slices()) dim = std::max(dim, s.shard_dim());
    const int64_t n = shape_numel(Shape(rec.shape().begin(), rec.shape().end()));
    std::vector<float> out(static_cast<size_t>(n));
    ShardReader reader(dir);
    gather_block(reader, dir, rec, dim, Block{}, 0, n, out.data());
    return out;
  }
  KEEL_FAIL(kData, dir, "/manifest.pb: tensor ", name, " (", tensor_kind_name(kind),
            ") is not in the checkpoint");
}

}  // namespace keel
