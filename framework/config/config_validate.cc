// validate(): every field of keel.proto's KeelConfig checked against its range, and the derived
// values (model.d_ff, model.max_positions, optim.decay_steps, data.format) resolved. One line per
// failure, naming the dotted field; checks that need the world size, the machine or the data are
// the launcher's.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "framework/config/config.h"
#include "framework/config/config_internal.h"
#include "framework/error.h"

namespace keel {
namespace {

namespace pb = google::protobuf;
using config::KeelConfig;
using config_detail::enum_choices;

// train.sample_chars at most: sampling runs one forward pass per byte, after training.
constexpr int32_t kMaxSampleChars = 1000000;

// Calls fn(name, message, reflection, field) for every scalar field of every section
// ("model.qk_norm", ...).
template <typename Fn>
void for_each_field(const KeelConfig& cfg, Fn&& fn) {
  const pb::Descriptor* d = cfg.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* section = d->field(i);
    const pb::Message& msg = cfg.GetReflection()->GetMessage(cfg, section);
    for (int j = 0; j < section->message_type()->field_count(); ++j) {
      const pb::FieldDescriptor* f = section->message_type()->field(j);
      fn(section->name() + "." + f->name(), msg, *msg.GetReflection(), f);
    }
  }
}

// Every enum is defined and not its *_UNSPECIFIED zero; every float and double is finite.
void check_enums_and_floats(const KeelConfig& cfg) {
  for_each_field(cfg, [](const std::string& name, const pb::Message& msg, const pb::Reflection& r,
                         const pb::FieldDescriptor* f) {
    switch (f->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        const int value = r.GetEnumValue(msg, f);
        KEEL_CHECK(value != 0, kConfig, name, " is unspecified (choose one of ",
                   enum_choices(f->enum_type()), ")");
        KEEL_CHECK(f->enum_type()->FindValueByNumber(value) != nullptr, kConfig, name, "=", value,
                   " is not a valid value (choose one of ", enum_choices(f->enum_type()), ")");
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
        const double value = f->cpp_type() == pb::FieldDescriptor::CPPTYPE_FLOAT
                                 ? r.GetFloat(msg, f)
                                 : r.GetDouble(msg, f);
        KEEL_CHECK(std::isfinite(value), kConfig, name, "=", value, " is not a finite number");
        break;
      }
      default:
        break;
    }
  });
}

// A path that names llm.c shards: *.bin, or a glob pattern.
bool looks_like_shards(const std::string& path) {
  const bool bin = path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
  return bin || path.find_first_of("*?[") != std::string::npos;
}

void validate_model(config::Model& m) {
  KEEL_CHECK(m.vocab_size() > 0, kConfig, "model.vocab_size=", m.vocab_size(), " must be > 0");
  KEEL_CHECK(m.seq_len() > 0, kConfig, "model.seq_len=", m.seq_len(), " must be > 0");
  KEEL_CHECK(m.d_model() > 0, kConfig, "model.d_model=", m.d_model(), " must be > 0");
  KEEL_CHECK(m.n_layers() > 0, kConfig, "model.n_layers=", m.n_layers(), " must be > 0");
  KEEL_CHECK(m.n_heads() > 0, kConfig, "model.n_heads=", m.n_heads(), " must be > 0");
  KEEL_CHECK(m.head_dim() >= 0, kConfig, "model.head_dim=", m.head_dim(),
             " must be >= 0 (0: d_model / n_heads)");
  KEEL_CHECK(m.head_dim() > 0 || m.d_model() % m.n_heads() == 0, kConfig,
             "model.n_heads=", m.n_heads(), " does not divide model.d_model=", m.d_model(),
             " (or set model.head_dim)");
  // 0 or n_heads: multi-head attention; otherwise each n_heads / n_kv_heads query heads share a
  // k/v head, so n_kv_heads must divide n_heads.
  KEEL_CHECK(m.n_kv_heads() >= 0 && m.n_kv_heads() <= m.n_heads() &&
                 (m.n_kv_heads() == 0 || m.n_heads() % m.n_kv_heads() == 0),
             kConfig, "model.n_kv_heads=", m.n_kv_heads(),
             " does not divide model.n_heads=", m.n_heads(),
             " (0 or n_heads: multi-head; 1: multi-query; a divisor: grouped-query)");
  KEEL_CHECK(m.d_ff() >= 0, kConfig, "model.d_ff=", m.d_ff(), " must be >= 0 (0: 4 x d_model)");
  KEEL_CHECK(m.qk_norm() != config::L2 || m.seq_len() >= 2, kConfig, "model.seq_len=", m.seq_len(),
             " must be >= 2 with model.qk_norm=L2 (its scale starts at log2(seq_len^2 - seq_len))");
  if (m.d_ff() == 0) {
    // GELU: 4 x d_model. Gated MLPs have three matrices instead of two, so 8/3 x d_model keeps the
    // parameter count (Shazeer 2020, Llama), rounded up to a multiple of 64 for the GEMMs.
    const int64_t c = m.d_model();
    const int64_t d_ff = m.mlp() == config::GELU ? 4 * c : (8 * c / 3 + 63) / 64 * 64;
    KEEL_CHECK(d_ff <= std::numeric_limits<int32_t>::max(), kConfig, "model.d_model=", m.d_model(),
               " is too large for the automatic model.d_ff");
    m.set_d_ff(static_cast<int32_t>(d_ff));
  }
  if (m.position() == config::ROPE) {
    KEEL_CHECK(m.rope_theta() > 1, kConfig, "model.rope_theta=", m.rope_theta(),
               " must be > 1 with model.position=ROPE");
    if (m.head_dim() > 0) {
      KEEL_CHECK(m.head_dim() % 2 == 0, kConfig,
                 "model.position=ROPE needs an even head_dim; model.head_dim=", m.head_dim(),
                 " is odd");
    } else {
      KEEL_CHECK((m.d_model() / m.n_heads()) % 2 == 0, kConfig,
                 "model.position=ROPE needs an even head_dim; model.d_model=", m.d_model(),
                 " / model.n_heads=", m.n_heads(), " is odd");
    }
  }
  KEEL_CHECK(m.max_positions() >= 0, kConfig, "model.max_positions=", m.max_positions(),
             " must be >= 0 (0: seq_len)");
  if (m.max_positions() == 0) m.set_max_positions(m.seq_len());
  KEEL_CHECK(m.seq_len() <= m.max_positions(), kConfig, "model.seq_len=", m.seq_len(),
             " exceeds model.max_positions=", m.max_positions(), " (the position table)");
  KEEL_CHECK(m.init_std() > 0, kConfig, "model.init_std=", m.init_std(), " must be > 0");
}

void validate_spike(const config::Spike& s) {
  KEEL_CHECK(s.window() >= 5 && s.window() <= 100000, kConfig, "spike.window=", s.window(),
             " must be in [5, 100000] steps");
  KEEL_CHECK(s.warmup_steps() >= 0, kConfig, "spike.warmup_steps=", s.warmup_steps(),
             " must be >= 0");
  KEEL_CHECK(s.sigma() > 0 && s.grad_sigma() > 0, kConfig, "spike.sigma=", s.sigma(),
             " and spike.grad_sigma=", s.grad_sigma(), " must be > 0");
  KEEL_CHECK(s.min_ratio() >= 0 && s.grad_min_ratio() >= 0, kConfig,
             "spike.min_ratio=", s.min_ratio(), " and spike.grad_min_ratio=", s.grad_min_ratio(),
             " must be >= 0");
  KEEL_CHECK(s.patience() >= 1, kConfig, "spike.patience=", s.patience(), " must be >= 1");
  KEEL_CHECK(s.rewind_margin() >= 1, kConfig, "spike.rewind_margin=", s.rewind_margin(),
             " must be >= 1 (a checkpoint of the first anomalous step holds what spiked)");
  KEEL_CHECK(s.skip_batches() >= 0, kConfig, "spike.skip_batches=", s.skip_batches(),
             " must be >= 0");
  KEEL_CHECK(s.lr_scale() > 0 && s.lr_scale() <= 1, kConfig, "spike.lr_scale=", s.lr_scale(),
             " must be in (0, 1] (1: no cool-down)");
  KEEL_CHECK(s.cooldown_steps() >= 0, kConfig, "spike.cooldown_steps=", s.cooldown_steps(),
             " must be >= 0");
  KEEL_CHECK(s.max_rewinds() >= 0, kConfig, "spike.max_rewinds=", s.max_rewinds(),
             " must be >= 0 (0: halt instead of the first rewind)");
  KEEL_CHECK(s.rewind_window() >= 1, kConfig, "spike.rewind_window=", s.rewind_window(),
             " must be >= 1 step");
  KEEL_CHECK(s.max_skipped_steps() >= s.patience(), kConfig,
             "spike.max_skipped_steps=", s.max_skipped_steps(),
             " must be >= spike.patience=", s.patience(),
             " (a streak must be able to reach a rewind before it halts)");
  KEEL_CHECK(s.keep_anomalies() >= 0, kConfig, "spike.keep_anomalies=", s.keep_anomalies(),
             " must be >= 0 (0: keep no anomaly evidence)");
  KEEL_CHECK(s.replay_every() >= 0, kConfig, "spike.replay_every=", s.replay_every(),
             " must be >= 0 (0: replay only anomalous steps)");
}

void validate_train(const config::Train& t) {
  KEEL_CHECK(t.steps() > 0, kConfig, "train.steps=", t.steps(), " must be > 0");
  KEEL_CHECK(t.global_batch() > 0, kConfig, "train.global_batch=", t.global_batch(),
             " must be > 0");
  KEEL_CHECK(t.log_every() > 0, kConfig, "train.log_every=", t.log_every(), " must be > 0");
  KEEL_CHECK(t.eval_every() >= 0, kConfig, "train.eval_every=", t.eval_every(),
             " must be >= 0 (0 disables evaluation)");
  KEEL_CHECK(t.eval_every() == 0 || t.eval_batches() > 0, kConfig,
             "train.eval_batches=", t.eval_batches(),
             " must be > 0 when train.eval_every=", t.eval_every());
  KEEL_CHECK(t.eval_batches() >= 0, kConfig, "train.eval_batches=", t.eval_batches(),
             " must be >= 0");
  KEEL_CHECK(t.threads() >= 0, kConfig, "train.threads=", t.threads(),
             " must be >= 0 (0: all cores)");
  KEEL_CHECK(t.sample_chars() >= 0, kConfig, "train.sample_chars=", t.sample_chars(),
             " must be >= 0");
  KEEL_CHECK(t.sample_chars() <= kMaxSampleChars, kConfig, "train.sample_chars=", t.sample_chars(),
             " exceeds ", kMaxSampleChars, " (each sampled byte is one forward pass of the model)");
  {
    const std::string dev = upper_ascii(t.device());
    // Whether a GPU is there is the launcher's question (kernels::resolve_device); only the
    // spelling is checked here.
    KEEL_CHECK(dev.empty() || dev == "AUTO" || dev == "CPU" || dev == "CUDA", kConfig,
               "train.device=", t.device(), ": invalid value (choose AUTO, CPU or CUDA)");
    const std::string prec = upper_ascii(t.precision());
    KEEL_CHECK(prec.empty() || prec == "AUTO" || prec == "FP32" || prec == "BF16", kConfig,
               "train.precision=", t.precision(), ": invalid value (choose AUTO, FP32 or BF16)");
    KEEL_CHECK(!(dev == "CPU" && prec == "BF16"), kConfig,
               "train.precision=BF16: the CPU backend computes in FP32 only (BF16 needs "
               "train.device=CUDA)");
  }
  // Whether micro_batch divides the per-rank batch depends on dp: the launcher checks that.
  KEEL_CHECK(t.micro_batch() >= 0, kConfig, "train.micro_batch=", t.micro_batch(),
             " must be >= 0 (0: global_batch / dp)");
}

void validate_optim(const config::Optim& o) {
  KEEL_CHECK(o.lr() > 0, kConfig, "optim.lr=", o.lr(), " must be > 0");
  KEEL_CHECK(o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1, kConfig,
             "optim.min_lr_ratio=", o.min_lr_ratio(), " must be in [0, 1]");
  KEEL_CHECK(o.warmup_steps() >= 0, kConfig, "optim.warmup_steps=", o.warmup_steps(),
             " must be >= 0");
  KEEL_CHECK(o.weight_decay() >= 0, kConfig, "optim.weight_decay=", o.weight_decay(),
             " must be >= 0");
  KEEL_CHECK(o.grad_clip() >= 0, kConfig, "optim.grad_clip=", o.grad_clip(),
             " must be >= 0 (0 disables clipping)");
  KEEL_CHECK(o.beta1() >= 0 && o.beta1() < 1, kConfig, "optim.beta1=", o.beta1(),
             " must be in [0, 1)");
  KEEL_CHECK(o.beta2() >= 0 && o.beta2() < 1, kConfig, "optim.beta2=", o.beta2(),
             " must be in [0, 1)");
  KEEL_CHECK(o.eps() > 0, kConfig, "optim.eps=", o.eps(), " must be > 0");
}

// optim.decay_steps belongs to the WSD schedules; 0 there means a fifth of train.steps (resolved
// here), and the decay must fit after the warmup.
void validate_schedule(config::Optim& o, const config::Train& t) {
  const bool wsd = o.schedule() == config::WSD || o.schedule() == config::WSD_SQRT;
  KEEL_CHECK(o.decay_steps() >= 0, kConfig, "optim.decay_steps=", o.decay_steps(),
             " must be >= 0 (0: a fifth of train.steps)");
  KEEL_CHECK(wsd || o.decay_steps() == 0, kConfig, "optim.decay_steps=", o.decay_steps(),
             " applies to optim.schedule WSD and WSD_SQRT only (this one is ",
             config::LrSchedule_Name(o.schedule()), ")");
  if (!wsd) return;
  if (o.decay_steps() == 0) o.set_decay_steps(std::max(1, t.steps() / 5));
  KEEL_CHECK(static_cast<int64_t>(o.warmup_steps()) + o.decay_steps() <= t.steps(), kConfig,
             "optim.warmup_steps=", o.warmup_steps(), " + optim.decay_steps=", o.decay_steps(),
             " exceed train.steps=", t.steps(), " (the decay must start after the warmup)");
}

void validate_data(config::Data& d, const config::Train& t) {
  if (d.format() == config::AUTO) {
    if (d.path().empty()) {
      d.set_format(config::BUILTIN);
    } else if (looks_like_shards(d.path())) {
      d.set_format(config::SHARDS);
    } else {
      d.set_format(config::TEXT);
    }
  }
  const std::string format = config::DataFormat_Name(d.format());
  if (d.format() == config::BUILTIN) {
    KEEL_CHECK(d.path().empty(), kConfig, "data.path='", d.path(),
               "' is set but data.format=BUILTIN (the generated corpus) reads no file");
    KEEL_CHECK(d.val_path().empty(), kConfig, "data.val_path='", d.val_path(),
               "' is set but data.format=BUILTIN holds out data.val_fraction instead");
    KEEL_CHECK(d.builtin_bytes() > 0, kConfig, "data.builtin_bytes=", d.builtin_bytes(),
               " must be > 0");
    KEEL_CHECK(d.builtin_bytes() <= (int64_t{1} << 32), kConfig,
               "data.builtin_bytes=", d.builtin_bytes(),
               " exceeds the built-in corpus's 4 GiB limit");
  } else {
    KEEL_CHECK(!d.path().empty(), kConfig, "data.path is empty but data.format=", format,
               " needs a file");
  }
  KEEL_CHECK(d.val_fraction() >= 0 && d.val_fraction() < 1, kConfig,
             "data.val_fraction=", d.val_fraction(), " must be in [0, 1)");
  const bool has_val = !d.val_path().empty() || d.val_fraction() > 0;
  KEEL_CHECK(has_val || t.eval_every() == 0, kConfig, "train.eval_every=", t.eval_every(),
             " needs a validation split: set data.val_fraction > 0 or data.val_path"
             " (or train.eval_every=0)");
}

}  // namespace

std::string upper_ascii(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

void validate(KeelConfig& cfg) {
  check_enums_and_floats(cfg);
  validate_model(*cfg.mutable_model());
  const auto& par = cfg.parallel();
  KEEL_CHECK(par.tp() >= 1, kConfig, "parallel.tp=", par.tp(), " must be >= 1");
  KEEL_CHECK(par.zero_stage() == 0 || par.zero_stage() == 1, kConfig,
             "parallel.zero_stage=", par.zero_stage(), " must be 0 or 1");
  KEEL_CHECK(par.bucket_mb() > 0, kConfig, "parallel.bucket_mb=", par.bucket_mb(), " must be > 0");
  KEEL_CHECK(par.timeout_s() >= 0, kConfig, "parallel.timeout_s=", par.timeout_s(),
             " must be >= 0 (0 disables the watchdog)");
  const std::string wire = upper_ascii(par.tp_comm_dtype());
  KEEL_CHECK(wire.empty() || wire == "AUTO" || wire == "FP32" || wire == "BF16", kConfig,
             "parallel.tp_comm_dtype=", par.tp_comm_dtype(),
             ": invalid value (choose AUTO, FP32 or BF16)");
  const int64_t tp = par.tp(), heads = cfg.model().n_heads(), d_ff = cfg.model().d_ff();
  KEEL_CHECK(tp <= heads, kLayout, "parallel.tp=", tp, " exceeds model.n_heads=", heads,
             " (TP splits whole heads)");
  KEEL_CHECK(heads % tp == 0, kLayout, "parallel.tp=", tp,
             " does not divide model.n_heads=", heads);
  KEEL_CHECK(d_ff % tp == 0, kLayout, "parallel.tp=", tp, " does not divide model.d_ff=", d_ff);
  // Note [gqa layouts] (layers/attention.h): k/v heads shard with the query heads, or under more
  // ranks than k/v heads each rank keeps a copy of the one its query heads use.
  const int64_t kv = cfg.model().n_kv_heads() > 0 ? cfg.model().n_kv_heads() : heads;
  KEEL_CHECK(kv % tp == 0 || tp % kv == 0, kLayout, "model.n_kv_heads=", kv,
             " and parallel.tp=", tp,
             ": k/v heads must be a multiple of tp (sharded) or divide it (replicated)");
  if (par.sequence_parallel() && tp > 1) {
    // Note [sequence parallel] (layers/gpt.h): each rank holds B x seq_len / tp token rows.
    const int64_t seq = cfg.model().seq_len();
    KEEL_CHECK(seq % tp == 0, kLayout, "parallel.sequence_parallel: parallel.tp=", tp,
               " does not divide model.seq_len=", seq, " (each rank holds seq_len / tp rows)");
    KEEL_CHECK(wire != "BF16", kConfig,
               "parallel.tp_comm_dtype=BF16: the all-gathers and reduce-scatters of "
               "parallel.sequence_parallel move fp32 (use AUTO or FP32)");
  }
  KEEL_CHECK(cfg.debug().kill_at_step() >= 0, kConfig, "debug.kill_at_step must be >= 0");
  const config::FaultPoint point = cfg.debug().fault_point();
  KEEL_CHECK(cfg.debug().kill_rank() == 0 ||
                 (point != config::SAVE_BEFORE_MANIFEST && point != config::SAVE_BEFORE_LATEST),
             kConfig, "debug.fault_point=", config::FaultPoint_Name(point),
             " is reached by rank 0 only (it commits the checkpoint); debug.kill_rank=",
             cfg.debug().kill_rank(), " never gets there");
  validate_train(cfg.train());
  KEEL_CHECK(cfg.train().recompute_layers() >= 0 &&
                 cfg.train().recompute_layers() <= cfg.model().n_layers(),
             kConfig, "train.recompute_layers=", cfg.train().recompute_layers(),
             " must be in [0, model.n_layers=", cfg.model().n_layers(), "] (0: none; ",
             cfg.model().n_layers(), ": every block)");
  validate_optim(cfg.optim());
  validate_schedule(*cfg.mutable_optim(), cfg.train());
  KEEL_CHECK(cfg.loss().z_loss() >= 0, kConfig, "loss.z_loss=", cfg.loss().z_loss(),
             " must be >= 0 (0 disables)");
  validate_data(*cfg.mutable_data(), cfg.train());
  KEEL_CHECK(cfg.checkpoint().every() >= 0, kConfig, "checkpoint.every=", cfg.checkpoint().every(),
             " must be >= 0 (0: no saves by step count)");
  KEEL_CHECK(cfg.checkpoint().every_minutes() >= 0, kConfig,
             "checkpoint.every_minutes=", cfg.checkpoint().every_minutes(),
             " must be >= 0 (0: no saves by wall clock)");
  KEEL_CHECK(cfg.checkpoint().keep() >= 1, kConfig, "checkpoint.keep=", cfg.checkpoint().keep(),
             " must be >= 1");
  KEEL_CHECK(cfg.checkpoint().keep_every() >= 0, kConfig,
             "checkpoint.keep_every=", cfg.checkpoint().keep_every(),
             " must be >= 0 (0: keep only the newest)");
  KEEL_CHECK(cfg.debug().inject_spike_at_step() >= 0, kConfig,
             "debug.inject_spike_at_step=", cfg.debug().inject_spike_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_bitflip_at_step() >= 0, kConfig,
             "debug.inject_bitflip_at_step=", cfg.debug().inject_bitflip_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_param_bitflip_at_step() >= 0, kConfig,
             "debug.inject_param_bitflip_at_step=", cfg.debug().inject_param_bitflip_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_bitflip_rank() >= 0, kConfig,
             "debug.inject_bitflip_rank=", cfg.debug().inject_bitflip_rank(),
             " must be >= 0 (a world rank)");
  KEEL_CHECK(cfg.debug().inject_nan_at_step() >= 0, kConfig,
             "debug.inject_nan_at_step=", cfg.debug().inject_nan_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_every() >= 0, kConfig,
             "debug.inject_every=", cfg.debug().inject_every(), " must be >= 0 (0: inject once)");
  KEEL_CHECK(cfg.debug().inject_factor() > 0, kConfig,
             "debug.inject_factor=", cfg.debug().inject_factor(), " must be > 0");
  validate_spike(cfg.spike());
  {
    // Note [replay] (launch/train/forensics.h): a replay recomputes the step and compares it bit
    // for bit, so a backward that is not repeatable would read as a hardware fault. Refused
    // rather than a softer verdict, which would lose the replay's evidence of a bad GPU. On the
    // CPU the flag changes nothing (its kernels are deterministic), so any value passes there.
    const std::string dev = upper_ascii(cfg.train().device());
    const bool replays = cfg.spike().replay() || cfg.spike().replay_every() > 0;
    KEEL_CHECK(
        cfg.train().deterministic() || !replays || dev == "CPU", kConfig,
        "train.deterministic=false with spike.replay=", cfg.spike().replay() ? "true" : "false",
        " spike.replay_every=", cfg.spike().replay_every(),
        " on train.device=", dev.empty() ? "AUTO" : dev,
        ": the spike guard's replay needs bitwise repeatable steps; set "
        "train.deterministic=true, or spike.replay=false and spike.replay_every=0");
  }
  KEEL_CHECK(cfg.alert().timeout_s() > 0 && cfg.alert().timeout_s() <= 3600, kConfig,
             "alert.timeout_s=", cfg.alert().timeout_s(),
             " must be in (0, 3600] seconds (a hook still running after it is killed)");
  KEEL_CHECK(cfg.alert().drain_timeout_s() > 0 && cfg.alert().drain_timeout_s() <= 3600, kConfig,
             "alert.drain_timeout_s=", cfg.alert().drain_timeout_s(),
             " must be in (0, 3600] seconds (the end of the run waits at most this long for alert "
             "hooks)");
}

}  // namespace keel
