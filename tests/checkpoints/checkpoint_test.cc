// Checkpoints (Note [checkpoint commit]): the store's names, listing, LATEST and retention; a
// bit-exact save/load round trip of the whole run state with the manifest it writes; every kind
// of damage named by file, tensor and reason; changed shapes and missing tensors refused; loads at
// other layouts (TP blocks and ZeRO-1 slices, saved by simulated ranks on threads); and a failed
// save that leaves the previous checkpoint and LATEST as they were.
#include "checkpoints/checkpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <xxhash.h>

#include <algorithm>
#include <barrier>
#include <bit>
#include <csignal>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "framework/config/config.h"
#include "tests/test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

constexpr ckpt::TensorKind kKinds[] = {ckpt::PARAM, ckpt::ADAM_M, ckpt::ADAM_V};

// ---- helpers -----------------------------------------------------------------------------------

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Writes `m` as manifest.pb with a valid checksum, so a forged field reaches the check it aims at.
void write_manifest(const std::string& dir, const ckpt::Manifest& m) {
  write_file(dir + "/manifest.pb", serialize_manifest(m));
}

// The sorted names in `dir`.
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Element `logical` of tensor kind `kind` (0 values, 1 m, 2 v) of parameter `param`: distinct per
// parameter and kind, exactly representable, never the zero a fresh state holds everywhere.
float pattern(int param, int kind, int64_t logical, int salt = 0) {
  const int64_t s = param * 3 + kind + 1 + salt * 101;
  const int64_t k = (s * 1000003 + logical * 7919 + s * s * 31) % 100003;
  return static_cast<float>(k - 50001) / 64.0f + (k == 50001 ? 0.5f : 0.0f);
}

// Parameters of several shapes: TP-sharded on dim 0 and dim 1, replicated, and one element.
std::vector<ParamSpec> base_specs() {
  return {
      {.name = "wte", .logical = {10, 8}, .shard_dim = 0, .decay = true},
      {.name = "ln.g", .logical = {8}, .init = ParamInit::kConstant, .value = 1.0f},
      {.name = "fc", .logical = {8, 12}, .shard_dim = 1, .decay = true},
      {.name = "one", .logical = {1}, .init = ParamInit::kConstant},
      {.name = "w", .logical = {4, 6}, .shard_dim = 0, .decay = true},
  };
}

struct LayoutSpec {
  int tp = 1, tp_rank = 0, dp = 1, dp_rank = 0;
  bool zero = false;
};

// One rank's state without a model (as in train_state_test.cc), zero-filled.
struct Rank {
  ParamStore ps;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<TrainState> state;
  Topology topo;
};

std::unique_ptr<Rank> make_rank(const std::vector<ParamSpec>& specs, const LayoutSpec& l = {}) {
  auto r = std::make_unique<Rank>();
  for (const ParamSpec& s : specs) r->ps.add(s);
  r->ps.allocate(l.tp_rank, l.tp, l.dp);
  const ZeroPartition part(r->ps.total_elems(), l.dp, l.dp_rank, l.zero);
  std::vector<ParamSegment> segs;
  for (int id = 0; id < r->ps.size(); ++id) {
    const ArenaSlice own = part.clip(r->ps.info(id).offset, r->ps.info(id).numel());
    if (!own.empty()) segs.push_back({own.offset - part.mine().offset, own.n, false});
  }
  r->opt = std::make_unique<AdamW>(default_config().optim(), part.mine().n, segs);
  r->state = std::make_unique<TrainState>(r->ps, *r->opt, part);
  r->topo.world_size = l.tp * l.dp;
  r->topo.world_rank = l.dp_rank * l.tp + l.tp_rank;  // TP groups are consecutive ranks
  r->topo.tp = l.tp;
  r->topo.tp_rank = l.tp_rank;
  r->topo.dp = l.dp;
  r->topo.dp_rank = l.dp_rank;
  return r;
}

// Logical index of each of this rank's elements of `p` (values), and of its moments.
std::vector<int64_t> logical_of(const Rank& r, const StateParam& p) {
  std::vector<int64_t> out(static_cast<size_t>(p.values.n));
  for (int64_t j = 0; j < p.values.n; ++j) out[j] = r.ps.logical_index(p.id, j);
  return out;
}

// Fills values, m and v of this rank's slices with pattern(.., logical index, salt).
void fill(const Rank& r, int salt = 0) {
  for (const StateParam& p : r.state->tensors()) {
    const std::vector<int64_t> logical = logical_of(r, p);
    std::vector<float> values(p.values.n), m(p.moments.n), v(p.moments.n);
    for (int64_t j = 0; j < p.values.n; ++j) values[j] = pattern(p.id, 0, logical[j], salt);
    const int64_t first = p.moments.offset - p.values.offset;
    for (int64_t k = 0; k < p.moments.n; ++k) {
      m[k] = pattern(p.id, 1, logical[first + k], salt);
      v[k] = pattern(p.id, 2, logical[first + k], salt);
    }
    r.state->write_values(p, values.data());
    r.state->write_moments(p, m.data(), v.data());
  }
}

// How many of this rank's values and moments differ (bit for bit) from pattern(.., salt); with
// `report`, adds a failure naming the first few.
int64_t mismatches(const Rank& r, int salt = 0, bool report = true) {
  int64_t bad = 0;
  auto check = [&](const StateParam& p, const char* what, int kind, int64_t j, float got) {
    const float want = pattern(p.id, kind, r.ps.logical_index(p.id, j), salt);
    if (std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want)) return;
    if (++bad <= 5 && report) {
      ADD_FAILURE() << p.info->spec.name << " " << what << " local " << j << ": " << got
                    << ", want " << want;
    }
  };
  for (const StateParam& p : r.state->tensors()) {
    std::vector<float> values(p.values.n), m(p.moments.n), v(p.moments.n);
    r.state->read_values(p, values.data());
    r.state->read_moments(p, m.data(), v.data());
    const int64_t first = p.moments.offset - p.values.offset;
    for (int64_t j = 0; j < p.values.n; ++j) check(p, "value", 0, j, values[j]);
    for (int64_t k = 0; k < p.moments.n; ++k) {
      check(p, "m", 1, first + k, m[k]);
      check(p, "v", 2, first + k, v[k]);
    }
  }
  return bad;
}

config::KeelConfig test_config(int keep = 3) {
  config::KeelConfig cfg = default_config();
  cfg.mutable_checkpoint()->set_keep(keep);
  cfg.mutable_checkpoint()->set_keep_every(0);
  return cfg;
}

void set_run_state(TrainState& st) {
  st.step = 12;
  st.sampler.next_sample = 96;
  st.optimizer().set_t(7);
  st.guard.skipped = {{40, 8, 5}, {72, 16, 9}};
  st.train_fingerprint = 0x1122334455667788ull;
  st.val_fingerprint = 0x99aabbccddeeff00ull;
}

const ckpt::TensorRecord* find_record(const ckpt::Manifest& m, const std::string& name,
                                      ckpt::TensorKind kind) {
  for (const ckpt::TensorRecord& t : m.tensors()) {
    if (t.name() == name && t.kind() == kind) return &t;
  }
  return nullptr;
}

// A saved checkpoint of base_specs() at step 12 (single process) in a temporary run directory.
struct Saved {
  TempDir td{"keel_ckpt"};
  CheckpointStore store{td.path() + "/checkpoints"};
  std::string dir = store.path_of(12);
  std::string shard = dir + "/shard_00000.bin";
  config::KeelConfig cfg = test_config();
  std::unique_ptr<Rank> rank = make_rank(base_specs());
  Saved() {
    fill(*rank);
    set_run_state(*rank->state);
    std::unique_ptr<Communicator> tp, dp;
    save_checkpoint(*rank->state, cfg, Topology::single(tp, dp), store);
  }
};

// ---- save and load -----------------------------------------------------------------------------

TEST(Checkpoint, RoundTripRestoresEveryBitOfTheRunState) {
  const Saved saved;
  const CheckpointStore& store = saved.store;
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{12}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(12));
  EXPECT_EQ(read_file(store.root() + "/LATEST"), "step_00000012\n");
  EXPECT_EQ(entries(store.root()), (std::vector<std::string>{"LATEST", "step_00000012"}));
  EXPECT_EQ(entries(saved.dir), (std::vector<std::string>{"manifest.pb", "shard_00000.bin"}));
  verify_checkpoint(saved.dir);

  const auto fresh = make_rank(base_specs());
  TrainState& st = *fresh->state;
  st.train_fingerprint = 0xf00d;
  st.val_fingerprint = 0xbeef;
  int64_t elements = 0;
  for (const StateParam& p : st.tensors()) elements += 3 * p.values.n;
  EXPECT_EQ(elements, 3 * (80 + 8 + 96 + 1 + 24));
  EXPECT_EQ(mismatches(*fresh, 0, /*report=*/false), elements);  // all zeros before the load
  const ckpt::Manifest m = load_checkpoint(saved.dir, st);
  EXPECT_EQ(mismatches(*fresh), 0);
  EXPECT_EQ(st.step, 12);
  EXPECT_EQ(st.sampler.next_sample, 96u);
  EXPECT_EQ(st.optimizer().t(), 7);
  EXPECT_EQ(st.guard.skipped, (std::vector<SkippedRange>{{40, 8, 5}, {72, 16, 9}}));
  EXPECT_EQ(st.train_fingerprint, 0xf00du);  // the data this run opened, not the checkpoint's
  EXPECT_EQ(st.val_fingerprint, 0xbeefu);
  EXPECT_EQ(m.step(), 12);

  // Loading again over a changed state puts every field back.
  fill(*fresh, /*salt=*/1);
  st.step = 99;
  st.sampler.next_sample = 5;
  st.optimizer().set_t(1);
  st.guard.skipped = {{1, 1, 1}, {2, 2, 2}, {3, 3, 3}};
  load_checkpoint(saved.dir, st);
  EXPECT_EQ(mismatches(*fresh), 0);
  EXPECT_EQ(st.step, 12);
  EXPECT_EQ(st.sampler.next_sample, 96u);
  EXPECT_EQ(st.optimizer().t(), 7);
  EXPECT_EQ(st.guard.skipped, (std::vector<SkippedRange>{{40, 8, 5}, {72, 16, 9}}));
}

TEST(Checkpoint, ManifestDescribesEveryTensorAndTheRunState) {
  const Saved saved;
  const ckpt::Manifest m = read_manifest(saved.dir);
  EXPECT_EQ(m.format_version(), kCheckpointFormatVersion);
  EXPECT_EQ(m.step(), 12);
  EXPECT_EQ(m.tokens(), 12 * static_cast<int64_t>(saved.cfg.train().global_batch()) *
                            saved.cfg.model().seq_len());
  EXPECT_EQ(m.config().SerializeAsString(), saved.cfg.SerializeAsString());
  EXPECT_EQ(m.layout().world(), 1);
  EXPECT_EQ(m.layout().tp(), 1);
  EXPECT_EQ(m.layout().dp(), 1);
  EXPECT_EQ(m.layout().zero_stage(), 0);
  EXPECT_EQ(m.next_sample(), 96u);
  EXPECT_EQ(m.train_fingerprint(), 0x1122334455667788ull);
  EXPECT_EQ(m.val_fingerprint(), 0x99aabbccddeeff00ull);
  EXPECT_EQ(m.adam_t(), 7);
  ASSERT_EQ(m.skipped_size(), 2);
  EXPECT_EQ(m.skipped(0).first_sample(), 40u);
  EXPECT_EQ(m.skipped(0).n(), 8u);
  EXPECT_EQ(m.skipped(0).step(), 5);
  EXPECT_EQ(m.skipped(1).first_sample(), 72u);
  EXPECT_EQ(m.skipped(1).n(), 16u);
  EXPECT_EQ(m.skipped(1).step(), 9);

  // Registration order x {param, adam_m, adam_v}, each one slice of the whole tensor, packed
  // back to back in the one shard, with the XXH3 of exactly the saved numbers.
  const std::vector<ParamSpec> specs = base_specs();
  ASSERT_EQ(m.tensors_size(), 3 * static_cast<int>(specs.size()));
  int64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t numel = shape_numel(specs[i].logical);
    for (int k = 0; k < 3; ++k) {
      const ckpt::TensorRecord& t = m.tensors(static_cast<int>(3 * i + k));
      SCOPED_TRACE(specs[i].name + " " + tensor_kind_name(kKinds[k]));
      EXPECT_EQ(t.name(), specs[i].name);
      EXPECT_EQ(t.kind(), kKinds[k]);
      EXPECT_EQ(Shape(t.shape().begin(), t.shape().end()), specs[i].logical);
      EXPECT_EQ(t.dtype(), "f32");
      ASSERT_EQ(t.slices_size(), 1);
      const ckpt::Slice& s = t.slices(0);
      EXPECT_EQ(s.n(), numel);  // coverage: the whole tensor
      EXPECT_EQ(s.shard_dim(), -1);
      EXPECT_EQ(s.shard_len(), 0);
      EXPECT_EQ(s.flat_begin(), 0);
      EXPECT_EQ(s.file(), "shard_00000.bin");
      EXPECT_EQ(s.offset(), offset);
      std::vector<float> want(static_cast<size_t>(numel));
      for (int64_t j = 0; j < numel; ++j) want[j] = pattern(static_cast<int>(i), k, j);
      EXPECT_EQ(s.xxh3(), XXH3_64bits(want.data(), want.size() * sizeof(float)));
      offset += numel * static_cast<int64_t>(sizeof(float));
    }
  }
  ASSERT_EQ(m.files_size(), 1);
  EXPECT_EQ(m.files(0).name(), "shard_00000.bin");
  EXPECT_EQ(m.files(0).bytes(), offset);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(saved.shard)), offset);
  EXPECT_STREQ(tensor_kind_name(ckpt::PARAM), "param");
  EXPECT_STREQ(tensor_kind_name(ckpt::ADAM_M), "adam_m");
  EXPECT_STREQ(tensor_kind_name(ckpt::ADAM_V), "adam_v");
}

TEST(Checkpoint, SavesAreRetainedAndASameStepSaveReplacesTheOld) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  const config::KeelConfig cfg = test_config(/*keep=*/2);
  const auto r = make_rank(base_specs());
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  for (int64_t step : {1, 2, 3}) {
    fill(*r, static_cast<int>(step));
    r->state->step = step;
    save_checkpoint(*r->state, cfg, topo, store);
  }
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{3, 2}));  // keep = 2
  EXPECT_EQ(store.latest(), std::optional<int64_t>(3));
  const auto back = make_rank(base_specs());
  load_checkpoint(store.path_of(2), *back->state);
  EXPECT_EQ(mismatches(*back, 2), 0);
  EXPECT_EQ(back->state->step, 2);

  fill(*r, 7);  // step 3 again, other numbers
  save_checkpoint(*r->state, cfg, topo, store);
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(entries(store.root()),
            (std::vector<std::string>{"LATEST", "step_00000002", "step_00000003"}));
  load_checkpoint(store.path_of(3), *back->state);
  EXPECT_EQ(mismatches(*back, 7), 0);
  EXPECT_EQ(back->state->step, 3);
}

TEST(Checkpoint, ACommitRecordsItsParentAndAnInterruptedOneStaysOnTheLineage) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  const config::KeelConfig cfg = test_config(/*keep=*/10);
  const auto r = make_rank(base_specs());
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  auto save = [&](int64_t step, const SaveHook& hook = {}) {
    r->state->step = step;
    save_checkpoint(*r->state, cfg, topo, store, hook);
  };
  auto parent = [&](int64_t step) { return read_manifest(store.path_of(step)).parent_step(); };
  save(1);
  save(2);
  EXPECT_EQ(parent(1), -1);  // the first of the run
  EXPECT_EQ(parent(2), 1);
  save(2);  // a re-save (a rewind's) keeps the parent of the save it replaces
  EXPECT_EQ(parent(2), 1);
  // A crash between the rename into place and LATEST's update: step 3 is whole, LATEST says 2.
  const SaveHook crash = [](SavePhase phase, int64_t) {
    if (phase == SavePhase::kBeforeLatest) KEEL_FAIL(kIo, "killed before LATEST");
  };
  EXPECT_EQ(error_of(ErrorKind::kIo, [&] { save(3, crash); }), "killed before LATEST");
  EXPECT_EQ(store.latest(), std::optional<int64_t>(2));
  EXPECT_EQ(parent(3), 2);
  EXPECT_EQ(store.lineage(), (std::vector<int64_t>{3, 2, 1}));
  verify_checkpoint(store.path_of(3));
  // --resume-from 1 starts a new lineage: 2 and 3 go, and the next commit descends from 1.
  EXPECT_EQ(store.remove_newer_than(1), (std::vector<int64_t>{3, 2}));
  save(4);
  EXPECT_EQ(parent(4), 1);
  EXPECT_EQ(store.lineage(), (std::vector<int64_t>{4, 1}));
}

// ---- damage is named
// -----------------------------------------------------------------------------

TEST(Checkpoint, AFlippedByteIsAChecksumMismatchNamingFileAndTensor) {
  const Saved saved;
  const ckpt::Manifest m = read_manifest(saved.dir);
  const ckpt::TensorRecord* fc_v = find_record(m, "fc", ckpt::ADAM_V);
  ASSERT_NE(fc_v, nullptr);
  const int64_t at = fc_v->slices(0).offset();
  std::string bytes = read_file(saved.shard);
  bytes[static_cast<size_t>(at + 4 * 17 + 2)] ^= 0x10;
  write_file(saved.shard, bytes);

  const std::string want = saved.shard + ": tensor fc (adam_v) at byte " + std::to_string(at) +
                           ": checksum mismatch (the file is corrupt)";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
  EXPECT_EQ(fresh->state->step, 0);  // the run state is only set once every tensor has loaded
}

TEST(Checkpoint, ATruncatedShardNamesTheByteCounts) {
  const Saved saved;
  const auto size = static_cast<int64_t>(fs::file_size(saved.shard));
  fs::resize_file(saved.shard, static_cast<uintmax_t>(size - 6));
  const std::string want = saved.shard + ": " + std::to_string(size - 6) +
                           " bytes, the manifest says " + std::to_string(size) +
                           " (truncated or overwritten)";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
}

TEST(Checkpoint, ASliceBeyondTheEndOfItsFileIsRefusedBeforeAnyRead) {
  // A manifest whose file sizes agree with the disk but whose last slice runs past the end: the
  // manifest's validation refuses it before a byte is read.
  const Saved saved;
  ckpt::Manifest m = read_manifest(saved.dir);
  ckpt::Slice* s = m.mutable_tensors(m.tensors_size() - 1)->mutable_slices(0);  // w (adam_v)
  const int64_t bytes = m.files(0).bytes();
  const int64_t at = bytes - 8;
  s->set_offset(at);
  write_manifest(saved.dir, m);
  const std::string want = saved.dir + "/manifest.pb: tensor w (adam_v): slice 0: 24 floats at " +
                           "byte " + std::to_string(at) + " lie outside shard_00000.bin of " +
                           std::to_string(bytes) + " bytes";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
}

TEST(Checkpoint, AMissingShardIsNamed) {
  const Saved saved;
  fs::remove(saved.shard);
  const std::string want = saved.shard + ": No such file or directory (a shard the manifest lists)";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
}

TEST(Checkpoint, AMissingManifestIsNamed) {
  const Saved saved;
  fs::remove(saved.dir + "/manifest.pb");
  const std::string want =
      saved.dir + "/manifest.pb: missing (an incomplete or damaged checkpoint)";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(saved.dir); }), want);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
}

TEST(Checkpoint, AGarbageManifestCannotBeParsed) {
  const Saved saved;
  const std::string want =
      saved.dir + "/manifest.pb: cannot parse (corrupt, or not a keel checkpoint manifest)";
  const auto fresh = make_rank(base_specs());
  // Not protobuf at all; empty (parses, but has no format version); a directory.
  for (const std::string& bytes : {std::string("\xff\xff\xff\xff not a manifest"), std::string()}) {
    write_file(saved.dir + "/manifest.pb", bytes);
    EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(saved.dir); }), want);
    EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
    EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
  }
  fs::remove(saved.dir + "/manifest.pb");
  fs::create_directory(saved.dir + "/manifest.pb");
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(saved.dir); }),
            saved.dir + "/manifest.pb: is a directory, not a regular file (a checkpoint manifest)");
}

TEST(Checkpoint, ANewerFormatVersionIsRefused) {
  const Saved saved;
  ckpt::Manifest m = read_manifest(saved.dir);
  m.set_format_version(kCheckpointFormatVersion + 1);
  write_manifest(saved.dir, m);
  const std::string want = saved.dir + "/manifest.pb: format version " +
                           std::to_string(kCheckpointFormatVersion + 1) +
                           " is newer than this keel's " +
                           std::to_string(kCheckpointFormatVersion) + " (written by a newer keel)";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { read_manifest(saved.dir); }), want);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
  // The version this keel writes is accepted.
  m.set_format_version(kCheckpointFormatVersion);
  write_manifest(saved.dir, m);
  verify_checkpoint(saved.dir);
}

TEST(Checkpoint, MissingCoverageIsNamed) {
  const Saved saved;
  ckpt::Manifest m = read_manifest(saved.dir);
  ckpt::TensorRecord* ln_m = nullptr;
  for (ckpt::TensorRecord& t : *m.mutable_tensors()) {
    if (t.name() == "ln.g" && t.kind() == ckpt::ADAM_M) ln_m = &t;
  }
  ASSERT_NE(ln_m, nullptr);
  ln_m->clear_slices();
  write_manifest(saved.dir, m);
  const std::string want = saved.dir + "/manifest.pb: tensor ln.g (adam_m): has no slices";
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { verify_checkpoint(saved.dir); }), want);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }), want);
}

// ---- what the state expects must be there
// --------------------------------------------------------

TEST(Checkpoint, AChangedShapeIsRefusedNamingTensorAndBothShapes) {
  const Saved saved;  // w is [4, 6]
  std::vector<ParamSpec> specs = base_specs();
  specs[4].logical = {4, 8};
  const auto other = make_rank(specs);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *other->state); }),
            saved.dir +
                "/manifest.pb: tensor w (param) has shape [4, 6] in the checkpoint but "
                "[4, 8] in this config (a shape-determining model field changed)");
  EXPECT_EQ(other->state->step, 0);
}

TEST(Checkpoint, AMissingTensorIsRefused) {
  const Saved saved;
  std::vector<ParamSpec> specs = base_specs();
  specs.push_back({.name = "extra", .logical = {3}});
  const auto other = make_rank(specs);
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *other->state); }),
            saved.dir +
                "/manifest.pb: tensor extra (param) is not in the checkpoint (the model "
                "config changed?)");
  EXPECT_EQ(other->state->step, 0);
  // A moment missing from a damaged manifest is refused the same way.
  ckpt::Manifest m = read_manifest(saved.dir);
  auto* tensors = m.mutable_tensors();
  tensors->erase(tensors->begin() + 5);  // ln.g (adam_v)
  write_manifest(saved.dir, m);
  const auto fresh = make_rank(base_specs());
  EXPECT_EQ(error_of(ErrorKind::kData, [&] { load_checkpoint(saved.dir, *fresh->state); }),
            saved.dir +
                "/manifest.pb: tensor ln.g (adam_v) is not in the checkpoint (the model "
                "config changed?)");
}

// ---- other layouts
// ---------------------------------------------------------------------------------

// The world communicator of `size` ranks that are threads of this process: all_reduce of doubles
// (what save_checkpoint's agreement uses) meets every rank at a barrier; nothing else is expected.
class ThreadWorld {
 public:
  explicit ThreadWorld(int size) : size_(size), barrier_(size), slots_(size) {}
  class Comm final : public Communicator {
   public:
    Comm(ThreadWorld& w, int rank) : w_(w), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return w_.size_; }
    void all_reduce(double* data, int64_t n, ReduceOp op) override {
      for (int64_t i = 0; i < n; ++i) {
        w_.slots_[rank_] = data[i];
        w_.barrier_.arrive_and_wait();
        double r = w_.slots_[0];
        for (int k = 1; k < w_.size_; ++k) {
          r = op == ReduceOp::kMax ? std::max(r, w_.slots_[k]) : r + w_.slots_[k];
        }
        w_.barrier_.arrive_and_wait();
        data[i] = r;
      }
    }
    void all_reduce(float*, int64_t, ReduceOp) override { unexpected(); }
    void all_reduce_bf16(float*, int64_t) override { unexpected(); }
    void all_reduce_bf16(Bf16*, int64_t) override { unexpected(); }
    void all_gather(const float*, float*, int64_t) override { unexpected(); }
    void reduce_scatter(const float*, float*, int64_t) override { unexpected(); }
    void broadcast(float*, int64_t, int) override { unexpected(); }
    void all_gather_bytes(const void*, void*, int64_t) override { unexpected(); }
    void broadcast_bytes(void*, int64_t, int) override { unexpected(); }
    void barrier() override { w_.barrier_.arrive_and_wait(); }
    std::unique_ptr<CommRequest> iall_reduce(float*, int64_t) override {
      unexpected();
      return std::make_unique<DoneRequest>();
    }

   private:
    static void unexpected() { ADD_FAILURE() << "a collective a checkpoint save does not use"; }
    ThreadWorld& w_;
    int rank_;
  };

 private:
  int size_;
  std::barrier<> barrier_;
  std::vector<double> slots_;
};

std::vector<LayoutSpec> ranks_of(int tp, int dp, bool zero) {
  std::vector<LayoutSpec> out;
  for (int d = 0; d < dp; ++d) {
    for (int t = 0; t < tp; ++t) out.push_back({tp, t, dp, d, zero});
  }
  return out;
}

// Every rank of (tp, dp, zero) filled with the patterns saves step 12 into `store`, each rank on
// its own thread; returns each rank's error message (empty: none).
std::vector<std::string> save_world(const CheckpointStore& store, int tp, int dp, bool zero) {
  const std::vector<LayoutSpec> layout = ranks_of(tp, dp, zero);
  const int world = static_cast<int>(layout.size());
  ThreadWorld hub(world);
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::unique_ptr<ThreadWorld::Comm>> comms;
  for (int w = 0; w < world; ++w) {
    ranks.push_back(make_rank(base_specs(), layout[w]));
    fill(*ranks.back());
    set_run_state(*ranks.back()->state);
    comms.push_back(std::make_unique<ThreadWorld::Comm>(hub, w));
    ranks.back()->topo.world_comm = comms.back().get();
  }
  const config::KeelConfig cfg = test_config();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int w = 0; w < world; ++w) {
    threads.emplace_back([&, w] {
      try {
        save_checkpoint(*ranks[w]->state, cfg, ranks[w]->topo, store);
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

// Loads `dir` into every rank of (tp, dp, zero) and expects each one's slices bit for bit.
void expect_loads_at(const std::string& dir, int tp, int dp, bool zero) {
  for (const LayoutSpec& l : ranks_of(tp, dp, zero)) {
    SCOPED_TRACE(::testing::Message() << "tp " << tp << " rank " << l.tp_rank << ", dp " << dp
                                      << " rank " << l.dp_rank << (zero ? ", ZeRO-1" : ""));
    const auto r = make_rank(base_specs(), l);
    ASSERT_GT(mismatches(*r, 0, /*report=*/false), 0);
    load_checkpoint(dir, *r->state);
    EXPECT_EQ(mismatches(*r), 0);
    EXPECT_EQ(r->state->step, 12);
    EXPECT_EQ(r->state->sampler.next_sample, 96u);
    EXPECT_EQ(r->state->optimizer().t(), 7);
  }
}

TEST(Checkpoint, ASingleProcessSaveLoadsIntoTpBlocksAndZeroSlices) {
  const Saved saved;
  expect_loads_at(saved.dir, 2, 1, false);
  expect_loads_at(saved.dir, 1, 3, true);
  expect_loads_at(saved.dir, 2, 2, true);
}

TEST(Checkpoint, ATpZeroSaveOnThreadsLoadsAtEveryLayout) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  const std::vector<std::string> errors = save_world(store, 2, 2, true);
  EXPECT_EQ(errors, std::vector<std::string>(4));
  const std::string dir = store.path_of(12);
  EXPECT_EQ(store.latest(), std::optional<int64_t>(12));
  EXPECT_EQ(entries(store.root()), (std::vector<std::string>{"LATEST", "step_00000012"}));
  verify_checkpoint(dir);
  const ckpt::Manifest m = read_manifest(dir);
  EXPECT_EQ(m.layout().world(), 4);
  EXPECT_EQ(m.layout().tp(), 2);
  EXPECT_EQ(m.layout().dp(), 2);
  EXPECT_EQ(m.layout().zero_stage(), 1);
  // wte is split in two TP blocks along dim 0, written by DP rank 0 of each TP rank.
  const ckpt::TensorRecord* wte = find_record(m, "wte", ckpt::PARAM);
  ASSERT_NE(wte, nullptr);
  ASSERT_EQ(wte->slices_size(), 2);
  EXPECT_EQ(wte->slices(0).shard_dim(), 0);
  EXPECT_EQ(wte->slices(0).shard_begin(), 0);
  EXPECT_EQ(wte->slices(0).shard_len(), 5);
  EXPECT_EQ(wte->slices(0).n(), 40);
  EXPECT_EQ(wte->slices(0).file(), "shard_00000.bin");
  EXPECT_EQ(wte->slices(1).shard_begin(), 5);
  EXPECT_EQ(wte->slices(1).file(), "shard_00001.bin");
  // ln.g is replicated: TP rank 0 writes it once.
  const ckpt::TensorRecord* ln = find_record(m, "ln.g", ckpt::PARAM);
  ASSERT_NE(ln, nullptr);
  ASSERT_EQ(ln->slices_size(), 1);
  EXPECT_EQ(ln->slices(0).shard_dim(), -1);
  EXPECT_EQ(ln->slices(0).n(), 8);
  // fc's moments (arena [64, 112) of 160 at tp 2) straddle the two ZeRO-1 slices [0, 80) and
  // [80, 160): each rank writes its part of its TP block, in world-rank order.
  const ckpt::TensorRecord* fc_m = find_record(m, "fc", ckpt::ADAM_M);
  ASSERT_NE(fc_m, nullptr);
  ASSERT_EQ(fc_m->slices_size(), 4);
  const int64_t want[4][4] = {{0, 0, 16, 0}, {6, 0, 16, 1}, {0, 16, 32, 2}, {6, 16, 32, 3}};
  for (int i = 0; i < 4; ++i) {
    const ckpt::Slice& s = fc_m->slices(i);
    EXPECT_EQ(s.shard_dim(), 1);
    EXPECT_EQ(s.shard_begin(), want[i][0]);
    EXPECT_EQ(s.shard_len(), 6);
    EXPECT_EQ(s.flat_begin(), want[i][1]);
    EXPECT_EQ(s.n(), want[i][2]);
    EXPECT_EQ(s.file(), "shard_0000" + std::to_string(want[i][3]) + ".bin");
  }
  for (auto [tp, dp, zero] : {std::tuple{1, 1, false},
                              {2, 1, false},
                              {1, 2, true},
                              {2, 2, true},
                              {2, 3, true},
                              {1, 4, false}}) {
    expect_loads_at(dir, tp, dp, zero);
  }
}

TEST(Checkpoint, WithoutZeroOnlyDpRankZeroWrites) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  EXPECT_EQ(save_world(store, 2, 2, false), std::vector<std::string>(4));
  const std::string dir = store.path_of(12);
  // DP rank 1 (world ranks 2 and 3) holds copies of everything, and writes nothing.
  EXPECT_EQ(entries(dir),
            (std::vector<std::string>{"manifest.pb", "shard_00000.bin", "shard_00001.bin"}));
  verify_checkpoint(dir);
  const ckpt::Manifest m = read_manifest(dir);
  EXPECT_EQ(m.layout().zero_stage(), 0);
  ASSERT_EQ(m.files_size(), 2);
  for (const ckpt::TensorRecord& t : m.tensors()) {
    const bool sharded = t.name() == "wte" || t.name() == "fc" || t.name() == "w";
    EXPECT_EQ(t.slices_size(), sharded ? 2 : 1) << t.name() << " " << tensor_kind_name(t.kind());
  }
  expect_loads_at(dir, 1, 1, false);
  expect_loads_at(dir, 1, 2, true);
}

// ---- a failed save
// -------------------------------------------------------------------------------

// Caps the size of files this process writes (RLIMIT_FSIZE binds root too): a write past it fails
// with EFBIG instead of raising SIGXFSZ. Restores both on destruction.
class FileSizeCap {
 public:
  explicit FileSizeCap(rlim_t bytes) {
    ok_ = ::getrlimit(RLIMIT_FSIZE, &old_) == 0;
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit capped = old_;
    capped.rlim_cur = bytes;
    ok_ = ok_ && ::setrlimit(RLIMIT_FSIZE, &capped) == 0;
  }
  ~FileSizeCap() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeCap(const FileSizeCap&) = delete;
  FileSizeCap& operator=(const FileSizeCap&) = delete;
  bool ok() const { return ok_; }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = SIG_DFL;
  bool ok_ = false;
};

TEST(Checkpoint, AFailedSaveLeavesThePreviousCheckpointAndLatest) {
  const TempDir td;
  const CheckpointStore store(td.path() + "/checkpoints");
  const config::KeelConfig cfg = test_config();
  const auto r = make_rank(base_specs());
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  fill(*r, 1);
  r->state->step = 1;
  save_checkpoint(*r->state, cfg, topo, store);
  const std::string manifest_before = read_file(store.path_of(1) + "/manifest.pb");
  const std::string shard_before = read_file(store.path_of(1) + "/shard_00000.bin");
  ASSERT_EQ(shard_before.size(), 209u * 3 * sizeof(float));

  fill(*r, 2);
  r->state->step = 2;
  std::string message;
  {
    const FileSizeCap cap(1000);  // the step-2 shard is 2508 bytes
    ASSERT_TRUE(cap.ok());
    message = error_of(ErrorKind::kIo, [&] { save_checkpoint(*r->state, cfg, topo, store); });
  }
  EXPECT_EQ(message,
            store.path_of(2) + ".tmp/shard_00000.bin: write failed: " + std::strerror(EFBIG));
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{1}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(1));
  EXPECT_EQ(read_file(store.root() + "/LATEST"), "step_00000001\n");
  EXPECT_EQ(read_file(store.path_of(1) + "/manifest.pb"), manifest_before);
  EXPECT_EQ(read_file(store.path_of(1) + "/shard_00000.bin"), shard_before);
  verify_checkpoint(store.path_of(1));
  const auto back = make_rank(base_specs());
  load_checkpoint(store.path_of(1), *back->state);
  EXPECT_EQ(mismatches(*back, 1), 0);
  EXPECT_EQ(back->state->step, 1);

  // The failed save removed its unfinished .tmp (a crash would leave it for the next start to
  // remove); a retry succeeds.
  EXPECT_EQ(entries(store.root()), (std::vector<std::string>{"LATEST", "step_00000001"}));
  save_checkpoint(*r->state, cfg, topo, store);
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(store.latest(), std::optional<int64_t>(2));
  EXPECT_EQ(store.remove_stale(), 0);
  load_checkpoint(store.path_of(2), *back->state);
  EXPECT_EQ(mismatches(*back, 2), 0);
}

TEST(Checkpoint, ASaveUnderARegularFileFailsNamingTheRootAndLeavesNothing) {
  const TempDir td;
  const std::string blocker = td.write("run", "a file where the run directory should be");
  const CheckpointStore store(blocker + "/checkpoints");
  const auto r = make_rank(base_specs());
  fill(*r);
  r->state->step = 3;
  std::unique_ptr<Communicator> tp, dp;
  const std::string message = error_of(ErrorKind::kIo, [&] {
    save_checkpoint(*r->state, test_config(), Topology::single(tp, dp), store);
  });
  EXPECT_EQ(message, store.root() + ": cannot create: " + std::strerror(ENOTDIR));
  EXPECT_EQ(entries(td.path()), (std::vector<std::string>{"run"}));
  EXPECT_EQ(read_file(blocker), "a file where the run directory should be");
}

}  // namespace
}  // namespace keel
