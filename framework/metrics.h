// JSON-lines writer for metrics.jsonl and alerts.jsonl: one object per line, written whole with
// write(2) (a failed write is rolled back, so the file always ends with a complete line), floats
// with round-trip precision (%.9g for float-origin values, %.17g for doubles) so runs can be
// compared bit for bit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace keel {

// Appends `s` as a quoted JSON string: quotes, backslashes and control characters escaped, and
// U+FFFD for each byte that does not start a valid UTF-8 sequence, so every line parses.
void append_json_string(std::string& out, std::string_view s);
// Appends v with %.17g (round trip), or null when it is not finite.
void append_json_number(std::string& out, double v);

class JsonObject {
 public:
  JsonObject& add(const std::string& key, int64_t v);
  JsonObject& add(const std::string& key, double v);   // %.17g; null when not finite
  JsonObject& add_f(const std::string& key, float v);  // %.9g; null when not finite
  JsonObject& add(const std::string& key, const std::string& v);
  JsonObject& add_null(const std::string& key);
  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

class JsonlWriter {
 public:
  JsonlWriter() = default;
  // Truncates the file, or with append = true continues after its last line. Throws kIo naming
  // the path.
  explicit JsonlWriter(const std::string& path, bool append = false);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  // Appends obj as one line. On failure (disk full, file-size limit) the partial line is cut
  // off again and kIo names the file and the OS reason.
  void write(const JsonObject& obj);
  // fsync: every line written so far survives a crash of the machine. Throws kIo naming the file.
  void sync();
  bool is_open() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  int64_t size_ = 0;  // bytes of complete lines in the file
  std::string path_;
};

}  // namespace keel
