// The training loop: a step in phases (compute gradients, decide, carry out the verdict, apply),
// evaluation, checkpoint saves and the end-of-step agreement. See trainer.h.
#include "launch/train/trainer.h"

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
#include "launch/train/fault_injector.h"
#include "launch/train/forensics.h"
#include "launch/train/sampling.h"
#include "parallel/agree.h"
#include "parallel/staging_communicator.h"

namespace keel {

void Trainer::say(const std::string& line) const {
  if (topo_.world_rank != 0 || !opts_.progress) return;
  std::printf("keel-train: %s\n", line.c_str());
  std::fflush(stdout);
}

std::optional<int64_t> Trainer::resume() {
  // Note [one rank decides]: rank 0 takes the run directory's lock and picks; every rank learns
  // the verdict, or that rank 0 could not decide (then every rank throws the same kind).
  const ResumeVerdict v = agree(topo_.world_comm, 0, "resume", [&] {
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
    return resumer_->decide();
  });
  if (!v.from_checkpoint) return std::nullopt;
  const std::string dir = resumer_->dir_of(v);
  const ckpt::Manifest m = load_checkpoint(dir, *state_);
  char line[256];
  std::snprintf(line, sizeof(line), "resuming from %s at step %lld (written at dp %d x tp %d%s)",
                dir.c_str(), static_cast<long long>(m.step()), m.layout().dp(), m.layout().tp(),
                m.layout().zero_stage() ? ", ZeRO-1" : "");
  say(line);
  return m.step();
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
  last_save_wtime_ = omp_get_wtime();
  timed_save_due_ = false;
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
  last_save_wtime_ = t0;
  timed_save_due_ = false;
  keel::save_checkpoint(*state_, cfg_, topo_, *store_, save_hook(),
                        [this](int64_t s) { return rewinder_->pinned(s); });
  saved_step_ = state_->step;
  failed_save_.reset();
  log_.sync();
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
  log_.sync();
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
  // Every rank's [stop signal number, whether it has one, async write still running, a timed
  // save due by its clock]: one small all-gather per step, so that every rank stops, commits and
  // saves at the same step. Only rank 0's clock counts for the timed save.
  const int sig = opts_.stop_signal ? opts_.stop_signal() : 0;
  const double minutes = cfg_.checkpoint().every_minutes();
  const bool due = store_ && minutes > 0 && omp_get_wtime() - last_save_wtime_ >= minutes * 60.0;
  const std::vector<int64_t> mine = {sig, sig ? 1 : 0,
                                     async_ && async_->pending() && !async_->done_locally(), due};
  const std::vector<int64_t> table =
      topo_.world_size > 1 ? every_rank(topo_.world_comm, mine) : mine;
  StepControl c;
  for (int r = 0; r < static_cast<int>(table.size() / mine.size()); ++r) {
    const int64_t* row = &table[r * mine.size()];
    c.stop_signal = std::max(c.stop_signal, static_cast<int>(row[0]));
    if (row[1] != 0) c.signalled_rank = topo_.world_size > 1 ? r : topo_.world_rank;
    c.writes_running = c.writes_running || row[2] != 0;
    if (r == 0) c.save_due = row[3] != 0;
  }
  return c;
}

double Trainer::grad_sum_squares(const float* grads, ArenaSlice range) const {
  // Global-norm contributions of this rank's moments slice (grads[0] is arena element
  // range.offset): a TP-sharded parameter counts on every TP rank (each holds a different
  // slice), a replicated one on TP rank 0 only.
  // Summed on the device in one call over the table (the CPU: per tensor in parameter order, as
  // before; a GPU: 2 launches, Note [multi-tensor norm]), then one 8-byte read. The table is a
  // few hundred entries, built on the host each step.
  std::vector<kernels::NormSegment> segments;
  segments.reserve(state_->tensors().size());
  for (const StateParam& p : state_->tensors()) {
    if (!p.info->sharded() && topo_.tp_rank != 0) continue;
    if (!p.moments.empty()) segments.push_back({p.moments.offset - range.offset, p.moments.n});
  }
  double sq = 0.0;
  if (segments.empty()) return sq;
  exec_->sum_squares_segments(grads, segments.data(), static_cast<int64_t>(segments.size()),
                              grad_sq_.f64());
  grad_sq_.copy_to_host(0, 1, &sq);
  return sq;
}

StepResult Trainer::step() {
  const double t0 = omp_get_wtime();
  faults_.at(FaultPoint::kStepBegin, state_->step + 1);
  if (opts_.watchdog) opts_.watchdog->set_step(state_->step + 1);
  StepResult r = compute_gradients();
  const Verdict v = decide(r);
  if (v.what == StepDecision::kApply) apply_update(r);
  if (injection_.param_bitflip) {
    const Tensor& params = model_->params().params();
    // The lowest mantissa bit: a corruption too small to spike, which only the replica check
    // (Note [replica check]) sees.
    const int64_t at = flip_bit(params, 0, params.numel(), 0);
    std::fprintf(stderr,
                 "keel-train: debug.inject_param_bitflip_at_step=%lld: rank %d flips bit 0 of "
                 "its parameter element %lld\n",
                 static_cast<long long>(state_->step + 1), topo_.world_rank,
                 static_cast<long long>(at));
    std::fflush(stderr);
  }
  r.step = ++state_->step;
  carry_out(v, r);
  // A device runs the optimizer's update after the host has moved on: the step's time includes
  // it (a no-op on the CPU).
  exec_->synchronize();
  r.seconds = omp_get_wtime() - t0;
  last_ = r;
  return r;
}

Verdict Trainer::decide(StepResult& r) {
  // Every input of this decision is all-reduced, so every rank decides alike (DESIGN.md 5).
  const GuardState before = state_->guard;
  r.guard = guard_.observe(state_->guard, state_->step + 1, r.first_sample, r.loss, r.grad_norm);
  const int replay_every = cfg_.spike().replay_every();
  const bool sampled = replay_every > 0 && (state_->step + 1) % replay_every == 0;
  if (r.guard.anomaly != Anomaly::kNone || sampled) {
    if (cfg_.spike().replay() || sampled) {
      if (std::optional<Verdict> stop = replay(r, before)) return *stop;
    } else {
      if (keeps_evidence()) keep_evidence(r, nullptr, layer_grad_norms());
    }
  }
  // Bounded: a streak of skipped updates that no rewind ends (none possible, or every rewind
  // lands back in it) halts rather than skip forever and end "done".
  const int64_t max_skipped = cfg_.spike().max_skipped_steps();
  if (r.guard.action != GuardAction::kApply && state_->guard.streak > max_skipped) {
    return {StepDecision::kHalt,
            std::to_string(state_->guard.streak) +
                " consecutive anomalous steps, more than spike.max_skipped_steps=" +
                std::to_string(max_skipped) + " (from step " +
                std::to_string(state_->guard.streak_first) + "; no rewind ended them)"};
  }
  switch (r.guard.action) {
    case GuardAction::kApply:
      return {StepDecision::kApply, ""};
    case GuardAction::kSkip:
      return {StepDecision::kSkip, ""};
    case GuardAction::kRewind:
      // Retry a failed rewind only every spike.patience anomalous steps.
      if ((state_->guard.streak - cfg_.spike().patience()) % cfg_.spike().patience() != 0) {
        return {StepDecision::kSkip, ""};
      }
      if (guard_.halt_due(state_->guard, state_->step + 1)) {
        return {StepDecision::kHalt,
                "more than spike.max_rewinds=" + std::to_string(cfg_.spike().max_rewinds()) +
                    " rewinds within spike.rewind_window=" +
                    std::to_string(cfg_.spike().rewind_window()) + " steps"};
      }
      return {StepDecision::kRewind, ""};
  }
  return {StepDecision::kApply, ""};
}

void Trainer::carry_out(const Verdict& v, StepResult& r) {
  const std::string anomaly = anomaly_name(r.guard.anomaly);
  switch (v.what) {
    case StepDecision::kApply:
      return;
    case StepDecision::kSkip:
      report(r, anomaly, "skip", "", -1,
             anomaly + ": update skipped (" + std::to_string(state_->guard.streak) +
                 " of spike.patience=" + std::to_string(cfg_.spike().patience()) +
                 " before a rewind)");
      return;
    case StepDecision::kHardwareStop:
      // The state in memory is the last good one (the update was not applied): saved as the
      // state before the step, so a run resumed elsewhere computes the step again on its batch.
      --state_->step;
      state_->sampler.next_sample = step_start_sample_;
      if (store_) save_checkpoint();
      finish_checkpoint();
      halted_ = true;
      hardware_stop_ = true;
      return;
    case StepDecision::kRewind:
    case StepDecision::kHalt:
      break;
  }
  const bool halt = v.what == StepDecision::kHalt;
  finish_checkpoint();  // a save in flight is committed (and discarded if it is newer)
  const RewindOutcome o = rewinder_->rewind(r, halt, v.why);
  if (!o.kind.empty()) report(r, o.kind, o.action, o.checkpoint, o.rewound_to, o.message);
  if (o.restored) {
    // Note [durable rewind] (rewinder.h): the rewound state (the target's parameters with the
    // guard's new record: the skipped range, the rewind count, the cool-down) is committed
    // before training goes on, over the target's own directory; a crash or a stop signal from
    // here on resumes into it, so spike.max_rewinds holds across restarts and the bad data stays
    // skipped. The alert comes first: a crash before the commit resumes from the target as it
    // was, drops the alert with the steps after it (they are replayed) and rewinds again; after
    // the commit, the resumed run keeps the alerts up to the rewind's step.
    save_now();
    faults_.at(FaultPoint::kAfterRewind, r.step);
  }
  if (halt) {
    // Without a checkpoint to restore, the state in memory is the last good one: every update
    // of the streak was skipped.
    if (!o.restored && store_) save_checkpoint();
    finish_checkpoint();
    halted_ = true;
  } else if (o.restored) {
    r.rewound = true;
  } else {
    report(
        r, anomaly, "skip", "", -1,
        anomaly + ": update skipped; no rewind (" +
            (store_ ? "no verified checkpoint at or before step " +
                          std::to_string(state_->guard.streak_first - cfg_.spike().rewind_margin())
                    : std::string("no run directory")) +
            ")");
  }
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
  log_.alert(r, a);
  a.rewinds = static_cast<int>(state_->guard.rewinds.size());
  a.message = message;
  if (alerts_) alerts_->emit(a);
  if (topo_.world_rank == 0 && !opts_.run_dir.empty()) {
    append_anomaly_alert(opts_.run_dir + "/anomalies", a.step, alert_json(a));
  }
}

StepResult Trainer::compute_gradients(const FaultInjector::Injection* replay_of) {
  const int64_t global_batch = cfg_.train().global_batch();
  ParamStore& ps = model_->params();
  StepResult r;
  const int64_t step = state_->step + 1;
  // debug.inject_*: once per step number, never on a step replayed after a rewind. A replay of
  // the step (Note [replay]) repeats what models the data (a spike, NaN gradients), not the bit
  // flip that models the hardware.
  FaultInjector::Injection inject =
      replay_of ? *replay_of : faults_.inject(step, state_->guard.rewinds);
  if (replay_of) inject.bitflip = false;
  if (!replay_of) step_start_sample_ = state_->sampler.next_sample;
  injection_ = inject;
  r.lr = static_cast<float>(learning_rate(cfg_.optim(), state_->step, cfg_.train().steps()) *
                            guard_.lr_factor(state_->guard, step) *
                            (inject.spike ? faults_.spike_factor() : 1.0));
  ps.zero_grads();
  // Global sample stream: this step's samples are [first, first + global_batch); DP rank d takes
  // its contiguous slice, so the data a step sees does not depend on dp. Ranges the spike guard
  // skipped are never read again, even after a rewind to before them.
  const uint64_t first = first_unskipped_sample(
      state_->sampler.next_sample, static_cast<uint64_t>(global_batch), state_->guard.skipped);
  r.first_sample = first;
  const uint64_t per_rank = static_cast<uint64_t>(global_batch / topo_.dp);
  const uint64_t rank_first = first + static_cast<uint64_t>(topo_.dp_rank) * per_rank;
  // Each rank's loss is the mean over its micro-batches; summing gradients over DP ranks then
  // gives the global-batch mean.
  // debug.inject_nan_at_step: every gradient of the step becomes NaN (the loss stays finite).
  const float loss_weight = inject.nan ? std::numeric_limits<float>::quiet_NaN()
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
    if (!st.act_sq_layers.empty()) {
      r.act_sq_layers.resize(st.act_sq_layers.size(), 0.0);
      for (size_t l = 0; l < st.act_sq_layers.size(); ++l)
        r.act_sq_layers[l] += st.act_sq_layers[l];
    }
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
  if (inject.bitflip) {
    // After every collective: only this rank's own gradients change (Note [replay]).
    int64_t n = 0;
    const Tensor& g = held_grads(&n);
    const int64_t at = flip_bit(g, 0, n, 30);
    std::fprintf(stderr,
                 "keel-train: debug.inject_bitflip_at_step=%lld: rank %d flips bit 30 of its "
                 "gradient element %lld\n",
                 static_cast<long long>(step), topo_.world_rank, static_cast<long long>(at));
    std::fflush(stderr);
  }
  std::copy(stats, stats + 3, r.local_stats);
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
      if (topo_.dp > 1) {
        // DP replicas hold the same gradients by construction, so each computes the same norm;
        // but a replica whose gradients were corrupted would see another one and decide
        // differently from the rest (and hang them: Note [replay]). The largest over the world,
        // with any non-finite one winning, keeps every rank deciding alike; for equal norms it
        // changes no bit.
        double worst[2] = {std::isfinite(sq) ? sq : 0.0, std::isfinite(sq) ? 0.0 : 1.0};
        topo_.world_comm->all_reduce(worst, 2, ReduceOp::kMax);
        sq = worst[1] > 0 ? std::numeric_limits<double>::quiet_NaN() : worst[0];
      }
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

void Trainer::run() {
  const auto& t = cfg_.train();
  log_.start(omp_get_wtime());
  const int every = cfg_.checkpoint().every();
  // Note [timed saves]: checkpoint.every_minutes (on by default) saves at the first step end
  // after that much wall-clock time since the last save, so a long run can always resume and the
  // guard always has a checkpoint to rewind to. Clocks differ across ranks, so rank 0's verdict
  // travels in the end-of-step agreement and applies at the next step end, on every rank alike.
  const bool periodic = every > 0 || cfg_.checkpoint().every_minutes() > 0;
  last_save_wtime_ = omp_get_wtime();
  timed_save_due_ = false;
  while (state_->step < t.steps()) {
    const StepResult r = step();
    log_.count(r.seconds, tokens_per_step());
    const bool last = r.step == t.steps() && !r.rewound;
    const bool eval = t.eval_every() > 0 && (r.step % t.eval_every() == 0 || last) && !r.rewound;
    std::optional<double> val;
    if (eval && data_.has_val()) val = evaluate();
    // Every step the spike guard flagged is logged, whatever train.log_every says.
    if (r.step % std::max(1, t.log_every()) == 0 || last || val ||
        r.guard.anomaly != Anomaly::kNone) {
      log_.step(r, val, tokens_per_step(), epochs_done(), halted_, *exec_, omp_get_wtime());
    }
    if (halted_) {
      log_.flush();
      alerts_->drain();
      return;
    }
    // No periodic save while the guard sees anomalies (the state may be what spiked), nor of a
    // step the guard rewound from.
    const bool due = (every > 0 && r.step % every == 0) || timed_save_due_;
    if (store_ && periodic && !r.rewound && ((due && state_->guard.streak == 0) || last)) {
      if (!check_replicas()) {
        log_.flush();
        alerts_->drain();
        return;
      }
      save_checkpoint();
    }
    const StepControl c = agree_on_control();
    timed_save_due_ = timed_save_due_ || c.save_due;
    if (async_ && async_->pending() && !c.writes_running) finish_checkpoint();
    if (c.stop_signal != 0) {
      stop_for_signal(c);
      log_.flush();
      return;  // queued hooks are not waited for: the cluster's grace period is short
    }
  }
  finish_checkpoint();
  log_.flush();
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

std::string Trainer::sample(int64_t n_chars, uint64_t seed, float temperature) {
  return sample_text(*model_, data_, topo_, n_chars, seed, temperature);
}

}  // namespace keel
