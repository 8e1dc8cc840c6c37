// JSON-lines metrics output.
#include "framework/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string_view>

#include "framework/error.h"
#include "framework/file_io.h"

namespace keel {

namespace {
std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}
}  // namespace

// Appends `s` as a JSON string (quoted): escapes quotes, backslashes and control characters, and
// writes U+FFFD for each byte that does not start a valid UTF-8 sequence.
void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (c < 0x20 || c == 0x7f) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
      continue;
    }
    // A multi-byte sequence: its length from the lead byte, then continuation bytes, rejecting
    // overlong forms, surrogates and code points past U+10FFFF.
    size_t len = 0;
    uint32_t cp = 0;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      ok = (cc & 0xC0) == 0x80;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (ok) {
      ok = !(len == 3 && cp < 0x800) && !(len == 4 && cp < 0x10000) &&
           !(cp >= 0xD800 && cp <= 0xDFFF) && cp <= 0x10FFFF;
    }
    if (ok) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\\ufffd";
      ++i;
    }
  }
  out += '"';
}

void append_json_number(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  out += buf;
}

JsonObject& JsonObject::add(const std::string& key, int64_t v) {
  fields_.emplace_back(key, std::to_string(v));
  return *this;
}
// JSON has no NaN or infinity: a non-finite value is written as null (the trainer names which
// values were non-finite in a "nonfinite" field beside them).
JsonObject& JsonObject::add(const std::string& key, double v) {
  std::string text;
  append_json_number(text, v);
  fields_.emplace_back(key, std::move(text));
  return *this;
}
JsonObject& JsonObject::add_null(const std::string& key) {
  fields_.emplace_back(key, "null");
  return *this;
}
JsonObject& JsonObject::add_f(const std::string& key, float v) {
  fields_.emplace_back(key, std::isfinite(v) ? fmt("%.9g", v) : std::string("null"));
  return *this;
}
JsonObject& JsonObject::add(const std::string& key, const std::string& v) {
  std::string quoted;
  append_json_string(quoted, v);
  fields_.emplace_back(key, std::move(quoted));
  return *this;
}
std::string JsonObject::str() const {
  std::string s = "{";
  for (size_t i = 0; i < fields_.size(); ++i) {
    if (i) s += ", ";
    append_json_string(s, fields_[i].first);
    s += ": ";
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

void JsonlWriter::sync() {
  if (fd_ < 0) return;
  int rc;
  do {
    rc = ::fsync(fd_);
  } while (rc != 0 && errno == EINTR);
  KEEL_CHECK(rc == 0, kIo, path_, ": fsync failed: ", std::strerror(errno));
}

}  // namespace keel
