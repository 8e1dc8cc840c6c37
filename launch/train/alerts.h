// The spike guard's alert sink. Each alert becomes one JSON line in RUN/alerts.jsonl, one human
// line on stderr ("keel-train: ALERT step N: ...") and, when alert.command is set, one run of
// that command through /bin/sh -c with the JSON line on its stdin. Only rank 0 does any of it.
//
// Note [alert hooks]: a hook runs on the sink's own worker thread, never on the training thread:
// emit() only queues the line, so a hook that hangs costs the run nothing. Hooks run one at a
// time, in emit order, each in its own process group (posix_spawn, so a big training process is
// never forked) with only stdin, stdout and stderr open: stdin is a pipe carrying the alert's
// JSON line, stdout and stderr are one pipe the worker copies to keel-train's stderr, up to
// kMaxHookOutputBytes per hook (the rest is read and counted in one line, so a hook that prints
// megabytes neither floods the job's log nor blocks on a full pipe). A hook still running
// alert.timeout_s after its start is killed with its whole process group (SIGKILL to -pgid), and
// that is logged as one stderr line, as is a non-zero exit. A hook that exits without reading
// stdin is fine (the write's EPIPE is expected; SIGPIPE is blocked on the worker thread, so this
// holds even where the process does not ignore it). When more than kMaxPendingHooks alerts wait,
// the oldest is dropped, said once. The end of the run (drain(), or the destructor after a stop)
// waits at most alert.drain_timeout_s in all: then the running hook is killed, the queued ones
// are not run, and one line counts them. See docs/alerts.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "framework/config/keel.pb.h"

namespace keel {

// Seconds since the Unix epoch, with sub-second precision.
double unix_time_now();

// One event of the spike guard. Doubles may be NaN or infinite (written as JSON null). Every
// member has an initializer, so designated initializers may leave any out (-Wextra stays quiet).
struct Alert {
  double time = unix_time_now();  // unix seconds
  int64_t step = 0;               // the step the event happened at
  // "nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_spike", "rewind", "halt",
  // "cannot_rewind", ...
  std::string kind{};
  double loss = std::numeric_limits<double>::quiet_NaN();
  double baseline = std::numeric_limits<double>::quiet_NaN();   // what the value was compared to
  double threshold = std::numeric_limits<double>::quiet_NaN();  // the bound it crossed
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  // The step's largest |scaled q.k| and the block it is in (-1: unknown, written as null).
  double max_attn_logit = std::numeric_limits<double>::quiet_NaN();
  int max_attn_logit_layer = -1;
  std::string action = "none";  // "skip", "rewind", "halt", "none"
  std::string checkpoint{};     // the restored checkpoint's path; "" if none
  // kind "rewind": the step training went back to (the restored checkpoint's step).
  std::optional<int64_t> rewound_to{};
  int64_t batches_skipped = 0;  // so far in the run
  int rewinds = 0;              // so far in the run
  std::string message{};        // the human line's text
};

// The alert as one JSON object without the newline, keys in this order:
//   {"time": 1700000000.25, "step": 42, "kind": "loss_spike", "action": "skip", "loss": 7.5,
//    "baseline": 3.25, "threshold": 6.5, "grad_norm": null, "max_attn_logit": 41.5,
//    "max_attn_logit_layer": 7, "checkpoint": "", "rewound_to": null, "batches_skipped": 1,
//    "rewinds": 0, "message": "..."}
// Doubles print with %.17g (round trip), NaN and infinities as null, rewound_to as null when
// unset. Strings are escaped (quotes, backslashes, control characters) and invalid UTF-8 bytes
// become U+FFFD, so every line parses with any JSON reader.
std::string alert_json(const Alert& alert);

// The human line without the newline:
//   keel-train: ALERT step 42: <message> [loss_spike -> skip]
// Control characters in the message become spaces, so it stays one line; an empty message shows
// the kind alone.
std::string alert_human_line(const Alert& alert);

// What the sink does with an existing RUN/alerts.jsonl.
enum class AlertFileMode {
  kAppend,    // keep its lines (a resumed run continues the run's alert history)
  kTruncate,  // start it empty (a run started from scratch)
};

class AlertSink {
 public:
  static constexpr size_t kMaxPendingHooks = 100;
  // Of one hook's stdout and stderr, at most this many bytes reach keel-train's stderr.
  static constexpr size_t kMaxHookOutputBytes = 64 * 1024;

  // run_dir: where alerts.jsonl goes (created at once); "" writes no file. cfg.command: the hook
  // ("" runs none); cfg.timeout_s and cfg.drain_timeout_s must then be > 0. Ranks other than 0
  // (is_rank0 false) do nothing at all. Throws kIo when the file cannot be opened, kConfig for a
  // bad timeout.
  AlertSink(const std::string& run_dir, const config::Alert& cfg, bool is_rank0,
            AlertFileMode mode = AlertFileMode::kAppend);
  // Waits for the running hook (at most its timeout, and at most alert.drain_timeout_s: then it
  // is killed), then stops the worker; hooks still queued are not run (said in one line). Call
  // drain() first to run them.
  ~AlertSink();
  AlertSink(const AlertSink&) = delete;
  AlertSink& operator=(const AlertSink&) = delete;

  // Prints the human line, appends the JSON line to alerts.jsonl, then queues the hook (which
  // so finds its line already in the file). Never waits for a hook. Throws kIo (naming the
  // file) when alerts.jsonl cannot be written; the alert was still printed and handed to the
  // hook.
  void emit(const Alert& alert);
  // Returns once every queued hook has run (each bounded by alert.timeout_s), or once
  // alert.drain_timeout_s has passed since the call: then the running hook is killed, the queued
  // ones are not run, and one stderr line counts both. Either way the queue is then empty.
  void drain();

 private:
  enum class HookEnd { kFinished, kGivenUp };  // kGivenUp: killed because give_up_ was set
  void worker_loop();
  HookEnd run_hook(const std::string& json_line);
  // Sets give_up_ and waits until the worker is between hooks (it kills the running one at
  // once); returns whether a hook was killed. `lock` holds mu_.
  bool give_up_running_hook(std::unique_lock<std::mutex>& lock);
  void append_line(const std::string& line);

  const bool active_;  // rank 0
  const std::string command_;
  const double timeout_s_;
  const double drain_timeout_s_;
  std::string path_;  // RUN/alerts.jsonl; "" when none
  int fd_ = -1;
  int64_t size_ = 0;  // bytes of complete lines in the file

  std::mutex mu_;
  std::condition_variable wake_;  // worker: work or stop
  std::condition_variable idle_;  // drain(): queue empty and no hook running
  std::deque<std::string> queue_;
  bool running_hook_ = false;
  bool stop_ = false;
  bool killed_at_deadline_ = false;   // the last hook that ended was killed by give_up_
  std::atomic<bool> give_up_{false};  // kill the running hook now and start no other
  int64_t dropped_ = 0;
  std::thread worker_;
};

}  // namespace keel
