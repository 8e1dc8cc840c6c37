// Defaults, loading, --set overrides, validation and printing of keel.proto's KeelConfig.
// Proto3 scalars have no declared defaults, so ours live in kDefaultsText below; a file is merged
// over them with TextFormat (which, unlike Message::MergeFrom, also applies explicit zeros and
// falses), and --set walks the descriptors so every field is reachable by its dotted path.
#include "framework/config/config.h"

#include <fcntl.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace {

namespace pb = google::protobuf;
using config::KeelConfig;

// Tune freely: every field is listed, so this string is the single place the defaults live.
constexpr const char* kDefaultsText = R"text(
model {
  vocab_size: 256
  seq_len: 128
  d_model: 128
  n_layers: 4
  n_heads: 4
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
}
)text";

// train.sample_chars at most: sampling runs one forward pass per byte, after training.
constexpr int32_t kMaxSampleChars = 1000000;

// A config file is text a person writes; anything larger is a mistake (and would be read whole).
constexpr int64_t kMaxConfigBytes = int64_t{64} << 20;

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

// `message` with each run of characters between spaces or double quotes clip_echo()ped.
std::string clip_tokens(const std::string& message) {
  std::string out;
  size_t start = 0;
  for (size_t i = 0; i <= message.size(); ++i) {
    if (i == message.size() || message[i] == ' ' || message[i] == '"') {
      out += clip_echo(message.substr(start, i - start));
      if (i < message.size()) out += message[i];
      start = i + 1;
    }
  }
  return out;
}

// Why a number as written is not plain decimal ("" when it is). Text format reads a leading 0 as
// octal (train.steps: 010 is 8) and 0x as hexadecimal; a config means neither.
std::string non_decimal(std::string_view number) {
  // The parser skips surrounding whitespace, so this check must too (" 010" is octal to it).
  while (!number.empty() && std::isspace(static_cast<unsigned char>(number.front()))) {
    number.remove_prefix(1);
  }
  if (!number.empty() && (number[0] == '-' || number[0] == '+')) number.remove_prefix(1);
  if (number.size() < 2 || number[0] != '0') return "";
  if (number[1] == 'x' || number[1] == 'X') return "is hexadecimal";
  if (std::isdigit(static_cast<unsigned char>(number[1]))) {
    return "has a leading zero (text format would read it as octal)";
  }
  return "";
}

// Keeps the first error the text-format parser reports. The parser's positions are 0-based and
// point just past the offending token; located() turns them into "<source>:<line>:<col>: <reason>"
// with 1-based positions at the start of the token the reason quotes, when it can be found.
class FirstErrorCollector : public pb::io::ErrorCollector {
 public:
#if GOOGLE_PROTOBUF_VERSION >= 4022000
  void RecordError(int line, pb::io::ColumnNumber column, absl::string_view message) override {
    record(line, column, std::string(message));
  }
  void RecordWarning(int, pb::io::ColumnNumber, absl::string_view) override {}
#else
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    record(line, column, message);
  }
  void AddWarning(int, pb::io::ColumnNumber, const std::string&) override {}
#endif

  bool has_error() const { return has_error_; }
  int line() const { return line_; }
  int column() const { return column_; }
  const std::string& message() const { return message_; }

  // The echoed tokens of the message are clipped (a 10 MB misspelt field name is quoted whole).
  std::string located(const std::string& source, const std::string& text) const {
    std::ostringstream os;
    os << source;
    if (line_ >= 0) {
      const auto [line, column] = token_position(text);
      os << ":" << line + 1 << ":" << column + 1;
    }
    os << ": " << clip_tokens(message_);
    return os.str();
  }

 private:
  void record(int line, int column, const std::string& message) {
    if (has_error_) return;
    has_error_ = true;
    line_ = line;
    column_ = column;
    message_ = message;
  }

  // Where a "quoted" token of the message starts (e.g. the misspelt field name or the bad enum
  // value), as 0-based (line, column). The parser reports an error at the token after the
  // offending one, which may sit on a later line ("  qk_norm: RSM\n}" is reported at the "}"), so
  // this looks back from the parser's position over blank and comment-only lines to the nearest
  // line with text, and takes the rightmost quoted token there. Falls back to the parser's
  // position when the token already starts there ("found X") or is not found.
  std::pair<int, int> token_position(const std::string& text) const {
    std::vector<std::string> lines;
    for (size_t begin = 0; begin <= text.size();) {
      const size_t end = std::min(text.find('\n', begin), text.size());
      lines.push_back(text.substr(begin, end - begin));
      begin = end + 1;
    }
    const std::pair<int, int> parser_position = {line_, column_};
    if (line_ >= static_cast<int>(lines.size())) return parser_position;
    std::vector<std::string> tokens;
    for (size_t q = message_.find('"'); q != std::string::npos;) {
      const size_t end = message_.find('"', q + 1);
      if (end == std::string::npos) break;
      if (end > q + 1) tokens.push_back(message_.substr(q + 1, end - q - 1));
      q = message_.find('"', end + 1);
    }
    for (int l = line_; l >= 0; --l) {
      // The tokenizer counts a tab as up to 8 columns, so columns are byte offsets only without.
      if (lines[l].find('\t') != std::string::npos) return parser_position;
      if (l == line_ && static_cast<size_t>(column_) > lines[l].size()) return parser_position;
      const std::string before = l == line_ ? lines[l].substr(0, column_) : lines[l];
      int best = -1;
      for (const std::string& token : tokens) {
        if (l == line_ && lines[l].compare(column_, token.size(), token) == 0) {
          return parser_position;  // the parser already points at the token ("found X")
        }
        const size_t at = before.rfind(token);
        if (at != std::string::npos) best = std::max(best, static_cast<int>(at));
      }
      if (best >= 0) return {l, best};
      const size_t first = before.find_first_not_of(' ');
      if (first != std::string::npos && before[first] != '#') return parser_position;
    }
    return parser_position;
  }

  bool has_error_ = false;
  int line_ = -1;
  int column_ = 0;
  std::string message_;
};

std::string field_names(const pb::Descriptor* d) {
  std::string out;
  for (int i = 0; i < d->field_count(); ++i) {
    if (i > 0) out += ", ";
    out += d->field(i)->name();
  }
  return out;
}

// "NONE, RMS, LAYER, L2": the names a user may choose (the *_UNSPECIFIED zero is left out).
std::string enum_choices(const pb::EnumDescriptor* e) {
  std::string out;
  for (int i = 0; i < e->value_count(); ++i) {
    if (e->value(i)->number() == 0) continue;
    if (!out.empty()) out += ", ";
    out += e->value(i)->name();
  }
  return out;
}

std::string read_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer (it changes
  // nothing for a regular file), so the check below refuses it rather than hanging.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KEEL_CHECK(fd >= 0, kConfig, path, ": cannot open config file: ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  KEEL_CHECK(fstat(fd, &st) == 0, kConfig, path,
             ": cannot stat config file: ", std::strerror(errno));
  KEEL_CHECK(!S_ISDIR(st.st_mode), kConfig, path, ": is a directory, not a config file");
  KEEL_CHECK(S_ISREG(st.st_mode), kConfig, path, ": is ", file_type_name(st.st_mode),
             ", not a regular config file");
  KEEL_CHECK(st.st_size <= kMaxConfigBytes, kConfig, path, ": is ", st.st_size,
             " bytes; a config file is at most ", kMaxConfigBytes, " bytes");
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (static_cast<int64_t>(text.size()) <= kMaxConfigBytes) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    KEEL_CHECK(n >= 0, kConfig, path, ": cannot read config file: ", std::strerror(errno));
    if (n == 0) return text;
    text.append(buf, static_cast<size_t>(n));
  }
  KEEL_FAIL(kConfig, path, ": grew past ", kMaxConfigBytes, " bytes while being read");
}

// What merge_config_text checks beyond the parser, from one pass of the text-format tokenizer.
struct TextScan {
  struct Block {
    std::string name;  // the field the block sets ("model")
    int line, column;  // of its "{", 0-based
  };
  std::vector<Block> open;           // blocks not closed by the end of the text, outermost first
  int end_line = 0, end_column = 0;  // just past the last token, 0-based
  // The first integer not written in plain decimal (010, 0x20), if any.
  bool bad_number = false;
  int number_line = 0, number_column = 0;
  std::string number_field, number_text, number_reason;
};

TextScan scan_text(const std::string& text) {
  TextScan scan;
  pb::io::ArrayInputStream input(text.data(), static_cast<int>(text.size()));
  FirstErrorCollector ignored;  // the parser reports the tokenizer's errors itself
  pb::io::Tokenizer tokens(&input, &ignored);
  tokens.set_comment_style(pb::io::Tokenizer::SH_COMMENT_STYLE);  // as TextFormat::Parser sets it
  tokens.set_allow_f_after_float(true);
  tokens.set_require_space_after_number(false);
  std::string name;   // the last identifier: the field a ":" or "{" belongs to
  std::string field;  // the field whose value comes next
  while (tokens.Next()) {
    const pb::io::Tokenizer::Token& t = tokens.current();
    scan.end_line = t.line;
    scan.end_column = t.end_column;
    if (t.type == pb::io::Tokenizer::TYPE_IDENTIFIER) {
      name = t.text;
    } else if (t.type == pb::io::Tokenizer::TYPE_SYMBOL) {
      if (t.text == ":") {
        field = name;
      } else if (t.text == "{" || t.text == "<") {
        scan.open.push_back({name, t.line, t.column});
      } else if ((t.text == "}" || t.text == ">") && !scan.open.empty()) {
        scan.open.pop_back();
      }
    } else if (t.type == pb::io::Tokenizer::TYPE_INTEGER && !scan.bad_number) {
      const std::string reason = non_decimal(t.text);
      if (reason.empty()) continue;
      scan.bad_number = true;
      scan.number_line = t.line;
      scan.number_column = t.column;
      for (const TextScan::Block& b : scan.open) scan.number_field += b.name + ".";
      scan.number_field += field;
      scan.number_text = t.text;
      scan.number_reason = reason;
    }
  }
  return scan;
}

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
  KEEL_CHECK(m.d_model() % m.n_heads() == 0, kConfig, "model.n_heads=", m.n_heads(),
             " does not divide model.d_model=", m.d_model());
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
    KEEL_CHECK((m.d_model() / m.n_heads()) % 2 == 0, kConfig,
               "model.position=ROPE needs an even head_dim; model.d_model=", m.d_model(),
               " / model.n_heads=", m.n_heads(), " is odd");
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

std::string default_config_text() { return kDefaultsText; }

KeelConfig default_config() {
  KeelConfig cfg;
  merge_config_text(kDefaultsText, "<built-in defaults>", cfg);
  return cfg;
}

void merge_config_text(const std::string& file_text, const std::string& source, KeelConfig& cfg) {
  // A UTF-8 byte-order mark (some editors write one) is an encoding marker, not config text: it
  // is skipped, so positions count what the editor shows.
  const std::string text =
      file_text.rfind(kUtf8Bom, 0) == 0 ? file_text.substr(kUtf8Bom.size()) : file_text;
  KEEL_CHECK(text.size() <= static_cast<size_t>(kMaxConfigBytes), kConfig, source, ": is ",
             text.size(), " bytes; a config is at most ", kMaxConfigBytes, " bytes");
  FirstErrorCollector errors;
  pb::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  const TextScan scan = scan_text(text);
  auto at = [&](int line, int column) {
    return source + ":" + std::to_string(line + 1) + ":" + std::to_string(column + 1) + ": ";
  };
  auto fail_number = [&] {
    KEEL_FAIL(kConfig, at(scan.number_line, scan.number_column), scan.number_field, ": ",
              clip_echo(scan.number_text), " ", scan.number_reason, "; integers are decimal only");
  };
  // Parse (which rejects a field given twice) into a scratch message for the diagnostics, then
  // merge (which applies explicit zeros over the defaults) into cfg.
  KeelConfig scratch;
  if (!parser.ParseFromString(text, &scratch)) {
    KEEL_CHECK(errors.has_error(), kConfig, source, ": cannot parse");
    const std::pair<int, int> error_at = {errors.line(), errors.column()};
    if (scan.bad_number && std::pair(scan.number_line, scan.number_column) <= error_at) {
      fail_number();  // "09": the tokenizer's own message does not name the field
    }
    // At the end of the text the parser still wants a field name: a block was left open.
    const bool at_end = error_at >= std::pair(scan.end_line, scan.end_column);
    if (at_end && !scan.open.empty() && errors.message().rfind("Expected identifier", 0) == 0) {
      const TextScan::Block& b = scan.open.back();
      KEEL_FAIL(kConfig, at(b.line, b.column), "block '", clip_echo(b.name),
                "' opened here is never closed (missing '}' at the end of the file)");
    }
    KEEL_FAIL(kConfig, errors.located(source, text));
  }
  if (scan.bad_number) fail_number();
  const bool merged = parser.MergeFromString(text, &cfg);
  KEEL_ASSERT(merged);
}

KeelConfig load_config(const std::string& path, const std::vector<std::string>& sets) {
  KeelConfig cfg = default_config();
  if (!path.empty()) merge_config_text(read_file(path), path, cfg);
  for (const std::string& set : sets) apply_set(set, cfg);
  validate(cfg);
  return cfg;
}

void apply_set(const std::string& assignment, KeelConfig& cfg) {
  const size_t eq = assignment.find('=');
  KEEL_CHECK(eq != std::string::npos, kUsage, "--set ", clip_echo(assignment),
             ": expected dotted.path=value (e.g. --set model.n_heads=8)");
  const std::string full_path = assignment.substr(0, eq);
  const std::string path = clip_echo(full_path);  // as messages echo it
  const std::string value = assignment.substr(eq + 1);
  const std::string echo = "--set " + path + "=" + clip_echo(value);

  pb::Message* msg = &cfg;
  std::string walked;  // the dotted path of `msg`
  size_t start = 0;
  while (true) {
    const size_t dot = full_path.find('.', start);
    const std::string name = full_path.substr(start, dot == std::string::npos ? dot : dot - start);
    const pb::Descriptor* d = msg->GetDescriptor();
    const pb::FieldDescriptor* f = d->FindFieldByName(name);
    KEEL_CHECK(f != nullptr, kConfig, "--set ", path, ": no such field (",
               walked.empty() ? "the config" : walked, " has: ", field_names(d), ")");
    const std::string here = walked.empty() ? name : walked + "." + name;
    const bool is_message = f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE;
    KEEL_ASSERT(!f->is_repeated());  // keel.proto has no repeated fields
    if (dot == std::string::npos) {
      KEEL_CHECK(!is_message, kConfig, "--set ", path, ": ", here,
                 " is a section; set one of its fields (", here,
                 " has: ", field_names(f->message_type()), ")");
      const pb::Reflection* r = msg->GetReflection();
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
        r->SetString(msg, f, value);  // verbatim: --set data.path=/d/x.bin needs no quotes
      } else if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_ENUM) {
        const pb::EnumValueDescriptor* v = f->enum_type()->FindValueByName(value);
        KEEL_CHECK(v != nullptr && v->number() != 0, kConfig, echo,
                   ": invalid value for enum field (choose one of ", enum_choices(f->enum_type()),
                   ")");
        r->SetEnum(msg, f, v);
      } else {
        const std::string reason = non_decimal(value);
        KEEL_CHECK(reason.empty(), kConfig, echo, ": ", clip_echo(value), " ", reason,
                   "; numbers are decimal only");
        FirstErrorCollector silent;
        pb::TextFormat::Parser parser;
        parser.RecordErrorsTo(&silent);
        KEEL_CHECK(parser.ParseFieldValueFromString(value, f, msg), kConfig, echo,
                   ": invalid value for ", f->type_name(), " field");
      }
      return;
    }
    KEEL_CHECK(is_message, kConfig, "--set ", path, ": ", here, " is a ", f->type_name(),
               " field, not a section");
    msg = msg->GetReflection()->MutableMessage(msg, f);
    walked = here;
    start = dot + 1;
  }
}

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
             " must be >= 0 (0 disables checkpoints)");
  KEEL_CHECK(cfg.checkpoint().keep() >= 1, kConfig, "checkpoint.keep=", cfg.checkpoint().keep(),
             " must be >= 1");
  KEEL_CHECK(cfg.checkpoint().keep_every() >= 0, kConfig,
             "checkpoint.keep_every=", cfg.checkpoint().keep_every(),
             " must be >= 0 (0: keep only the newest)");
  KEEL_CHECK(cfg.debug().inject_spike_at_step() >= 0, kConfig,
             "debug.inject_spike_at_step=", cfg.debug().inject_spike_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_nan_at_step() >= 0, kConfig,
             "debug.inject_nan_at_step=", cfg.debug().inject_nan_at_step(),
             " must be >= 0 (0: never)");
  KEEL_CHECK(cfg.debug().inject_every() >= 0, kConfig,
             "debug.inject_every=", cfg.debug().inject_every(), " must be >= 0 (0: inject once)");
  KEEL_CHECK(cfg.debug().inject_factor() > 0, kConfig,
             "debug.inject_factor=", cfg.debug().inject_factor(), " must be > 0");
  validate_spike(cfg.spike());
  KEEL_CHECK(cfg.alert().timeout_s() > 0 && cfg.alert().timeout_s() <= 3600, kConfig,
             "alert.timeout_s=", cfg.alert().timeout_s(),
             " must be in (0, 3600] seconds (a hook still running after it is killed)");
  KEEL_CHECK(cfg.alert().drain_timeout_s() > 0 && cfg.alert().drain_timeout_s() <= 3600, kConfig,
             "alert.drain_timeout_s=", cfg.alert().drain_timeout_s(),
             " must be in (0, 3600] seconds (the end of the run waits at most this long for alert "
             "hooks)");
}

namespace {

void print_message(const pb::Message& msg, int indent, std::string& out) {
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  const std::string pad(indent, ' ');
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      out += pad + f->name() + " {\n";
      print_message(r->GetMessage(msg, f), indent + 2, out);
      out += pad + "}\n";
    } else {
      std::string value;
      pb::TextFormat::PrintFieldValueToString(msg, f, -1, &value);
      out += pad + f->name() + ": " + value + "\n";
    }
  }
}

}  // namespace

std::string to_text(const KeelConfig& cfg) {
  std::string out;
  print_message(cfg, 0, out);
  return out;
}

}  // namespace keel
