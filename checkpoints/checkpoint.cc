// Checkpoint save (sharded, atomic) and its commit. See the header and Note [checkpoint commit];
// the async writer is in async_writer.cc, reading in checkpoint_load.cc.
#include "checkpoints/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>

#include "checkpoints/save_parts.h"
#include "checkpoints/slice_geometry.h"
#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace fs = std::filesystem;
using ckpt_detail::Block;
using ckpt_detail::block_of;
using ckpt_detail::kKinds;

namespace {

std::string shard_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "shard_%05d.bin", rank);
  return buf;
}

std::string index_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "shard_%05d.idx", rank);
  return buf;
}

// fsync(2) retried on EINTR (the stop signals are installed without SA_RESTART).
int fsync_until_done(int fd) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

// close(2) of a file just written: on Linux the descriptor is released even when close reports
// EINTR, so that is not a failure and is never retried.
int close_after_write(int fd) {
  const int rc = ::close(fd);
  return rc != 0 && errno == EINTR ? 0 : rc;
}

// Makes `path` (a directory whose entries changed, or a file) durable. A file system that cannot
// fsync a directory (EINVAL) has nothing to flush; any other failure loses the commit's rename.
// Throws kIo naming the path and the OS reason.
void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KEEL_CHECK(fd >= 0, kIo, path, ": cannot open to fsync: ", std::strerror(errno));
  if (fsync_until_done(fd) != 0 && errno != EINVAL) {
    const int err = errno;
    ::close(fd);
    KEEL_FAIL(kIo, path, ": fsync failed: ", std::strerror(err));
  }
  ::close(fd);
}

// This rank's slice of (parameter, kind), when this rank writes it (see the header's "who writes
// what"); n == 0 otherwise.
ckpt::Slice my_slice(const StateParam& p, ckpt::TensorKind kind, const Topology& topo,
                     const ZeroPartition& part) {
  ckpt::Slice s;
  const bool tp_writer = p.info->sharded() || topo.tp_rank == 0;
  const Block b = block_of(*p.info);
  s.set_shard_dim(b.dim);
  s.set_shard_begin(b.begin);
  s.set_shard_len(b.dim < 0 ? 0 : b.len);
  if (kind == ckpt::PARAM) {
    if (tp_writer && topo.dp_rank == 0) s.set_n(p.values.n);
  } else if (tp_writer && (part.sharded() || topo.dp_rank == 0)) {
    s.set_flat_begin(p.moments.offset - p.values.offset);
    s.set_n(p.moments.n);
  }
  return s;
}

}  // namespace

const char* tensor_kind_name(ckpt::TensorKind kind) {
  switch (kind) {
    case ckpt::PARAM:
      return "param";
    case ckpt::ADAM_M:
      return "adam_m";
    case ckpt::ADAM_V:
      return "adam_v";
    default:
      return "unknown";
  }
}

// ---- save ------------------------------------------------------------------------------------

namespace ckpt_save {

// This rank's slices in file order (see the header's "who writes what").
std::vector<PlannedSlice> plan_my_shard(const TrainState& state, const Topology& topo) {
  std::vector<PlannedSlice> plan;
  for (const StateParam& p : state.tensors()) {
    for (ckpt::TensorKind kind : kKinds) {
      ckpt::Slice s = my_slice(p, kind, topo, state.partition());
      if (s.n() > 0) plan.push_back({&p, kind, s});
    }
  }
  return plan;
}

// Copies one planned slice's elements out of the state (device-neutral copies) into `out`.
void copy_slice(const TrainState& state, const PlannedSlice& ps, float* out) {
  if (ps.kind == ckpt::PARAM) {
    state.read_values(*ps.p, out);
  } else if (ps.kind == ckpt::ADAM_M) {
    state.read_moments(*ps.p, out, nullptr);
  } else {
    state.read_moments(*ps.p, nullptr, out);
  }
}

// Writes this rank's shard and its index into `tmp`; `data(i)` gives slice i's elements (valid
// until the next call). Touches no MPI and no TrainState: the async writer runs it on its own
// thread. Throws kIo naming the file and the OS reason.
void write_shard(const std::vector<PlannedSlice>& plan, const std::vector<std::string>& names,
                 const std::function<const float*(size_t)>& data, int rank, int64_t step,
                 const std::string& tmp, const SaveHook& on_phase) {
  const std::string file = shard_name(rank);
  const std::string path = tmp + "/" + file;
  ckpt::Manifest index;
  int64_t offset = 0;
  int fd = -1;
  auto fail = [&](const char* what) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    KEEL_FAIL(kIo, path, ": ", what, ": ", std::strerror(err));
  };
  for (size_t i = 0; i < plan.size(); ++i) {
    ckpt::Slice s = plan[i].slice;
    if (fd < 0) {
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) fail("cannot create");
    }
    const float* src_f = data(i);
    const size_t bytes = static_cast<size_t>(s.n()) * sizeof(float);
    s.set_file(file);
    s.set_offset(offset);
    s.set_xxh3(XXH3_64bits(src_f, bytes));
    const char* src = reinterpret_cast<const char*>(src_f);
    for (size_t done = 0; done < bytes;) {
      const ssize_t w = ::write(fd, src + done, bytes - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = ENOSPC;
        fail("write failed");
      }
      done += static_cast<size_t>(w);
    }
    if (offset == 0 && on_phase) on_phase(SavePhase::kShardHalfWritten, step);
    offset += static_cast<int64_t>(bytes);
    ckpt::TensorRecord* rec = index.add_tensors();
    rec->set_name(names[i]);
    rec->set_kind(plan[i].kind);
    *rec->add_slices() = s;
  }
  if (fd >= 0) {
    if (fsync_until_done(fd) != 0) fail("fsync failed");
    if (close_after_write(fd) != 0) {
      fd = -1;
      fail("write failed");
    }
    ckpt::ShardFile* f = index.add_files();
    f->set_name(file);
    f->set_bytes(offset);
  }
  write_file_atomic(tmp + "/" + index_name(rank), index.SerializeAsString());
}

std::vector<std::string> names_of(const std::vector<PlannedSlice>& plan) {
  std::vector<std::string> names;
  for (const PlannedSlice& ps : plan) names.push_back(ps.p->info->spec.name);
  return names;
}

// Everything in the manifest but the slices and files, as of now: the run's counters and every
// tensor's record (registration order x kind).
ckpt::Manifest manifest_header(const TrainState& state, const config::KeelConfig& cfg,
                               const Topology& topo) {
  ckpt::Manifest m;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_step(state.step);
  m.set_tokens(state.step * static_cast<int64_t>(cfg.train().global_batch()) *
               cfg.model().seq_len());
  *m.mutable_config() = cfg;
  m.mutable_layout()->set_world(topo.world_size);
  m.mutable_layout()->set_tp(topo.tp);
  m.mutable_layout()->set_dp(topo.dp);
  m.mutable_layout()->set_zero_stage(state.partition().sharded() ? 1 : 0);
  m.set_next_sample(state.sampler.next_sample);
  m.set_train_fingerprint(state.train_fingerprint);
  m.set_val_fingerprint(state.val_fingerprint);
  m.set_adam_t(state.optimizer().t());
  for (const SkippedRange& r : state.guard.skipped) {
    ckpt::SkippedRange* s = m.add_skipped();
    s->set_first_sample(r.first_sample);
    s->set_n(r.n);
    s->set_step(r.step);
  }
  const GuardState& g = state.guard;
  ckpt::GuardRecord* gr = m.mutable_guard();
  for (double v : g.loss_history) gr->add_loss_history(v);
  for (double v : g.grad_history) gr->add_grad_history(v);
  gr->set_streak(g.streak);
  gr->set_streak_first(g.streak_first);
  gr->set_streak_first_sample(g.streak_first_sample);
  for (int64_t s : g.rewinds) gr->add_rewinds(s);
  gr->set_cooldown_from(g.cooldown_from);
  for (const StateParam& p : state.tensors()) {
    for (ckpt::TensorKind kind : kKinds) {
      ckpt::TensorRecord* rec = m.add_tensors();
      rec->set_name(p.info->spec.name);
      rec->set_kind(kind);
      rec->set_dtype("f32");
      for (int64_t d : p.info->spec.logical) rec->add_shape(d);
    }
  }
  return m;
}

// The checkpoint a commit of `step` descends from (Note [lineage]): the step LATEST
// names when that is older; for a re-save of LATEST's own step (a rewind's), the parent of the
// save it replaces; -1 otherwise.
int64_t parent_of(const CheckpointStore& store, int64_t step) {
  const std::optional<int64_t> latest = store.latest();
  if (latest && *latest < step) return *latest;
  if (latest && *latest == step) {
    try {
      const ckpt::Manifest replaced = read_manifest(store.path_of(step));
      if (replaced.has_parent_step()) return replaced.parent_step();
    } catch (const Error&) {
      // An unreadable earlier save of this step has no parent to pass on.
    }
  }
  return -1;
}

// Rank 0: merges every rank's index into the manifest and commits (Note [checkpoint commit]).
void commit(ckpt::Manifest m, int world_size, const config::Checkpoint& policy,
            const CheckpointStore& store, const std::string& tmp, const SaveHook& on_phase,
            const Pinned& pinned) {
  if (on_phase) on_phase(SavePhase::kBeforeManifest, m.step());
  std::map<std::pair<std::string, int>, ckpt::TensorRecord*> records;
  for (ckpt::TensorRecord& rec : *m.mutable_tensors()) records[{rec.name(), rec.kind()}] = &rec;
  for (int r = 0; r < world_size; ++r) {
    const std::string path = tmp + "/" + index_name(r);
    ckpt::Manifest index;
    KEEL_CHECK(index.ParseFromString(read_regular_file(path, kMaxManifestBytes, "a slice index")),
               kIo, path, ": cannot read this rank's slice index");
    for (const ckpt::TensorRecord& t : index.tensors()) {
      auto it = records.find({t.name(), t.kind()});
      KEEL_CHECK(it != records.end(), kInternal, path, ": unknown tensor ", t.name());
      for (const ckpt::Slice& s : t.slices()) *it->second->add_slices() = s;
    }
    for (const ckpt::ShardFile& f : index.files()) *m.add_files() = f;
    fs::remove(path);
  }
  m.set_parent_step(parent_of(store, m.step()));
  write_file_atomic(tmp + "/manifest.pb", serialize_manifest(m));
  fsync_path(tmp);
  const int64_t step = m.step();
  const std::string final_dir = store.path_of(step);
  // A re-save of a step that exists (after a rewind): move the old one aside first, so that a
  // crash at any point leaves a whole checkpoint under the name LATEST may give.
  const std::string old = final_dir + ".old";
  std::error_code ec;
  fs::remove_all(old, ec);
  const bool had_old = fs::exists(final_dir, ec);
  if (had_old) {
    KEEL_CHECK(::rename(final_dir.c_str(), old.c_str()) == 0, kIo, final_dir,
               ": cannot move the previous save of this step aside: ", std::strerror(errno));
  }
  KEEL_CHECK(::rename(tmp.c_str(), final_dir.c_str()) == 0, kIo, final_dir,
             ": cannot rename the finished checkpoint into place: ", std::strerror(errno));
  fsync_path(store.root());
  if (on_phase) on_phase(SavePhase::kBeforeLatest, step);
  store.set_latest(step);
  if (had_old) fs::remove_all(old, ec);
  store.retain(policy.keep(), policy.keep_every(), pinned);
}

// Every rank learns whether any rank failed; the ranks that did not fail throw a line naming
// the phase. `mine` is this rank's own error message (empty: none).
void agree(const Topology& topo, const std::string& mine, const char* phase, int64_t step) {
  double failed = mine.empty() ? 0.0 : 1.0;
  if (topo.world_comm) topo.world_comm->all_reduce(&failed, 1, ReduceOp::kMax);
  if (!mine.empty()) KEEL_FAIL(kIo, mine);
  KEEL_CHECK(failed == 0.0, kIo, "checkpoint of step ", step, ": another rank failed while ", phase,
             " (see its message)");
}

// Collective: rank 0 (re)creates `tmp` (and the store's root); every rank learns if it failed.
void make_tmp_dir(const Topology& topo, const CheckpointStore& store, const std::string& tmp,
                  int64_t step) {
  std::string err;
  if (topo.world_rank == 0) {
    try {
      std::error_code ec;
      fs::create_directories(store.root(), ec);
      KEEL_CHECK(!ec, kIo, store.root(), ": cannot create: ", ec.message());
      fs::remove_all(tmp, ec);
      fs::create_directory(tmp, ec);
      KEEL_CHECK(!ec, kIo, tmp, ": cannot create: ", ec.message());
    } catch (const Error& e) {
      err = e.what();
    }
  }
  agree(topo, err, "creating the directory", step);
}

// Collective: after every rank's shard (`err`: this rank's failure, empty if none), rank 0
// commits `header`; every rank learns the outcome. A failure removes `tmp` (rank 0).
void finish_save(const Topology& topo, const config::Checkpoint& policy,
                 const CheckpointStore& store, const std::string& tmp, ckpt::Manifest header,
                 std::string err, const SaveHook& on_phase, const Pinned& pinned) {
  const int64_t step = header.step();
  auto cleanup = [&] {
    std::error_code ec;
    if (topo.world_rank == 0) fs::remove_all(tmp, ec);
  };
  try {
    agree(topo, err, "writing the shards", step);
  } catch (const Error&) {
    cleanup();
    throw;
  }
  if (topo.world_rank == 0) {
    try {
      commit(std::move(header), topo.world_size, policy, store, tmp, on_phase, pinned);
    } catch (const Error& e) {
      err = e.what();
    }
  }
  try {
    agree(topo, err, "committing", step);
  } catch (const Error&) {
    cleanup();
    throw;
  }
}

}  // namespace ckpt_save

using namespace ckpt_save;

void save_checkpoint(const TrainState& state, const config::KeelConfig& cfg, const Topology& topo,
                     const CheckpointStore& store, const SaveHook& on_phase, const Pinned& pinned) {
  const std::string tmp = store.path_of(state.step) + ".tmp";
  make_tmp_dir(topo, store, tmp, state.step);
  const std::vector<PlannedSlice> plan = plan_my_shard(state, topo);
  // Host memory of the state's device (pinned on a GPU), grown to the largest slice.
  HostBuffer buf(state.params().params().device());
  std::string err;
  try {
    // Streams slice by slice through one buffer of the largest slice.
    write_shard(
        plan, names_of(plan),
        [&](size_t i) {
          float* out = buf.reserve(static_cast<size_t>(plan[i].slice.n()));
          copy_slice(state, plan[i], out);
          return static_cast<const float*>(out);
        },
        topo.world_rank, state.step, tmp, on_phase);
  } catch (const Error& e) {
    err = e.what();
  }
  finish_save(topo, cfg.checkpoint(), store, tmp, manifest_header(state, cfg, topo), err, on_phase,
              pinned);
}

}  // namespace keel
