// keel-bench --checkpoint (launch/train/checkpoint_bench.h): disk speed, save and load throughput,
// and the training time a synchronous or asynchronous save costs.
#include "launch/train/checkpoint_bench.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "checkpoints/checkpoint.h"
#include "framework/error.h"
#include "launch/train/trainer.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBlockBytes = size_t{4} << 20;  // the disk test's write() and read() size

void barrier(const Topology& topo) {
  if (topo.world_comm) topo.world_comm->barrier();
}

// Wall seconds of `fn` on the slowest rank: every rank starts it after a barrier and stops the
// clock after the barrier that follows it.
template <typename Fn>
double timed(const Topology& topo, Fn&& fn) {
  barrier(topo);
  const double t0 = omp_get_wtime();
  fn();
  barrier(topo);
  return omp_get_wtime() - t0;
}

double sum_over_ranks(const Topology& topo, double x) {
  if (topo.world_comm) topo.world_comm->all_reduce(&x, 1, ReduceOp::kSum);
  return x;
}

// Median and range of a measurement's rounds.
struct Spread {
  double median = 0.0, min = 0.0, max = 0.0;
};

Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return {n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.front(), v.back()};
}

// printf to a std::string.
[[gnu::format(printf, 1, 2)]] std::string format(const char* fmt, ...) {
  va_list args, again;
  va_start(args, fmt);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  std::vsnprintf(out.data(), out.size() + 1, fmt, again);
  va_end(again);
  return out;
}

// "key=median key_min=min key_max=max".
std::string spread_fields(const char* key, const Spread& s) {
  return format(" %s=%.6g %s_min=%.6g %s_max=%.6g", key, s.median, key, s.min, key, s.max);
}

// A fresh directory parent/keel-bench-ckpt.XXXXXX made by rank 0 and named to every rank (the
// ranks share a file system, as checkpoints need); rank 0 removes it with all it holds.
class ScratchDir {
 public:
  ScratchDir(const std::string& parent, const Topology& topo) : topo_(topo) {
    std::string made, error;
    if (topo.world_rank == 0) {
      const char* tmpdir = std::getenv("TMPDIR");
      const std::string base =
          !parent.empty() ? parent : (tmpdir != nullptr && *tmpdir != 0 ? tmpdir : "/tmp");
      std::string tmpl = base + "/keel-bench-ckpt.XXXXXX";
      if (::mkdtemp(tmpl.data()) != nullptr) {
        std::error_code ec;
        const fs::path absolute = fs::absolute(tmpl, ec);
        made = ec ? tmpl : absolute.string();
      } else {
        error = base + ": cannot create a scratch directory in it: " + std::strerror(errno);
      }
    }
    path_ = broadcast_from_root(made);
    if (topo.world_rank == 0) KEEL_CHECK(error.empty(), kIo, error);
    KEEL_CHECK(!path_.empty(), kIo,
               "rank 0 could not create the scratch directory (see its message)");
  }
  ~ScratchDir() {
    if (topo_.world_rank != 0 || path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  // Rank 0's `s` on every rank, sent as floats (a byte value and the length are exact in one).
  std::string broadcast_from_root(const std::string& s) const {
    if (topo_.world_comm == nullptr || topo_.world_size == 1) return s;
    float n = static_cast<float>(s.size());
    topo_.world_comm->broadcast(&n, 1, 0);
    std::vector<float> chars(static_cast<size_t>(n));
    for (size_t i = 0; i < s.size() && topo_.world_rank == 0; ++i) {
      chars[i] = static_cast<unsigned char>(s[i]);
    }
    topo_.world_comm->broadcast(chars.data(), static_cast<int64_t>(chars.size()), 0);
    std::string out;
    for (float c : chars) out += static_cast<char>(static_cast<unsigned char>(c));
    return out;
  }

  const Topology& topo_;
  std::string path_;
};

// Writes `bytes` bytes to `path` the way the checkpoint writer writes a shard: buffered write()s
// (here of `block`, repeated), then one fsync, then close. Throws kIo.
void write_and_fsync(const std::string& path, int64_t bytes, const std::vector<char>& block) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  KEEL_CHECK(fd >= 0, kIo, path, ": cannot create: ", std::strerror(errno));
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    KEEL_FAIL(kIo, path, ": ", what, ": ", std::strerror(err));
  };
  for (int64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(block.size(), bytes - done));
    const ssize_t w = ::write(fd, block.data(), n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("write failed", w == 0 ? ENOSPC : errno);
    done += w;
  }
  if (::fsync(fd) != 0) fail("fsync failed", errno);
  KEEL_CHECK(::close(fd) == 0, kIo, path, ": write failed: ", std::strerror(errno));
}

// Reads `path` whole in block-sized read()s; returns the bytes read. Throws kIo.
int64_t read_whole_file(const std::string& path, std::vector<char>& block) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KEEL_CHECK(fd >= 0, kIo, path, ": cannot open: ", std::strerror(errno));
  int64_t total = 0;
  while (true) {
    const ssize_t r = ::read(fd, block.data(), block.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      ::close(fd);
      KEEL_FAIL(kIo, path, ": read failed: ", std::strerror(err));
    }
    if (r == 0) break;
    total += r;
  }
  ::close(fd);
  return total;
}

// Pages of a file: how many stay in the page cache, of how many.
struct Residency {
  double resident = 0.0, pages = 0.0;
};

// Asks the kernel to drop `path`'s pages from the page cache (posix_fadvise DONTNEED drops clean
// pages, and an fsynced file's are clean; no root needed, unlike drop_caches) and counts with
// mincore the pages still resident afterwards (all of them when mincore cannot tell).
Residency drop_from_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KEEL_CHECK(fd >= 0, kIo, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const auto size = static_cast<size_t>(st.st_size);
  Residency r;
  r.pages = static_cast<double>((st.st_size + page - 1) / page);
  r.resident = r.pages;
  if (size > 0) {
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);  // mincore needs a mapping
    if (map != MAP_FAILED) {
      std::vector<unsigned char> in_core(static_cast<size_t>(r.pages));
      if (::mincore(map, size, in_core.data()) == 0) {
        r.resident = static_cast<double>(
            std::count_if(in_core.begin(), in_core.end(), [](unsigned char c) { return c & 1; }));
      }
      ::munmap(map, size);
    }
  }
  ::close(fd);
  return r;
}

// drop_from_page_cache on every regular file under `dir`.
Residency drop_tree_from_page_cache(const std::string& dir) {
  Residency total;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const Residency r = drop_from_page_cache(e.path().string());
    total.resident += r.resident;
    total.pages += r.pages;
  }
  return total;
}

double resident_fraction(const Residency& r) { return r.pages > 0 ? r.resident / r.pages : 0.0; }

// The checkpoint's size: every shard file's bytes, and this rank's own.
struct CheckpointBytes {
  int64_t total = 0, mine = 0;
  int files = 0;
};

CheckpointBytes checkpoint_bytes(const std::string& dir, int world_rank) {
  const ckpt::Manifest m = read_manifest(dir);
  const std::string mine = format("shard_%05d.bin", world_rank);  // Note [checkpoint commit]
  CheckpointBytes b;
  for (const ckpt::ShardFile& f : m.files()) {
    b.total += f.bytes();
    if (f.name() == mine) b.mine = f.bytes();
    ++b.files;
  }
  return b;
}

// One round of the disk, save and load measurements, in seconds.
struct IoRound {
  double write_s = 0.0, read_cached_s = 0.0, read_dropped_s = 0.0;
  double save_s = 0.0, load_cached_s = 0.0, load_dropped_s = 0.0;
  double disk_resident = 0.0, load_resident = 0.0;  // page fractions left after the drops
};

// The disk and checkpoint halves of a round take turns at going first: the first write of a
// round may meet the previous round's writes still being flushed, and neither half should be the
// one that always does.
IoRound io_round(int round, Trainer& trainer, const config::KeelConfig& cfg, const Topology& topo,
                 const ScratchDir& scratch, const CheckpointBytes& bytes,
                 std::vector<char>& block) {
  IoRound r;
  const bool root = topo.world_rank == 0;
  // The disk: this rank's shard's bytes in a file of its own, all ranks at once.
  auto disk = [&] {
    const std::string file = scratch.file(format("disk_%05d.bin", topo.world_rank));
    const bool writes = bytes.mine > 0;  // a rank may own no slice (plain DP: DP rank 0 writes)
    r.write_s = timed(topo, [&] {
      if (writes) write_and_fsync(file, bytes.mine, block);
    });
    r.read_cached_s = timed(topo, [&] {
      if (writes) read_whole_file(file, block);
    });
    Residency left;
    if (writes) left = drop_from_page_cache(file);
    r.disk_resident =
        resident_fraction({sum_over_ranks(topo, left.resident), sum_over_ranks(topo, left.pages)});
    r.read_dropped_s = timed(topo, [&] {
      if (writes) read_whole_file(file, block);
    });
    if (writes) fs::remove(file);
  };
  // The checkpoint: saved into a store of its own (no retention work, no earlier step to move
  // aside), loaded back from the page cache, then again after every rank dropped its files.
  auto checkpoint = [&] {
    const CheckpointStore store(scratch.file(format("save_%d", round)));
    TrainState& state = trainer.state();
    r.save_s = timed(topo, [&] { save_checkpoint(state, cfg, topo, store); });
    const std::string dir = store.path_of(state.step);
    r.load_cached_s = timed(topo, [&] { load_checkpoint(dir, state); });
    const Residency left = drop_tree_from_page_cache(dir);  // rank 0's count is reported
    r.load_resident = resident_fraction(left);
    r.load_dropped_s = timed(topo, [&] { load_checkpoint(dir, state); });
    barrier(topo);
    if (root) fs::remove_all(store.root());
  };
  if (round % 2 == 0) {
    disk();
    checkpoint();
  } else {
    checkpoint();
    disk();
  }
  return r;
}

enum class SaveMode { kNone, kSync, kAsync };

const char* save_mode_name(SaveMode mode) {
  switch (mode) {
    case SaveMode::kNone:
      return "none";
    case SaveMode::kSync:
      return "sync";
    case SaveMode::kAsync:
      return "async";
  }
  return "?";
}

// One trainer of the cost measurement, saving in its mode.
struct CostArm {
  SaveMode mode = SaveMode::kNone;
  std::unique_ptr<Trainer> trainer;
};

// A trainer in `run_dir` whose saves are `mode`'s, after `warmup` untimed steps.
CostArm make_arm(const config::KeelConfig& cfg, const Topology& topo, SaveMode mode, int every,
                 int warmup, int rounds, const std::string& run_dir) {
  config::KeelConfig c = cfg;
  c.mutable_checkpoint()->set_every(mode == SaveMode::kNone ? 0 : every);
  c.mutable_checkpoint()->set_async(mode == SaveMode::kAsync);
  c.mutable_train()->set_steps(warmup + rounds * every);  // the learning-rate schedule's length
  TrainerOptions opts;
  opts.run_dir = run_dir;  // every arm has one, so that the arms differ in their saves only
  opts.progress = false;
  CostArm arm{mode, std::make_unique<Trainer>(c, topo, opts)};
  for (int i = 0; i < warmup; ++i) arm.trainer->step();
  return arm;
}

struct Window {
  double seconds = 0.0;   // the whole window
  double finish_s = 0.0;  // its final finish_checkpoint (an async save's exposed wait)
};

// One save interval of a long run that saves every `every` steps: the save (none in kNone),
// `every` steps, then finish_checkpoint. An async save's write overlaps those steps, and what it
// has not written by their end is waited for and committed here, as the next save of a long run
// would (Trainer::run() may commit a step earlier, once every rank's write is done: the same
// work, moved).
Window time_window(CostArm& arm, int every, const Topology& topo) {
  Trainer& t = *arm.trainer;
  Window w;
  w.seconds = timed(topo, [&] {
    if (arm.mode != SaveMode::kNone) t.save_checkpoint();
    for (int i = 0; i < every; ++i) t.step();
    const double t0 = omp_get_wtime();
    t.finish_checkpoint();
    w.finish_s = omp_get_wtime() - t0;
  });
  // finish_checkpoint agreed on it over every rank, and the rank that failed said why.
  KEEL_CHECK(!t.failed_checkpoint(), kIo, "the ", save_mode_name(arm.mode),
             " checkpoint save of step ", t.failed_checkpoint().value_or(0), " failed (see above)");
  return w;
}

}  // namespace

std::vector<std::string> run_checkpoint_bench(const std::string& name,
                                              const config::KeelConfig& cfg, const Topology& topo,
                                              const CheckpointBenchOptions& opts) {
  KEEL_CHECK(opts.rounds >= 1, kUsage, "--rounds must be at least 1");
  const int every = cfg.checkpoint().every();
  KEEL_CHECK(every >= 1, kUsage,
             "--checkpoint saves every checkpoint.every steps: it must be >= 1");
  const bool root = topo.world_rank == 0;
  auto say = [&](const std::string& line) {
    if (!root) return;
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  ScratchDir scratch(opts.parent_dir, topo);

  // The three cost arms' trainers, each after its warmup steps (at least one: AdamW's moments
  // are then written everywhere, as in a real run; an untouched arena would be read from the
  // kernel's shared zero page, faster than from memory). The one without saves also holds the
  // state that the disk, save and load measurements save and load.
  const int warmup = std::max(1, opts.warmup);
  std::vector<CostArm> arms;
  for (SaveMode mode : {SaveMode::kNone, SaveMode::kSync, SaveMode::kAsync}) {
    arms.push_back(make_arm(cfg, topo, mode, every, warmup, opts.rounds,
                            scratch.file(format("run_%s", save_mode_name(mode)))));
  }
  Trainer& io_trainer = *arms[0].trainer;
  config::KeelConfig io_cfg = cfg;
  io_cfg.mutable_checkpoint()->set_every(0);
  io_cfg.mutable_checkpoint()->set_async(false);
  int64_t params = 0;
  for (const StateParam& p : io_trainer.state().tensors()) {
    params += shape_numel(p.info->spec.logical);
  }
  // An untimed save first: it tells every rank its shard's size, and warms the code paths.
  CheckpointBytes bytes;
  {
    const CheckpointStore store(scratch.file("first"));
    save_checkpoint(io_trainer.state(), io_cfg, topo, store);
    barrier(topo);
    bytes = checkpoint_bytes(store.path_of(io_trainer.state().step), topo.world_rank);
    barrier(topo);
    if (root) fs::remove_all(store.root());
  }
  const auto gb = static_cast<double>(bytes.total) / 1e9;
  say(
      format("checkpoint %s: %lld parameters, %lld bytes per checkpoint (parameters + AdamW m + "
             "v, fp32) in %d shard file(s) from %d rank(s); scratch directory %s",
             name.c_str(), static_cast<long long>(params), static_cast<long long>(bytes.total),
             bytes.files, topo.world_size, scratch.path().c_str()));

  std::vector<char> block(kBlockBytes);
  for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<char>(i * 131 + 7);
  // The disk, save and load rounds first, then the cost rounds. (Interleaving the two let each
  // round's first write meet the cost windows' checkpoints still being flushed: on the VM this
  // was written on, that write ran at 0.25 GB/s instead of 1-1.5.)
  std::vector<IoRound> io;
  for (int round = 0; round < opts.rounds; ++round) {
    const IoRound& r =
        io.emplace_back(io_round(round, io_trainer, io_cfg, topo, scratch, bytes, block));
    say(
        format("  round %d: disk write %.3f GB/s, read %.3f GB/s (page cache) / %.3f GB/s "
               "(dropped); save %.3f s = %.3f GB/s; load %.3f GB/s (page cache) / %.3f GB/s "
               "(dropped)",
               round + 1, gb / r.write_s, gb / r.read_cached_s, gb / r.read_dropped_s, r.save_s,
               gb / r.save_s, gb / r.load_cached_s, gb / r.load_dropped_s));
  }
  // Each cost round times one save interval of every arm, starting with a different arm each
  // round, so that the three windows compared lie seconds apart.
  std::vector<double> step_s, sync_cost, async_cost, sync_frac, async_frac, async_wait;
  for (int round = 0; round < opts.rounds; ++round) {
    std::array<Window, 3> w;
    for (size_t i = 0; i < arms.size(); ++i) {
      const size_t a = (static_cast<size_t>(round) + i) % arms.size();
      w[a] = time_window(arms[a], every, topo);
    }
    const double step = w[0].seconds / every;
    step_s.push_back(step);
    sync_cost.push_back(w[1].seconds - w[0].seconds);
    async_cost.push_back(w[2].seconds - w[0].seconds);
    sync_frac.push_back(sync_cost.back() / step);
    async_frac.push_back(async_cost.back() / step);
    async_wait.push_back(w[2].finish_s);
    say(
        format("  round %d: %.4f s/step without saves; per save: sync %.4f s = %.3f steps, async "
               "%.4f s = %.3f steps (of which %.4f s waiting for its write at the end)",
               round + 1, step, sync_cost.back(), sync_frac.back(), async_cost.back(),
               async_frac.back(), async_wait.back()));
  }
  arms.clear();  // joins any writer thread before the scratch directory goes
  barrier(topo);
  if (!root) return {};

  const std::string head =
      format("config=%s ranks=%d tp=%d dp=%d params=%lld bytes=%lld rounds=%d", name.c_str(),
             topo.world_size, topo.tp, topo.dp, static_cast<long long>(params),
             static_cast<long long>(bytes.total), opts.rounds);
  auto rates = [&](double IoRound::*seconds) {
    std::vector<double> v;
    for (const IoRound& r : io) v.push_back(gb / (r.*seconds));
    return v;
  };
  auto values = [&](double IoRound::*of) {
    std::vector<double> v;
    for (const IoRound& r : io) v.push_back(r.*of);
    return v;
  };
  std::vector<std::string> lines;
  lines.push_back("ckpt=disk " + head + " method=write_4MiB_fsync" +
                  spread_fields("write_gbps", spread(rates(&IoRound::write_s))) +
                  spread_fields("read_cached_gbps", spread(rates(&IoRound::read_cached_s))) +
                  spread_fields("read_dropped_gbps", spread(rates(&IoRound::read_dropped_s))) +
                  format(" dropped_resident=%.4f", spread(values(&IoRound::disk_resident)).max));
  // The medians' ratio: the disk's speed swings from round to round on its own (a shared or
  // throttled device), so one round's two figures are no better matched than the medians.
  const Spread save_rate = spread(rates(&IoRound::save_s));
  lines.push_back(
      "ckpt=save " + head + format(" save_s=%.6g", spread(values(&IoRound::save_s)).median) +
      spread_fields("save_gbps", save_rate) +
      format(" disk_fraction=%.6g", save_rate.median / spread(rates(&IoRound::write_s)).median));
  lines.push_back("ckpt=load " + head +
                  spread_fields("load_cached_gbps", spread(rates(&IoRound::load_cached_s))) +
                  spread_fields("load_dropped_gbps", spread(rates(&IoRound::load_dropped_s))) +
                  format(" dropped_resident=%.4f", spread(values(&IoRound::load_resident)).max));
  const std::string interval = format(" every=%d step_s=%.6g", every, spread(step_s).median);
  lines.push_back("ckpt=sync_cost " + head + interval +
                  format(" save_cost_s=%.6g", spread(sync_cost).median) +
                  spread_fields("step_fraction", spread(sync_frac)));
  lines.push_back("ckpt=async_cost " + head + interval +
                  format(" save_cost_s=%.6g", spread(async_cost).median) +
                  spread_fields("step_fraction", spread(async_frac)) +
                  format(" write_wait_s=%.6g", spread(async_wait).median));
  return lines;
}

}  // namespace keel
