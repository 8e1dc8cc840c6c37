// JSON-lines writer for metrics.jsonl and alerts.jsonl: one object per line, flushed per line,
// floats with round-trip precision (%.9g for float-origin values, %.17g for doubles) so runs can
// be compared bit for bit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <variant>
#include <vector>

namespace keel {

class JsonObject {
 public:
  JsonObject& add(const std::string& key, int64_t v);
  JsonObject& add(const std::string& key, double v);   // %.17g
  JsonObject& add_f(const std::string& key, float v);  // %.9g
  JsonObject& add(const std::string& key, const std::string& v);
  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

class JsonlWriter {
 public:
  JsonlWriter() = default;
  explicit JsonlWriter(const std::string& path);  // truncates; throws kIo naming the path
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const JsonObject& obj);
  bool is_open() const { return f_ != nullptr; }

 private:
  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace keel
