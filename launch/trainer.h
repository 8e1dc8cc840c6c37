// The training loop. A step runs in three phases: compute gradients (data -> micro-batch
// forward/backward with accumulation -> DP/TP gradient sync -> all-reduced loss and global norm)
// -> decide (apply; the spike guard's skip, rewind and halt plug in here) -> apply (clipping,
// AdamW, ZeRO-1 all-gather). Around it: metrics.jsonl, periodic validation, a progress line on
// rank 0 and text sampling from the trained model. Everything a step decides comes from
// (config, TrainState), so two runs with the same seed are bit-identical. The run's state lives in
// one TrainState (Note [run state]) that checkpoints save and load.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "checkpoints/async_writer.h"
#include "checkpoints/checkpoint.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"
#include "framework/data/dataset.h"
#include "framework/data/sampler.h"
#include "framework/metrics.h"
#include "framework/optim/optimizer.h"
#include "framework/tensorboard/tensorboard.h"
#include "launch/alerts.h"
#include "launch/fault_injector.h"
#include "launch/run_lock.h"
#include "launch/spike_guard.h"
#include "layers/gpt.h"
#include "parallel/grad_sync.h"
#include "parallel/watchdog.h"
#include "parallel/zero_partition.h"

namespace keel {

// Resume's check of the model a checkpoint was written with (`then`, its stored resolved config)
// against this run's (`now`): "" when they build the same model, else the reason naming the first
// model field that differs and both values. A checkpoint's tensor shapes cannot tell these: a
// smaller vocabulary still finds its rows, RMSNORM reads a LayerNorm's gain, a post-sublayer block
// a pre-norm one's weights. model.seq_len, max_positions, rope_theta and init_std may change
// (context extension; the shape check covers the position table), as may qk_norm_scope without a
// QK-norm. A config stored before some model fields existed (an enum reads UNSPECIFIED) has its
// zero-valued fields skipped: unknown, not different.
std::string changed_model_field(const config::Model& then, const config::Model& now);

struct StepResult {
  int64_t step = 0;     // 1-based optimizer step just taken
  double loss = 0.0;    // mean cross-entropy over the global batch, nats/token
  double z_loss = 0.0;  // z-loss term (coefficient included)
  double log_z = 0.0;   // mean log-partition of the output logits (logged with or without z-loss)
  double grad_norm = 0.0;  // global gradient norm before clipping
  float lr = 0.0f;
  float max_attn_logit = 0.0f;  // largest |scaled q.k| of the step, over layers, heads and ranks
  // [n_layers]: each block's largest |scaled q.k| of the step (over heads and ranks), and the
  // first block holding the step's largest (-1 without blocks)
  std::vector<float> max_attn_logit_layers;
  int max_attn_logit_layer = -1;
  double seconds = 0.0;         // wall time of the step
  double comm_exposed_s = 0.0;  // DP gradient sync time not hidden behind backward
  double comm_window_s = 0.0;   // from the first bucket's launch to the sync's end
  double backward_s = 0.0;      // time of the last micro-batch's backward (overlap window)
  uint64_t first_sample = 0;    // the step's first training sample
  GuardVerdict guard;           // the spike guard's verdict on the step
  bool rewound = false;         // the guard rewound after this step (state_->step went back)
};

// What the decide phase chose for the step's gradients.
enum class StepDecision {
  kApply,   // clip and update
  kSkip,    // an anomalous step: no update (Note [spike guard])
  kRewind,  // rewind to a checkpoint before the anomalies, skip their data
  kHalt,    // too many rewinds: restore the last good checkpoint and stop (exit 3)
};

// Where a run starts (keel-train's --no-resume, --overwrite, --resume-from).
enum class ResumeMode {
  kAuto,   // from RUN/checkpoints/LATEST when there is one (falling back past corrupt ones)
  kFresh,  // from scratch; refused when the run has checkpoints unless overwrite
  kFrom,   // from the checkpoint directory `path`; exit 2 when it is unusable
};

struct ResumeOptions {
  ResumeMode mode = ResumeMode::kAuto;
  bool overwrite = false;  // with kFresh: delete the run's checkpoints
  std::string path;        // with kFrom
};

// The TP and DP communicators for a device run's tensors (either may be null: the MPI group).
struct TensorComms {
  std::unique_ptr<Communicator> tp, dp;
};

struct TrainerOptions {
  std::string run_dir;       // empty: write no files (benchmarks, tests)
  bool progress = true;      // print progress lines (rank 0)
  bool interactive = false;  // progress redraws one terminal line instead of one line per log step
  Watchdog* watchdog = nullptr;  // told the current step, for its messages
  ResumeOptions resume;          // checkpoints live in run_dir/checkpoints (none without run_dir)
  // 0, or the stop signal this process received (keel-train: StopSignals::received). Polled at
  // the end of every step and agreed over all ranks: a signalled run saves and stops
  // (Note [preemption] in launch/stop_signals.cc).
  std::function<int()> stop_signal;
  // train.device other than CPU: the GPU this rank uses (parallel/device_map.h picks it).
  int device_index = 0;
  // A device run with TP or DP > 1: makes the TP and DP communicators for the model's tensors
  // (Topology::tp_tensor_comm, dp_tensor_comm) on exec's device; keel-train's CUDA build makes
  // NCCL ones. Unset: the MPI groups, staged through host memory (parallel/staging_communicator.h).
  std::function<TensorComms(kernels::ExecContext& exec, const Topology& topo)> make_tensor_comms;
  // Make them for a one-rank device run too (groups of one), so it runs the multi-GPU path: the
  // GPU check's 1-rank NCCL job against the same job without NCCL.
  bool tensor_comms_for_one_rank = false;
};

class Trainer {
 public:
  Trainer(const config::KeelConfig& cfg, const Topology& topo, TrainerOptions opts);

  StepResult step();  // one optimizer step
  // Collective: saves a checkpoint of the current state (needs a run_dir). With checkpoint.async
  // it snapshots the state and returns while a thread writes (Note [async checkpoint]); a save
  // still in flight is finished first.
  void save_checkpoint();
  // Collective: waits for an async save in flight and commits it. A failed one is reported (one
  // line from the rank that failed) and remembered in failed_checkpoint(); training goes on.
  void finish_checkpoint();
  // The step of a checkpoint save that failed with no later save succeeding (the run should then
  // exit non-zero), if any.
  std::optional<int64_t> failed_checkpoint() const { return failed_save_; }
  // The stop signal that ended run() early (after saving), or 0.
  int stopped_by_signal() const { return stopped_by_signal_; }
  // The spike guard halted the run (keel-train exits 3).
  bool halted() const { return halted_; }
  // The step the run resumed from, when it did.
  std::optional<int64_t> resumed_from() const { return resumed_from_; }
  void run();         // train.steps steps with logging and evaluation
  double evaluate();  // mean validation cross-entropy (eval_batches batches)
  std::string sample(int64_t n_chars, uint64_t seed, float temperature = 0.8f);

  GPT& model() { return *model_; }
  const Dataset& dataset() const { return data_; }
  AdamW& optimizer() { return *opt_; }
  kernels::ExecContext& exec() { return *exec_; }
  int64_t steps_done() const { return state_->step; }
  // Everything a resume needs (Note [run state]).
  TrainState& state() { return *state_; }
  const TrainState& state() const { return *state_; }
  int64_t tokens_per_step() const {
    return static_cast<int64_t>(cfg_.train().global_batch()) * cfg_.model().seq_len();
  }
  int64_t micro_batch() const { return micro_; }
  int64_t accum_steps() const { return accum_; }
  const Topology& topology() const { return topo_; }
  // ZeRO-1: this rank's slice [shard_offset, shard_offset + shard_n) of the parameter arena.
  int64_t shard_offset() const { return state_->partition().mine().offset; }
  int64_t shard_n() const { return state_->partition().mine().n; }
  const Tensor& shard_grads() const { return shard_grads_; }
  const StepResult& last() const { return last_; }
  // XXH3 fingerprints of the training and validation token streams (Note [data fingerprint]);
  // every rank's are checked equal at start-up. The validation one is 0 without a split.
  uint64_t train_fingerprint() const { return state_->train_fingerprint; }
  uint64_t val_fingerprint() const { return state_->val_fingerprint; }
  // Training samples read so far over windows per epoch: 1.25 is a quarter into the second
  // epoch (each epoch reads every window once: Note [layout-independent data order]).
  double epochs_done() const;
  double last_val_loss() const { return last_val_; }
  bool evaluated() const { return evaluated_; }

 private:
  // Collective: picks the checkpoint to start from (rank 0 decides, every rank loads it) and
  // loads it into state_; returns its step, or nothing for a fresh start.
  std::optional<int64_t> resume();
  // Rank 0: throws kData when the checkpoint in `dir` is corrupt; returns why it cannot be
  // loaded into this run (empty: it can).
  std::string check_checkpoint(const std::string& dir) const;
  // Rank 0: opens metrics.jsonl; on resume first drops the lines of metrics.jsonl and
  // alerts.jsonl and the TensorBoard events of steps after `resumed_step`.
  void open_logs(std::optional<int64_t> resumed_step);
  // Rank 0: fsyncs metrics.jsonl and the TensorBoard file (after a checkpoint commits).
  void sync_logs();
  // Rank 0, resuming from checkpoint `dir` of step `step` with --resume-from: one of the run's
  // own starts a new lineage there (newer checkpoints deleted); another run's needs an empty
  // store (or --overwrite).
  void start_lineage_at(const std::string& dir, int64_t step);
  // Collective: a synchronous save of the current state (one line on rank 0).
  void save_now();
  void say(const std::string& line) const;  // a line on stdout from rank 0
  // Throws kData naming the first rank whose data differs from rank 0's.
  void check_same_data_on_every_rank(uint64_t train_fp, uint64_t val_fp) const;
  // What every rank agrees on at the end of a step.
  struct StepControl {
    int stop_signal = 0;          // 0: go on
    int signalled_rank = -1;      // the highest rank the signal reached
    bool writes_running = false;  // some rank's async checkpoint write is not done
  };
  StepControl agree_on_control();
  void stop_for_signal(const StepControl& c);
  SaveHook save_hook() const;  // debug.fault_point's save points
  // The step's phases.
  StepResult compute_gradients();
  StepDecision decide(StepResult& r);
  // Collective: the spike guard's rewind (or, with `halt`, the restore before halting) to the
  // newest verified checkpoint at least spike.rewind_margin steps before the streak began.
  // Returns false when there is none.
  bool rewind(const StepResult& r, bool halt);
  // Collective: rank 0 picks the newest checkpoint at or before `limit` that verifies and fits
  // this run; every rank learns it.
  std::optional<int64_t> pick_rewind_target(int64_t limit);
  // Retention: the checkpoints the guard may still rewind to (Note [spike guard]).
  bool pinned_for_rewind(int64_t step) const;
  void report(const StepResult& r, const std::string& kind, const std::string& action,
              const std::string& checkpoint, int64_t rewound_to, const std::string& message);
  void apply_update(const StepResult& r);
  void log_step(const StepResult& r, std::optional<double> val_loss);
  // Sum of squares of the gradients of `range` (this rank's partition slice; grads[0] is arena
  // element range.offset), counting each logical element once over TP.
  double grad_sum_squares(const float* grads, ArenaSlice range) const;

  config::KeelConfig cfg_;
  // The caller's topology with this run's tensor communicators filled in (device runs).
  Topology topo_;
  TrainerOptions opts_;
  Dataset data_;
  Sampler sampler_;  // stateless here: the position is state_->sampler
  FaultInjector faults_;
  // Where the model runs (train.device): every tensor of the model and optimizer lives on its
  // device. Declared before them so it outlives them.
  std::unique_ptr<kernels::ExecContext> exec_;
  TensorComms tensor_comms_;  // after exec_ (NCCL ones use its stream), before the model
  Tensor grad_sq_;            // [1] f64 on exec_'s device: the gradient's sum of squares
  std::unique_ptr<GPT> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<TrainState> state_;
  std::unique_ptr<RunDirLock> lock_;              // rank 0 with a run_dir: held for the run
  std::unique_ptr<CheckpointStore> store_;        // run_dir/checkpoints; null without a run_dir
  std::unique_ptr<AsyncCheckpointWriter> async_;  // checkpoint.async
  int64_t saved_step_ = -1;                       // the newest step this run has saved
  std::optional<int64_t> failed_save_;
  int stopped_by_signal_ = 0;
  SpikeGuard guard_;
  std::unique_ptr<AlertSink> alerts_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with a run directory
  void flush_tensorboard();                         // prints the writer's one failure line, once
  bool halted_ = false;
  std::string halt_reason_;  // why decide() said kHalt
  bool said_cannot_rewind_ = false;
  bool said_attention_ = false;              // the attention path's line (after the first step)
  int64_t spike_fired_ = 0, nan_fired_ = 0;  // the last steps debug.inject_* fired at
  std::optional<int64_t> resumed_from_;
  int64_t start_step_ = 0;               // the step this process started at (for the ETA)
  std::unique_ptr<GradSync> grad_sync_;  // plain DP (dp > 1, zero_stage 0)
  Tensor shard_grads_;                   // [shard_n] reduce-scattered gradients (ZeRO-1)
  std::vector<int> tp_partial_ids_;      // gradients to all-reduce over TP each step
  int64_t micro_ = 0, accum_ = 0;
  std::vector<int32_t> inputs_, targets_;
  std::unique_ptr<JsonlWriter> metrics_;
  StepResult last_;
  double last_val_ = 0.0;
  bool evaluated_ = false;
  double run_t0_ = 0.0;
  double window_seconds_ = 0.0;
  int64_t window_tokens_ = 0;
};

}  // namespace keel
