// JSON-lines metrics output.
#include "framework/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {

namespace {
std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "NaN";  // JSON has no NaN; Python's json and jq accept these tokens
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}
}  // namespace

JsonObject& JsonObject::add(const std::string& key, int64_t v) {
  fields_.emplace_back(key, std::to_string(v));
  return *this;
}
// JSON has no NaN or infinity: a non-finite value is written as null (the trainer names which
// values were non-finite in a "nonfinite" field beside them).
JsonObject& JsonObject::add(const std::string& key, double v) {
  fields_.emplace_back(key, std::isfinite(v) ? fmt("%.17g", v) : std::string("null"));
  return *this;
}
JsonObject& JsonObject::add_f(const std::string& key, float v) {
  fields_.emplace_back(key, std::isfinite(v) ? fmt("%.9g", v) : std::string("null"));
  return *this;
}
JsonObject& JsonObject::add(const std::string& key, const std::string& v) {
  std::string quoted = "\"";
  quoted += escape(v);
  quoted += '"';
  fields_.emplace_back(key, std::move(quoted));
  return *this;
}
std::string JsonObject::str() const {
  std::string s = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    if (i) s += ", ";
    s += '"';
    s += escape(fields_[i].first);
    s += "\": ";
    s += fields_[i].second;
  }
  s += '}';
  return s;
}

JsonlWriter::JsonlWriter(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | (append ? 0 : O_TRUNC) | O_CLOEXEC, 0644);
  KEEL_CHECK(fd_ >= 0, kIo, path, ": cannot open for writing: ", std::strerror(errno));
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  KEEL_CHECK(end >= 0, kIo, path, ": cannot seek: ", std::strerror(errno));
  size_ = end;
}
JsonlWriter::~JsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}
void JsonlWriter::write(const JsonObject& obj) {
  if (fd_ < 0) return;
  append_whole(fd_, path_, obj.str() + "\n", size_);
}

}  // namespace keel
