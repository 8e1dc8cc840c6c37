// Training loop, evaluation, metrics and sampling.
#include "launch/trainer.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <vector>

#include "framework/config/config.h"
#include "framework/data/fingerprint.h"
#include "framework/error.h"
#include "framework/file_io.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/gemm.h"
#include "framework/philox.h"
#include "launch/fault_injector.h"
#include "parallel/staging_communicator.h"

namespace keel {

namespace {
std::string human_seconds(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t % 3600 / 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  }
  return buf;
}
}  // namespace

Trainer::Trainer(const config::KeelConfig& cfg, const Topology& topo, TrainerOptions opts)
    : cfg_(cfg),
      topo_(topo),
      opts_(std::move(opts)),
      data_(Dataset::open(cfg)),
      sampler_(data_, cfg),
      faults_(cfg.debug(), topo.world_rank),
      guard_(cfg.spike()) {
  const auto& t = cfg_.train();
  kernels::set_flush_denormals(!t.keep_denormals());
  const uint64_t train_fp = fingerprint(data_.train());
  const uint64_t val_fp = data_.has_val() ? fingerprint(data_.val()) : 0;
  if (topo_.world_comm) check_same_data_on_every_rank(train_fp, val_fp);
  const int64_t per_rank = t.global_batch() / topo_.dp;
  KEEL_CHECK(t.global_batch() % topo_.dp == 0, kConfig, "train.global_batch=", t.global_batch(),
             " is not divisible by the data-parallel size ", topo_.dp);
  micro_ = t.micro_batch() > 0 ? t.micro_batch() : per_rank;
  KEEL_CHECK(per_rank % micro_ == 0, kConfig, "train.micro_batch=", micro_,
             " does not divide the per-rank batch ", per_rank, " (train.global_batch / dp)");
  accum_ = per_rank / micro_;
  const Device device = kernels::resolve_device(t.device());
  exec_ = kernels::make_exec(device, device == Device::kCpu ? 0 : opts_.device_index);
  exec_->set_precision(kernels::resolve_precision(t.precision(), device));
  grad_sq_ = Tensor::zeros({1}, DType::kF64, device);
  if (device != Device::kCpu && (topo_.world_size > 1 || opts_.tensor_comms_for_one_rank)) {
    // The model's tensors live on the device: its TP and DP collectives need communicators
    // that take device memory (Topology::tp_tensors).
    if (opts_.make_tensor_comms) tensor_comms_ = opts_.make_tensor_comms(*exec_, topo_);
    if (!tensor_comms_.tp) {
      tensor_comms_.tp = std::make_unique<StagingCommunicator>(*topo_.tp_comm, device);
    }
    if (!tensor_comms_.dp) {
      tensor_comms_.dp = std::make_unique<StagingCommunicator>(*topo_.dp_comm, device);
    }
    topo_.tp_tensor_comm = tensor_comms_.tp.get();
    topo_.dp_tensor_comm = tensor_comms_.dp.get();
  }
  model_ = std::make_unique<GPT>(cfg_, topo_, micro_, *exec_);
  model_->init(t.seed());
  ParamStore& ps = model_->params();
  for (int id = 0; id < ps.size(); ++id) {
    if (ps.info(id).spec.tp_partial_grad && topo_.tp > 1) tp_partial_ids_.push_back(id);
  }
  // Data parallelism: ZeRO-1 shards the optimizer over DP (Note [ZeRO-1 partition]); otherwise
  // bucketed, overlapped all-reduce of the whole gradient arena.
  const ZeroPartition part(ps.total_elems(), topo_.dp, topo_.dp_rank,
                           cfg_.parallel().zero_stage() == 1);
  std::vector<ParamSegment> segs;
  for (int id = 0; id < ps.size(); ++id) {
    const ArenaSlice own = part.clip(ps.info(id).offset, ps.info(id).numel());
    if (!own.empty())
      segs.push_back({own.offset - part.mine().offset, own.n, ps.info(id).spec.decay});
  }
  opt_ = std::make_unique<AdamW>(cfg_.optim(), part.mine().n, std::move(segs), *exec_);
  state_ = std::make_unique<TrainState>(ps, *opt_, part);
  state_->train_fingerprint = train_fp;
  state_->val_fingerprint = val_fp;
  if (part.sharded()) {
    shard_grads_ = Tensor::zeros({part.mine().n}, DType::kF32, device);
  } else if (topo_.dp > 1) {
    std::vector<ArenaRange> ranges;
    for (int id = 0; id < ps.size(); ++id)
      ranges.push_back({ps.info(id).offset, ps.info(id).numel()});
    const auto bucket_bytes = static_cast<int64_t>(cfg_.parallel().bucket_mb() * 1024.0 * 1024.0);
    grad_sync_ = std::make_unique<GradSync>(topo_.dp_tensors(), ps.grads().f32(), std::move(ranges),
                                            bucket_bytes);
  }
  const int64_t T = cfg_.model().seq_len();
  inputs_.resize(micro_ * T);
  targets_.resize(micro_ * T);
  if (!opts_.run_dir.empty()) {
    store_ = std::make_unique<CheckpointStore>(opts_.run_dir + "/checkpoints");
    if (cfg_.checkpoint().async()) {
      async_ = std::make_unique<AsyncCheckpointWriter>(
          cfg_, topo_, *store_, save_hook(), [this](int64_t s) { return pinned_for_rewind(s); });
    }
  }
  resumed_from_ = resume();
  start_step_ = state_->step;
  if (resumed_from_) saved_step_ = *resumed_from_;
  if (!opts_.run_dir.empty() && topo_.world_rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(opts_.run_dir, ec);
    KEEL_CHECK(!ec, kIo, opts_.run_dir, ": cannot create run directory: ", ec.message());
    write_file_atomic(opts_.run_dir + "/config.pbtxt", to_text(cfg_));
    open_logs(resumed_from_);
  }
  if (!opts_.run_dir.empty() && topo_.world_rank == 0 && cfg_.train().tensorboard()) {
    tensorboard_ = std::make_unique<TensorBoardWriter>(opts_.run_dir + "/tensorboard");
  }
  // The guard's alerts: RUN/alerts.jsonl (continued on resume), stderr, alert.command.
  alerts_ = std::make_unique<AlertSink>(
      opts_.run_dir, cfg_.alert(), topo_.world_rank == 0,
      resumed_from_ ? AlertFileMode::kAppend : AlertFileMode::kTruncate);
}

void Trainer::say(const std::string& line) const {
  if (topo_.world_rank != 0 || !opts_.progress) return;
  std::printf("keel-train: %s\n", line.c_str());
  std::fflush(stdout);
}

namespace {

// Model fields a resumed run may change: the sequence length and the RoPE base, as context
// extension does, and the init scale (used only before step 1). max_positions (resolved to
// seq_len when 0) is the learned position table's shape, which the shape check covers, and means
// nothing under RoPE. Every other model field decides what the parameters compute.
bool may_change_on_resume(const std::string& field) {
  return field == "seq_len" || field == "max_positions" || field == "rope_theta" ||
         field == "init_std";
}

// proto3's zero value, as TextFormat prints it: what a field reads as in a config written before
// the field existed.
bool zero_value(const std::string& printed) {
  const std::string unspecified = "_UNSPECIFIED";
  return printed == "0" || printed == "false" || printed == "\"\"" ||
         (printed.size() >= unspecified.size() &&
          printed.compare(printed.size() - unspecified.size(), unspecified.size(), unspecified) ==
              0);
}

}  // namespace

std::string changed_model_field(const config::Model& then, const config::Model& now) {
  namespace pb = google::protobuf;
  const pb::Descriptor* d = config::Model::descriptor();
  auto printed = [](const config::Model& m, const pb::FieldDescriptor* f) {
    std::string s;
    pb::TextFormat::PrintFieldValueToString(m, f, -1, &s);
    return s;
  };
  // Every config written since the model's enums all existed has each resolved to a named value;
  // one at UNSPECIFIED marks a checkpoint from before some fields were added, whose zero-valued
  // fields are then unknown, not different.
  bool legacy = false;
  for (int i = 0; i < d->field_count(); ++i) {
    if (d->field(i)->type() == pb::FieldDescriptor::TYPE_ENUM &&
        then.GetReflection()->GetEnumValue(then, d->field(i)) == 0) {
      legacy = true;
    }
  }
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (may_change_on_resume(f->name())) continue;
    // Without QK-norm its scope means nothing.
    if (f->name() == "qk_norm_scope" && then.qk_norm() == config::NONE &&
        now.qk_norm() == config::NONE) {
      continue;
    }
    const std::string a = printed(then, f), b = printed(now, f);
    if (a == b || (legacy && zero_value(a))) continue;
    return "it was written with model." + f->name() + "=" + a + " and this config has model." +
           f->name() + "=" + b +
           " (of the model fields only seq_len, max_positions, rope_theta and init_std may " +
           "change on resume)";
  }
  return "";
}

std::string Trainer::check_checkpoint(const std::string& dir) const {
  verify_checkpoint(dir);  // corrupt: throws
  const ckpt::Manifest m = read_manifest(dir);
  if (m.train_fingerprint() != state_->train_fingerprint) {
    return "it was trained on other data (" + fingerprint_hex(m.train_fingerprint()) +
           ", this run reads " + fingerprint_hex(state_->train_fingerprint) +
           "): resuming would change the data order's meaning; start a new run directory";
  }
  std::map<std::string, Shape> shapes;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    shapes[t.name()] = Shape(t.shape().begin(), t.shape().end());
  }
  for (const StateParam& p : state_->tensors()) {
    auto it = shapes.find(p.info->spec.name);
    if (it == shapes.end()) {
      return "it has no tensor " + p.info->spec.name + " (the model config changed)";
    }
    if (!loadable_shape(p.info->spec, it->second)) {
      return "tensor " + p.info->spec.name + " has shape " + shape_str(it->second) + " there but " +
             shape_str(p.info->spec.logical) +
             " in this config (a shape-determining model field changed)";
    }
  }
  if (m.has_config()) return changed_model_field(m.config().model(), cfg_.model());
  return "";
}

namespace {

std::string step_list(std::vector<int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  std::string s;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i == 6 && steps.size() > 8)
      return s + ", ... (" + std::to_string(steps.size()) + " in all)";
    s += (i ? ", " : "") + std::to_string(steps[i]);
  }
  return s;
}

// Whether checkpoint directory `dir` is one of `root`'s (the run's own store).
bool inside_store(const std::string& dir, const std::string& root) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(dir).lexically_normal().parent_path();
  return std::filesystem::equivalent(parent.empty() ? "." : parent, root, ec) && !ec;
}

}  // namespace

std::optional<int64_t> Trainer::resume() {
  const ResumeOptions& ro = opts_.resume;
  if (!store_ && ro.mode != ResumeMode::kFrom) return std::nullopt;
  // Rank 0 decides; verdict = {what, error kind}: what = -1 fresh, -2 error, else the step of
  // store_'s checkpoint (or 0 with --resume-from, whose path every rank knows).
  double verdict[2] = {-1.0, 0.0};
  std::string error;
  if (topo_.world_rank == 0) {
    try {
      if (store_) {
        // Before anything in the run directory is read or changed (Note [run-directory lock]).
        lock_ = std::make_unique<RunDirLock>(opts_.run_dir);
        if (!lock_->unsupported().empty()) {
          say("warning: " + lock_->path() + ": this file system cannot lock (" +
              lock_->unsupported() +
              "): nothing stops a second job from using this run directory at the same time");
        }
        if (const int n = store_->remove_stale()) {
          say("removed " + std::to_string(n) + " unfinished checkpoint(s) (a save was cut short)");
        }
      }
      if (ro.mode == ResumeMode::kFrom) {
        const std::string why = check_checkpoint(ro.path);
        KEEL_CHECK(why.empty(), kData, ro.path, ": cannot resume from it: ", why);
        if (store_) start_lineage_at(ro.path, read_manifest(ro.path).step());
        verdict[0] = 0.0;
      } else if (ro.mode == ResumeMode::kFresh) {
        const std::vector<int64_t> steps = store_->steps();
        if (!steps.empty()) {
          KEEL_CHECK(ro.overwrite, kUsage, store_->root(), " holds ", steps.size(),
                     " checkpoint(s), the newest at step ", steps.front(),
                     ": drop --no-resume to resume from it, or add --overwrite to delete them");
          store_->remove_all();
          say("--overwrite: deleted " + std::to_string(steps.size()) + " checkpoint(s) in " +
              store_->root());
        }
      } else {
        // Note [lineage]: LATEST's checkpoint (or a whole one committed after it whose LATEST
        // update a crash cut off), then older ones; never a newer one of an abandoned branch.
        const std::vector<int64_t> candidates = store_->lineage();
        const std::vector<int64_t> off = store_->off_lineage();
        for (int64_t s : off) {
          const std::string dir = store_->path_of(s);
          std::string why;
          try {
            const ckpt::Manifest m = read_manifest(dir);
            why = "its parent is step " + std::to_string(m.parent_step()) + ", not step " +
                  std::to_string(store_->latest().value_or(-1)) + " which LATEST names";
          } catch (const Error& e) {
            why = std::string("unusable: ") + e.what();
          }
          say("checkpoint " + dir + " is not on LATEST's lineage (" + why + ")");
        }
        std::vector<int64_t> unusable;
        for (size_t i = 0; i < candidates.size(); ++i) {
          const std::string dir = store_->path_of(candidates[i]);
          std::string why;
          try {
            why = check_checkpoint(dir);
          } catch (const Error& e) {
            say("checkpoint " + dir + " is unusable: " + e.what() +
                (i + 1 < candidates.size() ? "; trying the previous one" : ""));
            unusable.push_back(candidates[i]);
            continue;
          }
          KEEL_CHECK(why.empty(), kData, dir, ": cannot resume from it: ", why);
          verdict[0] = static_cast<double>(candidates[i]);
          break;
        }
        KEEL_CHECK(candidates.empty() || verdict[0] >= 0, kData, store_->root(), ": none of its ",
                   candidates.size(),
                   " checkpoint(s) is usable (see above); pass --no-resume --overwrite to start "
                   "over");
        if (verdict[0] >= 0) {
          // The run goes on from here: what is newer (unusable, or off the lineage) goes.
          const auto step = static_cast<int64_t>(verdict[0]);
          const std::vector<int64_t> removed = store_->remove_newer_than(step);
          if (store_->latest() != step) store_->set_latest(step);
          if (!removed.empty()) {
            say("deleted " + std::to_string(removed.size()) + " checkpoint(s) newer than step " +
                std::to_string(step) + " (steps " + step_list(removed) + "; " +
                std::to_string(off.size()) + " not on LATEST's lineage, " +
                std::to_string(unusable.size()) + " unusable): the run continues from step " +
                std::to_string(step));
          }
        }
      }
    } catch (const Error& e) {
      verdict[0] = -2.0;
      verdict[1] = static_cast<double>(e.kind());
      error = e.what();
      if (!topo_.world_comm) throw;
    }
  }
  if (topo_.world_comm) {
    if (topo_.world_rank != 0) verdict[0] = verdict[1] = -1e300;
    topo_.world_comm->all_reduce(verdict, 2, ReduceOp::kMax);
  }
  if (verdict[0] == -2.0) {
    const auto kind = static_cast<ErrorKind>(static_cast<int>(verdict[1]));
    if (topo_.world_rank == 0) throw Error(kind, error, __FILE__, __LINE__);
    throw Error(kind, "rank 0 could not resume (see its message)", __FILE__, __LINE__);
  }
  if (verdict[0] < 0) return std::nullopt;
  const std::string dir =
      ro.mode == ResumeMode::kFrom ? ro.path : store_->path_of(static_cast<int64_t>(verdict[0]));
  const ckpt::Manifest m = load_checkpoint(dir, *state_);
  char line[256];
  std::snprintf(line, sizeof(line), "resuming from %s at step %lld (written at dp %d x tp %d%s)",
                dir.c_str(), static_cast<long long>(m.step()), m.layout().dp(), m.layout().tp(),
                m.layout().zero_stage() ? ", ZeRO-1" : "");
  say(line);
  return m.step();
}

void Trainer::start_lineage_at(const std::string& dir, int64_t step) {
  if (inside_store(dir, store_->root())) {
    // One of this run's own: the run's history continues from it, and the branch it abandons
    // (every newer checkpoint) goes, as after a rewind. LATEST names it until the next save.
    const std::vector<int64_t> removed = store_->remove_newer_than(step);
    store_->set_latest(step);
    if (!removed.empty()) {
      say("--resume-from " + dir + ": a new lineage from step " + std::to_string(step) +
          "; deleted the " + std::to_string(removed.size()) +
          " newer checkpoint(s) of the branch it abandons (steps " + step_list(removed) + ")");
    }
    return;
  }
  // Another run's checkpoint: this run directory's own checkpoints belong to another history.
  const std::vector<int64_t> steps = store_->steps();
  if (steps.empty()) return;
  KEEL_CHECK(opts_.resume.overwrite, kUsage, store_->root(), " holds ", steps.size(),
             " checkpoint(s) of another history (the newest at step ", steps.front(),
             "): --resume-from ", dir,
             " there would mix two runs; use another --run-dir, or add --overwrite to delete them");
  store_->remove_all();
  say("--overwrite: deleted " + std::to_string(steps.size()) + " checkpoint(s) in " +
      store_->root());
}

namespace {

// Keeps the lines of `path` (JSON objects with a "step" field; see `key`) of steps <= `step`;
// returns how many it dropped. A missing file is left missing.
int64_t trim_jsonl(const std::string& path, int64_t step, const char* key) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return 0;
  std::ifstream in(path, std::ios::binary);
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    // The step is the first field of a metrics line and follows "time" in an alert's.
    const size_t at = line.find(key);
    long long s = -1;
    if (at == std::string::npos ||
        std::sscanf(line.c_str() + at + std::strlen(key), "%lld", &s) != 1 || s > step) {
      ++dropped;  // a later step's, or a line cut off by a crash
      continue;
    }
    kept += line + "\n";
  }
  if (dropped > 0) write_file_atomic(path, kept);
  return dropped;
}

}  // namespace

void Trainer::open_logs(std::optional<int64_t> resumed_step) {
  const std::string path = opts_.run_dir + "/metrics.jsonl";
  if (!resumed_step) {
    metrics_ = std::make_unique<JsonlWriter>(path);
    return;
  }
  // Keep what the checkpoint's steps logged; drop the lines, alerts and TensorBoard events of
  // the steps the resumed run repeats (logged by a run that died, or by an abandoned branch), so
  // that each step is in each log once.
  trim_jsonl(path, *resumed_step, "{\"step\": ");
  metrics_ = std::make_unique<JsonlWriter>(path, /*append=*/true);
  // The alerts that led to the resumed state stay: a checkpoint committed by a rewind (Note
  // [durable rewind]) is of an earlier step than the rewind's own alerts.
  const std::vector<int64_t>& rewinds = state_->guard.rewinds;
  const int64_t alerts_up_to =
      std::max(*resumed_step,
               rewinds.empty() ? int64_t{0} : *std::max_element(rewinds.begin(), rewinds.end()));
  trim_jsonl(opts_.run_dir + "/alerts.jsonl", alerts_up_to, "\"step\": ");
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(opts_.run_dir + "/tensorboard", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("events.out.tfevents.", 0) != 0 || !e.is_regular_file(ec)) continue;
    trim_tensorboard_events(e.path().string(), *resumed_step, "alerts/", alerts_up_to);
  }
}

void Trainer::sync_logs() {
  // Rank 0, once a checkpoint has committed: the logs are durable up to its step at least.
  if (metrics_) metrics_->sync();
  if (tensorboard_) {
    tensorboard_->sync();
    flush_tensorboard();  // reports a failure, once
  }
}

SaveHook Trainer::save_hook() const {
  return [this](SavePhase phase, int64_t step) {
    switch (phase) {
      case SavePhase::kShardHalfWritten:
        faults_.at(FaultPoint::kSaveMidShard, step);
        break;
      case SavePhase::kBeforeManifest:
        faults_.at(FaultPoint::kSaveBeforeManifest, step);
        break;
      case SavePhase::kBeforeLatest:
        faults_.at(FaultPoint::kSaveBeforeLatest, step);
        break;
    }
  };
}

void Trainer::save_checkpoint() {
  KEEL_CHECK(store_ != nullptr, kUsage, "save_checkpoint needs a run directory");
  if (async_) {
    // One save in flight at a time: the previous one is committed (or reported) first.
    if (async_->pending()) finish_checkpoint();
    async_->begin(*state_);
    return;
  }
  save_now();
}

void Trainer::save_now() {
  const double t0 = omp_get_wtime();
  keel::save_checkpoint(*state_, cfg_, topo_, *store_, save_hook(),
                        [this](int64_t s) { return pinned_for_rewind(s); });
  saved_step_ = state_->step;
  failed_save_.reset();
  sync_logs();
  char line[256];
  std::snprintf(line, sizeof(line), "saved checkpoint %s (%.2f s)",
                store_->path_of(state_->step).c_str(), omp_get_wtime() - t0);
  if (opts_.interactive) std::printf("\n");
  say(line);
}

void Trainer::finish_checkpoint() {
  if (!async_ || !async_->pending()) return;
  const int64_t step = async_->pending_step();
  const double t0 = omp_get_wtime();
  try {
    async_->finish();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kIo) throw;
    // Training goes on; LATEST still names the previous checkpoint. The rank that failed says
    // why; the run exits non-zero at its end unless a later save succeeds.
    if (!async_->local_error().empty()) {
      std::fprintf(stderr,
                   "keel-train: rank %d: checkpoint of step %lld not saved: %s (training goes "
                   "on; LATEST still names the previous checkpoint)\n",
                   topo_.world_rank, static_cast<long long>(step), e.what());
      std::fflush(stderr);
    }
    failed_save_ = step;
    return;
  }
  saved_step_ = step;
  failed_save_.reset();
  sync_logs();
  char line[320];
  std::snprintf(line, sizeof(line),
                "saved checkpoint %s (async: snapshot %.3f s, written in the background in "
                "%.2f s, commit %.3f s)",
                store_->path_of(step).c_str(), async_->snapshot_seconds(), async_->write_seconds(),
                omp_get_wtime() - t0);
  if (opts_.interactive) std::printf("\n");
  say(line);
}

Trainer::StepControl Trainer::agree_on_control() {
  // [stop signal number, 1 + the highest rank it reached, async writes still running]: one small
  // all-reduce per step, so that every rank stops, and commits, at the same step.
  const int sig = opts_.stop_signal ? opts_.stop_signal() : 0;
  double v[3] = {static_cast<double>(sig), sig ? topo_.world_rank + 1.0 : 0.0,
                 async_ && async_->pending() && !async_->done_locally() ? 1.0 : 0.0};
  if (topo_.world_comm && topo_.world_size > 1) topo_.world_comm->all_reduce(v, 3, ReduceOp::kMax);
  StepControl c;
  c.stop_signal = static_cast<int>(v[0]);
  c.signalled_rank = static_cast<int>(v[1]) - 1;
  c.writes_running = v[2] > 0;
  return c;
}

void Trainer::check_same_data_on_every_rank(uint64_t train_fp, uint64_t val_fp) const {
  // Every rank opened the data itself: a node with other files would silently train on another
  // stream. Each rank contributes (size, fingerprint) of both splits, as 16-bit pieces (exact in
  // a float), and every rank compares the gathered table with rank 0's row, so all of them reach
  // the same verdict and rank 0 names the first rank that differs.
  constexpr int kWords = 4, kPieces = 4;
  const uint64_t mine[kWords] = {static_cast<uint64_t>(data_.train().size()), train_fp,
                                 static_cast<uint64_t>(data_.val().size()), val_fp};
  std::vector<float> send(kWords * kPieces);
  for (int w = 0; w < kWords; ++w) {
    for (int p = 0; p < kPieces; ++p) send[w * kPieces + p] = (mine[w] >> (16 * p)) & 0xffff;
  }
  const int world = topo_.world_size;
  std::vector<float> table(send.size() * world);
  topo_.world_comm->all_gather(send.data(), table.data(), static_cast<int64_t>(send.size()));
  auto word = [&](int rank, int w) {
    uint64_t v = 0;
    for (int p = 0; p < kPieces; ++p) {
      v |= static_cast<uint64_t>(table[(rank * kWords + w) * kPieces + p]) << (16 * p);
    }
    return v;
  };
  const bool separate_val = !cfg_.data().val_path().empty();
  for (int r = 1; r < world; ++r) {
    for (int split = 0; split < 2; ++split) {
      const int w = 2 * split;
      if (word(r, w) == word(0, w) && word(r, w + 1) == word(0, w + 1)) continue;
      const char* field = split == 1 && separate_val ? "data.val_path" : "data.path";
      const char* what = split == 0 ? "training" : "validation";
      KEEL_FAIL(kData, field, ": rank ", r, " reads different ", what, " tokens from rank 0 (",
                word(r, w), " tokens, ", fingerprint_hex(word(r, w + 1)), " on rank ", r, "; ",
                word(0, w), " tokens, ", fingerprint_hex(word(0, w + 1)),
                " on rank 0): every rank must read the same data");
    }
  }
}

double Trainer::grad_sum_squares(const float* grads, ArenaSlice range) const {
  // Global-norm contributions of this rank's moments slice (grads[0] is arena element
  // range.offset): a TP-sharded parameter counts on every TP rank (each holds a different
  // slice), a replicated one on TP rank 0 only.
  // Summed on the device in parameter order, then one 8-byte read.
  bool any = false;
  for (const StateParam& p : state_->tensors()) {
    if (!p.info->sharded() && topo_.tp_rank != 0) continue;
    if (!p.moments.empty()) {
      exec_->sum_squares(grads + (p.moments.offset - range.offset), p.moments.n, grad_sq_.f64(),
                         /*accumulate=*/any);
      any = true;
    }
  }
  double sq = 0.0;
  if (any) grad_sq_.copy_to_host(0, 1, &sq);
  return sq;
}

StepResult Trainer::step() {
  const double t0 = omp_get_wtime();
  faults_.at(FaultPoint::kStepBegin, state_->step + 1);
  if (opts_.watchdog) opts_.watchdog->set_step(state_->step + 1);
  StepResult r = compute_gradients();
  const StepDecision d = decide(r);
  if (d == StepDecision::kApply) apply_update(r);
  r.step = ++state_->step;
  if (d == StepDecision::kSkip) {
    report(r, anomaly_name(r.guard.anomaly), "skip", "", -1,
           std::string(anomaly_name(r.guard.anomaly)) + ": update skipped (" +
               std::to_string(state_->guard.streak) + " of spike.patience=" +
               std::to_string(cfg_.spike().patience()) + " before a rewind)");
  } else if (d == StepDecision::kRewind || d == StepDecision::kHalt) {
    const bool halt = d == StepDecision::kHalt;
    const bool restored = rewind(r, halt);
    if (halt) {
      // Without a checkpoint to restore, the state in memory is the last good one: every update
      // of the streak was skipped.
      if (!restored && store_) save_checkpoint();
      finish_checkpoint();
      halted_ = true;
    } else if (restored) {
      r.rewound = true;
    } else {
      report(r, anomaly_name(r.guard.anomaly), "skip", "", -1,
             std::string(anomaly_name(r.guard.anomaly)) + ": update skipped; no rewind (" +
                 (store_ ? "no verified checkpoint at or before step " +
                               std::to_string(state_->guard.streak_first -
                                              cfg_.spike().rewind_margin())
                         : std::string("no run directory")) +
                 ")");
    }
  }
  // A device runs the optimizer's update after the host has moved on: the step's time includes
  // it (a no-op on the CPU).
  exec_->synchronize();
  r.seconds = omp_get_wtime() - t0;
  last_ = r;
  return r;
}

StepDecision Trainer::decide(StepResult& r) {
  // Every input of this decision is all-reduced, so every rank decides alike (DESIGN.md 5).
  r.guard = guard_.observe(state_->guard, state_->step + 1, r.first_sample, r.loss, r.grad_norm);
  // Bounded: a streak of skipped updates that no rewind ends (none possible, or every rewind
  // lands back in it) halts rather than skip forever and end "done".
  const int64_t max_skipped = cfg_.spike().max_skipped_steps();
  if (r.guard.action != GuardAction::kApply && state_->guard.streak > max_skipped) {
    halt_reason_ = std::to_string(state_->guard.streak) +
                   " consecutive anomalous steps, more than spike.max_skipped_steps=" +
                   std::to_string(max_skipped) + " (from step " +
                   std::to_string(state_->guard.streak_first) + "; no rewind ended them)";
    return StepDecision::kHalt;
  }
  halt_reason_ =
      "more than spike.max_rewinds=" + std::to_string(cfg_.spike().max_rewinds()) +
      " rewinds within spike.rewind_window=" + std::to_string(cfg_.spike().rewind_window()) +
      " steps";
  switch (r.guard.action) {
    case GuardAction::kApply:
      return StepDecision::kApply;
    case GuardAction::kSkip:
      return StepDecision::kSkip;
    case GuardAction::kRewind:
      // Retry a failed rewind only every spike.patience anomalous steps.
      if ((state_->guard.streak - cfg_.spike().patience()) % cfg_.spike().patience() != 0) {
        return StepDecision::kSkip;
      }
      return guard_.halt_due(state_->guard, state_->step + 1) ? StepDecision::kHalt
                                                              : StepDecision::kRewind;
  }
  return StepDecision::kApply;
}

std::optional<int64_t> Trainer::pick_rewind_target(int64_t limit) {
  double verdict = -1.0;
  if (topo_.world_rank == 0 && store_) {
    for (int64_t s : store_->steps()) {
      if (s > limit) continue;
      const std::string dir = store_->path_of(s);
      try {
        if (check_checkpoint(dir).empty()) {
          verdict = static_cast<double>(s);
          break;
        }
        say("checkpoint " + dir + " cannot be rewound to (it does not fit this run)");
      } catch (const Error& e) {
        say("checkpoint " + dir + " is unusable: " + e.what() + "; trying the previous one");
      }
    }
  }
  if (topo_.world_comm && topo_.world_size > 1) {
    if (topo_.world_rank != 0) verdict = -1e300;
    topo_.world_comm->all_reduce(&verdict, 1, ReduceOp::kMax);
  }
  if (verdict < 0) return std::nullopt;
  return static_cast<int64_t>(verdict);
}

bool Trainer::rewind(const StepResult& r, bool halt) {
  finish_checkpoint();  // a save in flight is committed (and discarded below if it is newer)
  const GuardState before = state_->guard;
  const int64_t limit = before.streak_first - cfg_.spike().rewind_margin();
  const std::optional<int64_t> target = store_ ? pick_rewind_target(limit) : std::nullopt;
  if (!target) {
    if (halt) {
      report(r, "halt", "halt", "", -1,
             halt_reason_ + "; no checkpoint to restore: halting with the state of step " +
                 std::to_string(state_->step) + " (every anomalous update skipped)" +
                 (store_ ? ", saved" : ", not saved (no run directory)") + " (exit 3)");
    } else if (!said_cannot_rewind_) {
      said_cannot_rewind_ = true;
      report(r, "cannot_rewind", "skip", "", -1,
             store_ ? "cannot rewind: no verified checkpoint at or before step " +
                          std::to_string(limit) +
                          " (spike.rewind_margin=" + std::to_string(cfg_.spike().rewind_margin()) +
                          "); updates stay skipped while the anomalies last"
                    : std::string("cannot rewind: the run has no checkpoints (no run directory); "
                                  "updates stay skipped while the anomalies last"));
    }
    return false;
  }
  const std::string dir = store_->path_of(*target);
  load_checkpoint(dir, *state_);
  GuardState& g = state_->guard;
  // What the guard learned since the checkpoint stays: every skipped range and every rewind.
  for (const SkippedRange& sk : before.skipped) {
    if (std::find(g.skipped.begin(), g.skipped.end(), sk) == g.skipped.end()) {
      g.skipped.push_back(sk);
    }
  }
  g.rewinds = before.rewinds;
  g.rewinds.push_back(r.step);
  int64_t batches = 0;
  const uint64_t batch = static_cast<uint64_t>(cfg_.train().global_batch());
  if (!halt) {
    // Skip from the checkpoint's position to spike.skip_batches batches past where the streak
    // began; the range is part of the run state from here on.
    const uint64_t from = state_->sampler.next_sample;
    const uint64_t to =
        before.streak_first_sample + static_cast<uint64_t>(cfg_.spike().skip_batches()) * batch;
    if (to > from) {
      g.skipped.push_back({from, to - from, r.step});
      state_->sampler.next_sample = to;
      batches = static_cast<int64_t>((to - from) / batch);
    }
    if (cfg_.spike().lr_scale() < 1.0 && cfg_.spike().cooldown_steps() > 0) {
      g.cooldown_from = *target;
    }
  }
  // Checkpoints newer than the target belong to the abandoned timeline: a resume must not pick
  // them up (Note [lineage]). Oldest first and LATEST last, so that a crash part-way resumes
  // from the pre-rewind state (which the guard then rewinds again), never from a half-abandoned
  // branch.
  int discarded = 0;
  if (topo_.world_rank == 0) {
    discarded = static_cast<int>(store_->remove_newer_than(*target).size());
    store_->set_latest(*target);
  }
  const std::string where = " to " + dir + " (step " + std::to_string(*target) + ")";
  const std::string also =
      discarded ? "; discarded " + std::to_string(discarded) + " newer checkpoint(s)" : "";
  if (halt) {
    report(r, "halt", "halt", dir, *target,
           halt_reason_ + ": restored" + where + also + "; halting (exit 3)");
  } else {
    report(r, "rewind", "rewind", dir, *target,
           std::string(anomaly_name(r.guard.anomaly)) + " for " + std::to_string(before.streak) +
               " steps from step " + std::to_string(before.streak_first) + ": rewound" + where +
               ", skipping " + std::to_string(batches) + " batches of data" + also + " (rewind " +
               std::to_string(g.rewinds.size()) + ")");
  }
  // Note [durable rewind]: the rewound state (the target's parameters with the guard's new
  // record: the skipped range, the rewind count, the cool-down) is committed before training
  // goes on, over the target's own directory; a crash or a stop signal from here on resumes into
  // it, so spike.max_rewinds holds across restarts and the bad data stays skipped. The alert
  // comes first: a crash before the commit resumes from the target as it was, drops the alert
  // with the steps after it (they are replayed) and rewinds again; after the commit, the resumed
  // run keeps the alerts up to the rewind's step.
  save_now();
  faults_.at(FaultPoint::kAfterRewind, r.step);
  return true;
}

bool Trainer::pinned_for_rewind(int64_t step) const {
  // A later anomaly (at step > now) rewinds to the newest checkpoint at or before
  // (that step - rewind_margin): keep the newest at or before (now + 1 - margin) and all newer.
  if (!guard_.enabled() || !store_) return false;
  const int64_t limit = state_->step + 1 - cfg_.spike().rewind_margin();
  for (int64_t s : store_->steps()) {
    if (s <= limit) return step >= s;
  }
  return true;
}

void Trainer::report(const StepResult& r, const std::string& kind, const std::string& action,
                     const std::string& checkpoint, int64_t rewound_to,
                     const std::string& message) {
  Alert a;
  a.step = r.step;
  a.kind = kind;
  a.loss = r.loss;
  a.baseline = r.guard.baseline;
  a.threshold = r.guard.threshold;
  a.grad_norm = r.grad_norm;
  a.max_attn_logit = r.max_attn_logit;
  a.max_attn_logit_layer = r.max_attn_logit_layer;
  a.action = action;
  a.checkpoint = checkpoint;
  // So far in the run (a rewind's own count is in its message).
  const uint64_t batch = static_cast<uint64_t>(cfg_.train().global_batch());
  for (const SkippedRange& sk : state_->guard.skipped) {
    a.batches_skipped += static_cast<int64_t>(sk.n / batch);
  }
  if (rewound_to >= 0) a.rewound_to = rewound_to;
  if (opts_.interactive && topo_.world_rank == 0) std::printf("\n");  // off the redrawn line
  if (tensorboard_) {
    // alerts/<kind>: the value behind the event (the loss, or the gradient norm for a
    // gradient-norm event); alerts/text: the human line.
    const bool grad = kind == "grad_spike" || kind == "nonfinite_grad";
    tensorboard_->scalar("alerts/" + kind, r.step, static_cast<float>(grad ? r.grad_norm : r.loss),
                         a.time);
    tensorboard_->text("alerts/text", r.step, alert_human_line(a), a.time);
  }
  a.rewinds = static_cast<int>(state_->guard.rewinds.size());
  a.message = message;
  if (alerts_) alerts_->emit(a);
}

StepResult Trainer::compute_gradients() {
  const int64_t global_batch = cfg_.train().global_batch();
  ParamStore& ps = model_->params();
  StepResult r;
  const int64_t step = state_->step + 1;
  const auto& dbg = cfg_.debug();
  // Each injection fires once per step number: a step replayed after a rewind is not hit again
  // (a real bad batch would have been skipped), also in a process resumed after the rewind (the
  // rewinds are part of the run state).
  const std::vector<int64_t>& rewinds = state_->guard.rewinds;
  const int64_t replayed_up_to =
      rewinds.empty() ? 0 : *std::max_element(rewinds.begin(), rewinds.end());
  auto injected = [&](int32_t at, int64_t& fired) {
    const bool due = at > 0 && (step == at || (dbg.inject_every() > 0 && step > at &&
                                               (step - at) % dbg.inject_every() == 0));
    if (!due || step <= fired || step <= replayed_up_to) return false;
    fired = step;
    return true;
  };
  const bool inject_spike = injected(dbg.inject_spike_at_step(), spike_fired_);
  const bool inject_nan = injected(dbg.inject_nan_at_step(), nan_fired_);
  r.lr = static_cast<float>(learning_rate(cfg_.optim(), state_->step, cfg_.train().steps()) *
                            guard_.lr_factor(state_->guard, step) *
                            (inject_spike ? dbg.inject_factor() : 1.0));
  ps.zero_grads();
  // Global sample stream: this step's samples are [first, first + global_batch); DP rank d takes
  // its contiguous slice, so the data a step sees does not depend on dp. Ranges the spike guard
  // skipped are never read again, even after a rewind to before them.
  uint64_t first = state_->sampler.next_sample;
  for (bool moved = true; moved;) {
    moved = false;
    for (const SkippedRange& sk : state_->guard.skipped) {
      if (first < sk.first_sample + sk.n &&
          sk.first_sample < first + static_cast<uint64_t>(global_batch)) {
        first = sk.first_sample + sk.n;
        moved = true;
      }
    }
  }
  r.first_sample = first;
  const uint64_t per_rank = static_cast<uint64_t>(global_batch / topo_.dp);
  const uint64_t rank_first = first + static_cast<uint64_t>(topo_.dp_rank) * per_rank;
  // Each rank's loss is the mean over its micro-batches; summing gradients over DP ranks then
  // gives the global-batch mean.
  // debug.inject_nan_at_step: every gradient of the step becomes NaN (the loss stays finite).
  const float loss_weight = inject_nan ? std::numeric_limits<float>::quiet_NaN()
                                       : 1.0f / static_cast<float>(accum_ * topo_.dp);
  double stats[3] = {0.0, 0.0, 0.0};  // ce, z, log Z summed over micro-batches
  r.max_attn_logit_layers.assign(static_cast<size_t>(model_->dims().L), 0.0f);
  for (int64_t m = 0; m < accum_; ++m) {
    sampler_.fill_samples(rank_first + m * micro_, micro_, inputs_.data(), targets_.data());
    const LossStats st = model_->forward(inputs_.data(), targets_.data(), micro_, loss_weight);
    const bool last = m + 1 == accum_;
    if (last && grad_sync_) {
      grad_sync_->begin();
      model_->set_grad_ready_hook([this](int id) { grad_sync_->ready(id); });
    }
    const double tb = omp_get_wtime();
    model_->backward(loss_weight);
    r.backward_s = omp_get_wtime() - tb;
    model_->set_grad_ready_hook({});
    stats[0] += st.ce;
    stats[1] += st.z_loss;
    stats[2] += st.log_z;
    for (size_t l = 0; l < st.max_attn_logit_layers.size(); ++l) {
      r.max_attn_logit_layers[l] =
          std::max(r.max_attn_logit_layers[l], st.max_attn_logit_layers[l]);
    }
  }
  state_->sampler.next_sample = first + static_cast<uint64_t>(global_batch);
  float* grads = ps.grads().f32();
  const ZeroPartition& part = state_->partition();
  {
    ProfileScope p(&model_->profiler(), "dp.grad_sync");
    // Gains shared by all heads: each TP rank's gradient covers its own heads. Summing over TP
    // commutes with the DP sum, so it runs after the overlapped DP sync or before ZeRO's
    // reduce-scatter.
    auto reduce_tp_partials = [&] {
      for (int id : tp_partial_ids_) {
        topo_.tp_tensors().all_reduce(ps.grad(id), ps.info(id).numel(), ReduceOp::kSum);
      }
    };
    if (grad_sync_) {
      grad_sync_->finish();
      r.comm_exposed_s = grad_sync_->exposed_seconds();
      r.comm_window_s = grad_sync_->window_seconds();
      reduce_tp_partials();
    } else if (part.sharded()) {
      reduce_tp_partials();
      topo_.dp_tensors().reduce_scatter(grads, shard_grads_.f32(), part.mine().n);
    } else {
      reduce_tp_partials();
    }
  }
  // Loss statistics: identical on every rank (every rank decides alike).
  if (topo_.world_comm) {
    topo_.world_comm->all_reduce(stats, 3, ReduceOp::kSum);
    for (double& s : stats) s /= topo_.world_size;  // TP ranks of one replica hold the same values
    // Each layer's largest logit over the ranks' heads (TP) and data (DP).
    topo_.world_comm->all_reduce(r.max_attn_logit_layers.data(),
                                 static_cast<int64_t>(r.max_attn_logit_layers.size()),
                                 ReduceOp::kMax);
  }
  // The step's largest logit and the first block holding it.
  const std::vector<float>& layers = r.max_attn_logit_layers;
  for (float m : layers) r.max_attn_logit = std::max(r.max_attn_logit, m);
  const auto top = std::find(layers.begin(), layers.end(), r.max_attn_logit);
  if (top != layers.end()) r.max_attn_logit_layer = static_cast<int>(top - layers.begin());
  r.loss = stats[0] / static_cast<double>(accum_);
  r.z_loss = stats[1] / static_cast<double>(accum_);
  r.log_z = stats[2] / static_cast<double>(accum_);
  {
    ProfileScope p(&model_->profiler(), "optimizer");
    double sq;
    if (part.sharded()) {
      sq = grad_sum_squares(shard_grads_.f32(), part.mine());
      topo_.world_comm->all_reduce(&sq, 1, ReduceOp::kSum);
    } else {
      sq = grad_sum_squares(grads, part.mine());
      topo_.tp_comm->all_reduce(&sq, 1, ReduceOp::kSum);
    }
    r.grad_norm = std::sqrt(sq);
  }
  return r;
}

void Trainer::apply_update(const StepResult& r) {
  ProfileScope p(&model_->profiler(), "optimizer");
  ParamStore& ps = model_->params();
  const ZeroPartition& part = state_->partition();
  const float scale = clip_scale(r.grad_norm, cfg_.optim().grad_clip());
  float* params = ps.params().f32();
  if (part.sharded()) {
    opt_->step(params + part.mine().offset, shard_grads_.f32(), r.lr, scale);
    topo_.dp_tensors().all_gather(params + part.mine().offset, params, part.mine().n);
  } else {
    opt_->step(params, ps.grads().f32(), r.lr, scale);
  }
}

double Trainer::evaluate() {
  if (!data_.has_val()) return std::nan("");
  const int64_t batches = std::max(1, cfg_.train().eval_batches());
  const int64_t n = batches * cfg_.train().global_batch() / topo_.dp;
  double ce = 0.0;
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += micro_) {
    const int64_t b = std::min(micro_, n - i);
    sampler_.fill_val(topo_.dp_rank * n + i, b, inputs_.data(), targets_.data());
    ce += model_->forward(inputs_.data(), targets_.data(), b).ce * static_cast<double>(b);
    count += b;
  }
  double sums[2] = {ce, static_cast<double>(count)};
  if (topo_.world_comm) topo_.world_comm->all_reduce(sums, 2, ReduceOp::kSum);
  last_val_ = sums[0] / sums[1];
  evaluated_ = true;
  return last_val_;
}

double Trainer::epochs_done() const {
  return static_cast<double>(state_->sampler.next_sample) /
         static_cast<double>(sampler_.windows_per_epoch());
}

void Trainer::log_step(const StepResult& r, std::optional<double> val_loss) {
  const int64_t tokens = r.step * tokens_per_step();
  const double tps =
      window_seconds_ > 0 ? static_cast<double>(window_tokens_) / window_seconds_ : 0;
  if (metrics_) {
    JsonObject o;
    o.add("step", r.step)
        .add("loss", r.loss)
        .add("z_loss", r.z_loss)
        .add("log_z", r.log_z)
        .add("grad_norm", r.grad_norm)
        .add_f("lr", r.lr)
        .add("tokens", tokens)
        .add("tokens_per_s", tps)
        .add_f("max_attn_logit", r.max_attn_logit);
    if (r.max_attn_logit_layer >= 0) {
      o.add("max_attn_logit_layer", static_cast<int64_t>(r.max_attn_logit_layer));
    } else {
      o.add_null("max_attn_logit_layer");  // a non-finite maximum
    }
    o.add("epoch", epochs_done());
    if (val_loss) o.add("val_loss", *val_loss);
    // JSON has no NaN: such values are written as null, and named here.
    std::string nonfinite;
    for (const auto& [name, v] : {std::pair<const char*, double>{"loss", r.loss},
                                  {"z_loss", r.z_loss},
                                  {"log_z", r.log_z},
                                  {"grad_norm", r.grad_norm},
                                  {"max_attn_logit", r.max_attn_logit}}) {
      if (!std::isfinite(v)) {
        nonfinite += std::string(nonfinite.empty() ? "" : " ") + name + "=" +
                     (std::isnan(v) ? "nan"
                      : v > 0       ? "inf"
                                    : "-inf");
      }
    }
    if (!nonfinite.empty()) o.add("nonfinite", nonfinite);
    if (r.guard.anomaly != Anomaly::kNone) {
      o.add("anomaly", std::string(anomaly_name(r.guard.anomaly)));
      o.add("guard", std::string(r.rewound ? "rewind" : halted_ ? "halt" : "skip"));
    }
    metrics_->write(o);
  }
  if (tensorboard_) {
    const double now = TensorBoardWriter::now();
    tensorboard_->scalar("train/loss", r.step, static_cast<float>(r.loss), now);
    tensorboard_->scalar("train/z_loss", r.step, static_cast<float>(r.z_loss), now);
    tensorboard_->scalar("train/log_z", r.step, static_cast<float>(r.log_z), now);
    tensorboard_->scalar("train/grad_norm", r.step, static_cast<float>(r.grad_norm), now);
    tensorboard_->scalar("train/lr", r.step, r.lr, now);
    tensorboard_->scalar("train/tokens_per_s", r.step, static_cast<float>(tps), now);
    tensorboard_->scalar("train/max_attn_logit", r.step, r.max_attn_logit, now);
    // Which layer's attention logits grow: one curve per block (attn_logit/layer_00, ...).
    for (size_t l = 0; l < r.max_attn_logit_layers.size(); ++l) {
      char tag[40];
      std::snprintf(tag, sizeof(tag), "attn_logit/layer_%02zu", l);
      tensorboard_->scalar(tag, r.step, r.max_attn_logit_layers[l], now);
    }
    if (val_loss) tensorboard_->scalar("val/loss", r.step, static_cast<float>(*val_loss), now);
    flush_tensorboard();
  }
  if (!opts_.progress || topo_.world_rank != 0) return;
  if (!said_attention_) {
    // Known once the first step has run its attention: cuDNN's fused SDPA, or keel's kernel and
    // why cuDNN's was not taken.
    const std::string path = exec_->attention_path();
    if (!path.empty()) {
      said_attention_ = true;
      std::printf("keel-train: attention: %s\n", path.c_str());
    }
  }
  const int64_t total = cfg_.train().steps();
  const double elapsed = omp_get_wtime() - run_t0_;
  const double eta = elapsed / static_cast<double>(std::max<int64_t>(1, r.step - start_step_)) *
                     static_cast<double>(total - r.step);
  char line[256];
  std::snprintf(line, sizeof(line),
                "step %5lld/%lld | loss %.4f | z %.2e | gnorm %.3f | lr %.2e | %7.0f tok/s | "
                "max logit %.1f (layer %d) | ETA %s",
                static_cast<long long>(r.step), static_cast<long long>(total), r.loss, r.z_loss,
                r.grad_norm, r.lr, tps, r.max_attn_logit, r.max_attn_logit_layer,
                human_seconds(eta).c_str());
  std::string s = line;
  if (val_loss) {
    char v[48];
    std::snprintf(v, sizeof(v), " | val %.4f", *val_loss);
    s += v;
  }
  if (opts_.interactive && !val_loss && r.step != total) {
    std::printf("\r%s\033[K", s.c_str());
  } else {
    std::printf("%s%s\n", opts_.interactive ? "\r" : "", s.c_str());
  }
  std::fflush(stdout);
}

void Trainer::run() {
  const auto& t = cfg_.train();
  run_t0_ = omp_get_wtime();
  const int every = cfg_.checkpoint().every();
  while (state_->step < t.steps()) {
    const StepResult r = step();
    window_seconds_ += r.seconds;
    window_tokens_ += tokens_per_step();
    const bool last = r.step == t.steps() && !r.rewound;
    const bool eval = t.eval_every() > 0 && (r.step % t.eval_every() == 0 || last) && !r.rewound;
    std::optional<double> val;
    if (eval && data_.has_val()) val = evaluate();
    // Every step the spike guard flagged is logged, whatever train.log_every says.
    if (r.step % std::max(1, t.log_every()) == 0 || last || val ||
        r.guard.anomaly != Anomaly::kNone) {
      log_step(r, val);
      window_seconds_ = 0.0;
      window_tokens_ = 0;
    }
    if (halted_) {
      flush_tensorboard();
      alerts_->drain();
      return;
    }
    // No periodic save while the guard sees anomalies (the state may be what spiked), nor of a
    // step the guard rewound from.
    if (store_ && every > 0 && !r.rewound &&
        ((r.step % every == 0 && state_->guard.streak == 0) || last)) {
      save_checkpoint();
    }
    const StepControl c = agree_on_control();
    if (async_ && async_->pending() && !c.writes_running) finish_checkpoint();
    if (c.stop_signal != 0) {
      stop_for_signal(c);
      flush_tensorboard();
      return;  // queued hooks are not waited for: the cluster's grace period is short
    }
  }
  finish_checkpoint();
  flush_tensorboard();
  alerts_->drain();
}

void Trainer::stop_for_signal(const StepControl& c) {
  finish_checkpoint();
  stopped_by_signal_ = c.stop_signal;
  const char* name = c.stop_signal == SIGTERM   ? "SIGTERM"
                     : c.stop_signal == SIGUSR1 ? "SIGUSR1"
                                                : "a stop signal";
  char line[400];
  if (!store_) {
    std::snprintf(line, sizeof(line),
                  "stopped by %s (rank %d) after step %lld: no run directory, "
                  "nothing saved",
                  name, c.signalled_rank, static_cast<long long>(state_->step));
    say(line);
    return;
  }
  // The step's checkpoint, synchronously (the process is about to exit), unless it exists.
  if (saved_step_ != state_->step) save_now();
  std::snprintf(line, sizeof(line),
                "stopped by %s (received by rank %d) after step %lld: checkpoint %s saved; run the "
                "same command to resume",
                name, c.signalled_rank, static_cast<long long>(state_->step),
                store_->path_of(state_->step).c_str());
  say(line);
}

void Trainer::flush_tensorboard() {
  if (!tensorboard_) return;
  tensorboard_->flush();
  if (auto failure = tensorboard_->take_failure()) {
    std::fprintf(stderr, "keel-train: %s\n", failure->c_str());
    std::fflush(stderr);
  }
}

std::string Trainer::sample(int64_t n_chars, uint64_t seed, float temperature) {
  const ModelDims& d = model_->dims();
  KEEL_CHECK(topo_.tp == 1, kUsage, "sampling reads whole logit rows: it needs parallel.tp=1");
  const int64_t T = d.T;
  std::string out;
  // Prompt: the start of a validation window (or of the training data), so the model continues
  // text in its own domain.
  const TokenStream& src = data_.has_val() ? data_.val() : data_.train();
  int64_t len = std::min<int64_t>(16, src.size());
  std::vector<int32_t> ctx(len);  // the whole text so far; len == ctx.size() throughout
  src.copy(0, len, ctx.data());
  for (int64_t i = 0; i < len; ++i) out += static_cast<char>(ctx[i]);
  std::vector<double> p(d.V);
  for (int64_t i = 0; i < n_chars; ++i) {
    const int64_t start = std::max<int64_t>(0, len - T);
    std::vector<int32_t> window(ctx.begin() + start,
                                ctx.begin() + std::min<int64_t>(len, start + T));
    window.resize(T, 0);
    model_->forward(window.data(), nullptr, 1);
    const std::vector<float> row = model_->logits_row(len - start - 1);  // the last position
    double mx = -1e300, sum = 0.0;
    for (int64_t v = 0; v < d.V; ++v) mx = std::max(mx, static_cast<double>(row[v]) / temperature);
    for (int64_t v = 0; v < d.V; ++v) sum += p[v] = std::exp(row[v] / temperature - mx);
    const double u = philox_uniform(seed, fnv1a64("sample"), static_cast<uint64_t>(i)) * sum;
    double acc = 0.0;
    int32_t tok = static_cast<int32_t>(d.V - 1);
    for (int64_t v = 0; v < d.V; ++v) {
      acc += p[v];
      if (u < acc) {
        tok = static_cast<int32_t>(v);
        break;
      }
    }
    ctx.push_back(tok);
    ++len;
    out += static_cast<char>(tok);
  }
  return out;
}

}  // namespace keel
