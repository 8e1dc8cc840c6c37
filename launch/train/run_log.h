// The run's log, on rank 0: RUN/metrics.jsonl, the TensorBoard events (RUN/tensorboard) and the
// progress line with its ETA. On resume it first drops what the steps the resumed run repeats
// had logged (metrics, alerts, TensorBoard events), so that each step is in each log once. The
// trainer calls it at named points: open() before the first step, step() for a logged step,
// alert() for a spike-guard event, sync() after a checkpoint commits, flush() at the end.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/config/keel.pb.h"
#include "framework/kernels/exec_context.h"
#include "framework/metrics.h"
#include "framework/tensorboard/tensorboard.h"
#include "launch/train/alerts.h"
#include "launch/train/step_result.h"

namespace keel {

class RunLog {
 public:
  // `run_dir` empty: no files. `rank0`: this process writes and prints (the others do nothing).
  RunLog(const config::KeelConfig& cfg, std::string run_dir, bool rank0, bool progress,
         bool interactive);

  // Opens metrics.jsonl and TensorBoard (train.tensorboard). With `resumed_step`, first keeps
  // only the lines of metrics.jsonl and alerts.jsonl and the TensorBoard events of the steps up
  // to it (alerts up to the newest of `rewinds` too: Note [durable rewind]).
  void open(std::optional<int64_t> resumed_step, const std::vector<int64_t>& rewinds);
  // The step this process started at (the ETA counts the steps since), and the time run()
  // began.
  void set_start_step(int64_t step) { start_step_ = step; }
  void start(double now) { run_t0_ = now; }
  // Each step's time and tokens, for the tokens/s of the next logged step.
  void count(double seconds, int64_t tokens) {
    window_seconds_ += seconds;
    window_tokens_ += tokens;
  }
  // A logged step: its metrics line, TensorBoard scalars and progress line. `halted`: the guard
  // halted the run at it; `epochs`: training samples read over windows per epoch.
  void step(const StepResult& r, std::optional<double> val_loss, int64_t tokens_per_step,
            double epochs, bool halted, kernels::ExecContext& exec, double now);
  // A spike-guard event: TensorBoard's alerts/<kind> and alerts/text (the alert itself goes to
  // the AlertSink); `a` as filled for the sink.
  void alert(const StepResult& r, const Alert& a);
  // Rank 0, after a checkpoint commits: the logs are durable up to its step at least.
  void sync();
  // Flushes TensorBoard; prints its writer's one failure line, once.
  void flush();

 private:
  void open_tensorboard();  // with train.tensorboard
  const config::KeelConfig& cfg_;
  std::string run_dir_;
  bool rank0_, progress_, interactive_;
  std::unique_ptr<JsonlWriter> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  bool said_attention_ = false;  // the attention path's line (after the first step)
  int64_t start_step_ = 0;       // the step this process started at (for the ETA)
  double run_t0_ = 0.0;
  double window_seconds_ = 0.0;
  int64_t window_tokens_ = 0;
};

}  // namespace keel
