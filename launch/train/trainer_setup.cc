// How a Trainer is built: the data (checked equal on every rank), the execution context and the
// tensor communicators, the model, the optimizer and the run state, the checkpoint store, then
// the resume and the run directory's files.
#include <bit>
#include <filesystem>
#include <vector>

#include "framework/config/config.h"
#include "framework/data/fingerprint.h"
#include "framework/error.h"
#include "framework/file_io.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/gemm.h"
#include "launch/train/trainer.h"
#include "parallel/agree.h"
#include "parallel/staging_communicator.h"

namespace keel {

Trainer::Trainer(const config::KeelConfig& cfg, const Topology& topo, TrainerOptions opts)
    : cfg_(cfg),
      topo_(topo),
      opts_(std::move(opts)),
      data_(Dataset::open(cfg)),
      sampler_(data_, cfg),
      faults_(cfg.debug(), topo.world_rank),
      guard_(cfg.spike()),
      log_(cfg_, opts_.run_dir, topo.world_rank == 0, opts_.progress, opts_.interactive) {
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
  setup_exec_and_comms();
  build_model_and_state(train_fp, val_fp);
  open_run_dir();
}

void Trainer::setup_exec_and_comms() {
  const auto& t = cfg_.train();
  const Device device = kernels::resolve_device(t.device());
  exec_ = kernels::make_exec(device, device == Device::kCpu ? 0 : opts_.device_index);
  exec_->set_precision(kernels::resolve_precision(t.precision(), device));
  exec_->set_determinism(t.deterministic() ? kernels::Determinism::kBitwise
                                           : kernels::Determinism::kFast);
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
}

void Trainer::build_model_and_state(uint64_t train_fp, uint64_t val_fp) {
  const auto& t = cfg_.train();
  const Device device = exec_->device();
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
}

void Trainer::open_run_dir() {
  if (!opts_.run_dir.empty()) {
    store_ = std::make_unique<CheckpointStore>(opts_.run_dir + "/checkpoints");
    if (cfg_.checkpoint().async()) {
      async_ = std::make_unique<AsyncCheckpointWriter>(
          cfg_, topo_, *store_, save_hook(), [this](int64_t s) { return rewinder_->pinned(s); });
    }
  }
  resumer_ = std::make_unique<Resumer>(cfg_, *state_, store_.get(), opts_.resume,
                                       [this](const std::string& line) { say(line); });
  rewinder_ = std::make_unique<Rewinder>(cfg_, topo_, *state_, store_.get(), *resumer_, guard_);
  resumed_from_ = resume();
  log_.set_start_step(state_->step);
  if (resumed_from_) saved_step_ = *resumed_from_;
  if (!opts_.run_dir.empty() && topo_.world_rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(opts_.run_dir, ec);
    KEEL_CHECK(!ec, kIo, opts_.run_dir, ": cannot create run directory: ", ec.message());
    write_file_atomic(opts_.run_dir + "/config.pbtxt", to_text(cfg_));
  }
  log_.open(resumed_from_, state_->guard.rewinds);
  // The guard's alerts: RUN/alerts.jsonl (continued on resume), stderr, alert.command.
  alerts_ = std::make_unique<AlertSink>(
      opts_.run_dir, cfg_.alert(), topo_.world_rank == 0,
      resumed_from_ ? AlertFileMode::kAppend : AlertFileMode::kTruncate);
}

void Trainer::check_same_data_on_every_rank(uint64_t train_fp, uint64_t val_fp) const {
  // Every rank opened the data itself: a node with other files would silently train on another
  // stream. Each rank contributes (size, fingerprint) of both splits, and every rank compares the
  // gathered table with rank 0's row, so all of them reach the same verdict and rank 0 names the
  // first rank that differs.
  constexpr int kWords = 4;
  const std::vector<int64_t> table =
      every_rank(topo_.world_comm,
                 {static_cast<int64_t>(data_.train().size()), std::bit_cast<int64_t>(train_fp),
                  static_cast<int64_t>(data_.val().size()), std::bit_cast<int64_t>(val_fp)});
  auto word = [&](int rank, int w) {
    return std::bit_cast<uint64_t>(table[static_cast<size_t>(rank * kWords + w)]);
  };
  const bool separate_val = !cfg_.data().val_path().empty();
  for (int r = 1; r < topo_.world_size; ++r) {
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

}  // namespace keel
