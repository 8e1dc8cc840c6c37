// The run's log (see run_log.h): metrics.jsonl, TensorBoard, the progress line and its ETA, and
// their trimming on resume.
#include "launch/train/run_log.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "framework/file_io.h"

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

RunLog::RunLog(const config::KeelConfig& cfg, std::string run_dir, bool rank0, bool progress,
               bool interactive)
    : cfg_(cfg),
      run_dir_(std::move(run_dir)),
      rank0_(rank0),
      progress_(progress),
      interactive_(interactive) {}

void RunLog::open_tensorboard() {
  if (cfg_.train().tensorboard()) {
    tensorboard_ = std::make_unique<TensorBoardWriter>(run_dir_ + "/tensorboard");
  }
}

void RunLog::open(std::optional<int64_t> resumed_step, const std::vector<int64_t>& rewinds) {
  if (!rank0_ || run_dir_.empty()) return;
  const std::string path = run_dir_ + "/metrics.jsonl";
  if (!resumed_step) {
    metrics_ = std::make_unique<JsonlWriter>(path);
    open_tensorboard();
    return;
  }
  // Keep what the checkpoint's steps logged; drop the lines, alerts and TensorBoard events of
  // the steps the resumed run repeats (logged by a run that died, or by an abandoned branch), so
  // that each step is in each log once.
  trim_jsonl(path, *resumed_step, "{\"step\": ");
  metrics_ = std::make_unique<JsonlWriter>(path, /*append=*/true);
  // The alerts that led to the resumed state stay: a checkpoint committed by a rewind (Note
  // [durable rewind]) is of an earlier step than the rewind's own alerts.
  const int64_t alerts_up_to =
      std::max(*resumed_step,
               rewinds.empty() ? int64_t{0} : *std::max_element(rewinds.begin(), rewinds.end()));
  trim_jsonl(run_dir_ + "/alerts.jsonl", alerts_up_to, "\"step\": ");
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(run_dir_ + "/tensorboard", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("events.out.tfevents.", 0) != 0 || !e.is_regular_file(ec)) continue;
    trim_tensorboard_events(e.path().string(), *resumed_step, "alerts/", alerts_up_to);
  }
  open_tensorboard();
}

void RunLog::step(const StepResult& r, std::optional<double> val_loss, int64_t tokens_per_step,
                  double epochs, bool halted, kernels::ExecContext& exec, double now) {
  const int64_t tokens = r.step * tokens_per_step;
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
    o.add("epoch", epochs);
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
      o.add("guard", std::string(r.rewound ? "rewind" : halted ? "halt" : "skip"));
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
    flush();
  }
  window_seconds_ = 0.0;
  window_tokens_ = 0;
  if (!progress_ || !rank0_) return;
  if (!said_attention_) {
    // Known once the first step has run its attention: cuDNN's fused SDPA, or keel's kernel and
    // why cuDNN's was not taken.
    const std::string path = exec.attention_path();
    if (!path.empty()) {
      said_attention_ = true;
      std::printf("keel-train: attention: %s\n", path.c_str());
    }
  }
  const int64_t total = cfg_.train().steps();
  const double elapsed = now - run_t0_;
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
  if (interactive_ && !val_loss && r.step != total) {
    std::printf("\r%s\033[K", s.c_str());
  } else {
    std::printf("%s%s\n", interactive_ ? "\r" : "", s.c_str());
  }
  std::fflush(stdout);
}

void RunLog::alert(const StepResult& r, const Alert& a) {
  if (!tensorboard_) return;
  // alerts/<kind>: the value behind the event (the loss, or the gradient norm for a
  // gradient-norm event); alerts/text: the human line.
  const bool grad = a.kind == "grad_spike" || a.kind == "nonfinite_grad";
  tensorboard_->scalar("alerts/" + a.kind, r.step, static_cast<float>(grad ? r.grad_norm : r.loss),
                       a.time);
  tensorboard_->text("alerts/text", r.step, alert_human_line(a), a.time);
}

void RunLog::sync() {
  // Rank 0, once a checkpoint has committed: the logs are durable up to its step at least.
  if (metrics_) metrics_->sync();
  if (tensorboard_) {
    tensorboard_->sync();
    flush();  // reports a failure, once
  }
}

void RunLog::flush() {
  if (!tensorboard_) return;
  tensorboard_->flush();
  if (auto failure = tensorboard_->take_failure()) {
    std::fprintf(stderr, "keel-train: %s\n", failure->c_str());
    std::fflush(stderr);
  }
}

}  // namespace keel
