// The training loop. A step runs in three phases: compute gradients (data -> micro-batch
// forward/backward with accumulation -> DP/TP gradient sync -> all-reduced loss and global norm)
// -> decide (a Verdict: apply, or the spike guard's skip, rewind or halt; carry_out acts on it)
// -> apply (clipping, AdamW, ZeRO-1 all-gather). The loop calls out at named points to the
// owners of the rest: the run's log (run_log.h: metrics, TensorBoard, progress), the checkpoint
// store and resume (checkpoints/resume.h), the rewinder (rewinder.h), fault injection
// (fault_injector.h), text sampling (sampling.h); an anomalous step is replayed before the guard
// acts (forensics.h; trainer_replay.cc). Construction is in trainer_setup.cc. Everything a
// step decides comes from (config, TrainState), so two runs with the same seed are bit-identical.
// The run's state lives in one TrainState (Note [run state]) that checkpoints save and load.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "checkpoints/async_writer.h"
#include "checkpoints/checkpoint.h"
#include "checkpoints/resume.h"
#include "checkpoints/train_state.h"
#include "framework/config/keel.pb.h"
#include "framework/data/dataset.h"
#include "framework/data/sampler.h"
#include "framework/metrics.h"
#include "framework/optim/optimizer.h"
#include "framework/tensorboard/tensorboard.h"
#include "launch/train/alerts.h"
#include "launch/train/fault_injector.h"
#include "launch/train/rewinder.h"
#include "launch/train/run_lock.h"
#include "launch/train/run_log.h"
#include "launch/train/spike_guard.h"
#include "launch/train/step_result.h"
#include "layers/gpt.h"
#include "parallel/grad_sync.h"
#include "parallel/watchdog.h"
#include "parallel/zero_partition.h"

namespace keel {

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
  // (Note [preemption] in launch/train/stop_signals.cc).
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
  // A replay found a rank computing differently and spike.on_hardware_fault=STOP ended the run.
  bool hardware_stop() const { return hardware_stop_; }
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
  // Construction's parts (trainer_setup.cc).
  void setup_exec_and_comms();
  void build_model_and_state(uint64_t train_fp, uint64_t val_fp);
  void open_run_dir();
  // Throws kData naming the first rank whose data differs from rank 0's.
  void check_same_data_on_every_rank(uint64_t train_fp, uint64_t val_fp) const;
  // Collective: picks the checkpoint to start from (rank 0 decides, every rank loads it) and
  // loads it into state_; returns its step, or nothing for a fresh start.
  std::optional<int64_t> resume();
  // Collective: a synchronous save of the current state (one line on rank 0).
  void save_now();
  void say(const std::string& line) const;  // a line on stdout from rank 0
  // What every rank agrees on at the end of a step.
  struct StepControl {
    int stop_signal = 0;          // 0: go on
    int signalled_rank = -1;      // the highest rank the signal reached
    bool writes_running = false;  // some rank's async checkpoint write is not done
    bool save_due = false;        // rank 0: checkpoint.every_minutes have passed since a save
  };
  StepControl agree_on_control();
  void stop_for_signal(const StepControl& c);
  SaveHook save_hook() const;  // debug.fault_point's save points
  // The step's phases.
  // replay_of: recompute the step with the first computation's injections, less its bit flip
  // (Note [replay] in forensics.h); null: the step's first computation.
  StepResult compute_gradients(const FaultInjector::Injection* replay_of = nullptr);
  Verdict decide(StepResult& r);
  // The anomalous step r computed again and compared (Note [replay]): nothing when the replay is
  // identical or spike.on_hardware_fault=CONTINUE took it, else the verdict to stop. `before`:
  // the guard's state before it observed r.
  std::optional<Verdict> replay(StepResult& r, const GuardState& before);
  // Collective: RUN/anomalies/step_N/ for the anomalous step r (Note [anomaly evidence]).
  void keep_evidence(const StepResult& r, const StepResult* replayed,
                     const std::vector<double>& grad_norm_layers);
  bool keeps_evidence() const;  // a run directory and spike.keep_anomalies > 0
  // Collective: each block's gradient norm, then one for everything outside the blocks.
  std::vector<double> layer_grad_norms() const;
  // Collective, before a periodic save with DP > 1: the DP replicas' parameter checksums
  // compared (Note [replica check] in trainer_replay.cc). False: spike.on_hardware_fault=STOP
  // stopped the run, and the save must not happen.
  bool check_replicas();
  // The gradients this rank holds (ZeRO-1: its reduce-scattered slice), for fingerprints.
  const Tensor& held_grads(int64_t* n) const;
  void carry_out(const Verdict& v, StepResult& r);  // the one place a verdict is acted on
  void report(const StepResult& r, const std::string& kind, const std::string& action,
              const std::string& checkpoint, int64_t rewound_to, const std::string& message);
  void apply_update(const StepResult& r);
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
  std::unique_ptr<Resumer> resumer_;              // rank 0's decisions over store_
  std::unique_ptr<Rewinder> rewinder_;
  int64_t saved_step_ = -1;  // the newest step this run has saved
  // Saving by wall clock (checkpoint.every_minutes): rank 0's clock at the last save begun (or
  // at the start), and whether the ranks have agreed that a save is due (Note [timed saves]).
  double last_save_wtime_ = 0.0;
  bool timed_save_due_ = false;
  std::optional<int64_t> failed_save_;
  int stopped_by_signal_ = 0;
  SpikeGuard guard_;
  std::unique_ptr<AlertSink> alerts_;
  bool halted_ = false;
  std::optional<int64_t> resumed_from_;
  FaultInjector::Injection injection_;   // what debug.inject_* did to the current step
  uint64_t step_start_sample_ = 0;       // state_->sampler.next_sample when the step began
  std::string host_;                     // this machine's name, for replay verdicts
  bool hardware_stop_ = false;           // stopped by spike.on_hardware_fault=STOP (exit 4)
  std::unique_ptr<GradSync> grad_sync_;  // plain DP (dp > 1, zero_stage 0)
  Tensor shard_grads_;                   // [shard_n] reduce-scattered gradients (ZeRO-1)
  std::vector<int> tp_partial_ids_;      // gradients to all-reduce over TP each step
  int64_t micro_ = 0, accum_ = 0;
  std::vector<int32_t> inputs_, targets_;
  RunLog log_;
  StepResult last_;
  double last_val_ = 0.0;
  bool evaluated_ = false;
};

}  // namespace keel
