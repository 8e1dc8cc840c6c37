// Typed errors for keel. Library code throws through KEEL_CHECK / KEEL_FAIL; only main() catches,
// prints one line (on rank 0) and maps the kind to an exit code (see exit_code_for).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace keel {

enum class ErrorKind { kUsage, kConfig, kData, kLayout, kIo, kInternal, kComm };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, const char* file, int line)
      : std::runtime_error(std::move(message)), kind_(kind), file_(file), line_(line) {}
  ErrorKind kind() const { return kind_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorKind kind_;
  const char* file_;
  int line_;
};

// Exit codes (DESIGN.md): 2 for bad usage, config, data or layout; 1 for everything else.
inline int exit_code_for(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUsage:
    case ErrorKind::kConfig:
    case ErrorKind::kData:
    case ErrorKind::kLayout:
      return 2;
    default:
      return 1;
  }
}

const char* error_kind_name(ErrorKind kind);

// `s` as an error message echoes it: whole when short, else its first 64 bytes (whole UTF-8
// characters) and "...", so a pasted 10 MB argument still makes a one-line message.
std::string clip_echo(const std::string& s);

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

}  // namespace keel

#define KEEL_FAIL(kind, ...)                                                                  \
  throw ::keel::Error(::keel::ErrorKind::kind, ::keel::detail::concat(__VA_ARGS__), __FILE__, \
                      __LINE__)

#define KEEL_CHECK(cond, kind, ...) \
  do {                              \
    if (!(cond)) {                  \
      KEEL_FAIL(kind, __VA_ARGS__); \
    }                               \
  } while (0)

// Internal invariant: a failure here is a bug in keel, not in the user's input.
#define KEEL_ASSERT(cond) KEEL_CHECK(cond, kInternal, "internal check failed: " #cond)
