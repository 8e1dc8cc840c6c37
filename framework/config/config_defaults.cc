// keel's default configuration, as text-format source: proto3 scalars have no declared defaults,
// so every field's default is written out in kDefaultsText, and default_config() parses it with
// merge_config_text (config.cc) like any config file.
#include <string>

#include "framework/config/config.h"

namespace keel {
namespace {

// Tune freely: every field is listed, so this string is the single place the defaults live.
constexpr const char* kDefaultsText = R"text(
model {
  vocab_size: 256
  seq_len: 128
  d_model: 128
  n_layers: 4
  n_heads: 4
  n_kv_heads: 0  # n_heads (multi-head attention)
  head_dim: 0  # d_model / n_heads
  d_ff: 0  # 4 x d_model (GELU); 8/3 x d_model rounded up to 64 (SWIGLU, GEGLU)
  qk_norm: RMS
  qk_norm_scope: HEAD_SHARED
  tie_embeddings: true
  norm: LAYERNORM
  max_positions: 0  # seq_len
  init_std: 0.02
  position: LEARNED
  rope_theta: 10000
  mlp: GELU
  bias: true
  norm_placement: PRE
}
parallel {
  tp: 1
  zero_stage: 0
  bucket_mb: 25
  timeout_s: 300
  tp_comm_dtype: "AUTO"
  sequence_parallel: false
}
train {
  steps: 400
  global_batch: 16
  seed: 1234
  log_every: 10
  eval_every: 100
  eval_batches: 4
  threads: 0
  sample_chars: 240
  micro_batch: 0  # global_batch / dp
  plot: true
  tensorboard: true
  device: "AUTO"
  precision: "AUTO"
  recompute_layers: 0
  keep_denormals: false
  deterministic: true
}
optim {
  lr: 3e-3
  min_lr_ratio: 0.1
  warmup_steps: 40
  weight_decay: 0.1
  grad_clip: 1.0
  beta1: 0.9
  beta2: 0.95
  eps: 1e-8
  schedule: COSINE
  decay_steps: 0  # WSD, WSD_SQRT: a fifth of train.steps
}
loss {
  z_loss: 1e-4
}
data {
  path: ""
  format: AUTO
  val_fraction: 0.05
  val_path: ""
  builtin_bytes: 4000000
  builtin_seed: 7
}
checkpoint {
  every: 0
  every_minutes: 30
  keep: 3
  keep_every: 0
  async: false
}
spike {
  enabled: true
  window: 100
  warmup_steps: 100
  sigma: 6
  min_ratio: 0.25
  grad_sigma: 10
  grad_min_ratio: 4
  patience: 2
  rewind_margin: 10
  skip_batches: 20
  lr_scale: 1
  cooldown_steps: 0
  max_rewinds: 3
  rewind_window: 1000
  max_skipped_steps: 20
  replay: true
  on_hardware_fault: CONTINUE
  keep_anomalies: 20
  replay_every: 0
  check_replicas: true
}
alert {
  command: ""
  timeout_s: 10
  drain_timeout_s: 30
}
debug {
  inject_spike_at_step: 0
  inject_nan_at_step: 0
  inject_every: 0
  inject_factor: 1000
  kill_rank: 0
  kill_at_step: 0
  fault: KILL
  fault_point: STEP_BEGIN
  inject_bitflip_at_step: 0
  inject_bitflip_rank: 0
  inject_param_bitflip_at_step: 0
}
)text";

}  // namespace

std::string default_config_text() { return kDefaultsText; }

config::KeelConfig default_config() {
  config::KeelConfig cfg;
  merge_config_text(kDefaultsText, "<built-in defaults>", cfg);
  return cfg;
}

}  // namespace keel
