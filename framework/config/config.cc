// Loading keel.proto's KeelConfig: a text-format file merged over the defaults, then --set
// overrides. Proto3 scalars have no declared defaults, so ours live in kDefaultsText
// (config_defaults.cc); a file is merged over them with TextFormat (which, unlike
// Message::MergeFrom, also applies explicit zeros and falses), and --set walks the descriptors so
// every field is reachable by its dotted path. validate() is in config_validate.cc, to_text() in
// config_print.cc.
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
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "framework/config/config_internal.h"
#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {
namespace {

namespace pb = google::protobuf;
using config::KeelConfig;
using config_detail::enum_choices;

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

}  // namespace

namespace config_detail {

// "NONE, RMS, LAYER, L2": the names a user may choose (the *_UNSPECIFIED zero is left out).
std::string enum_choices(const google::protobuf::EnumDescriptor* e) {
  std::string out;
  for (int i = 0; i < e->value_count(); ++i) {
    if (e->value(i)->number() == 0) continue;
    if (!out.empty()) out += ", ";
    out += e->value(i)->name();
  }
  return out;
}

}  // namespace config_detail

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

}  // namespace keel
