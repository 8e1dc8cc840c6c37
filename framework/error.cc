// Names of error kinds, used in the one-line messages main() prints.
#include "framework/error.h"

namespace keel {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUsage:
      return "usage error";
    case ErrorKind::kConfig:
      return "config error";
    case ErrorKind::kData:
      return "data error";
    case ErrorKind::kLayout:
      return "layout error";
    case ErrorKind::kIo:
      return "io error";
    case ErrorKind::kComm:
      return "communication error";
    case ErrorKind::kInternal:
      return "internal error";
  }
  return "error";
}

std::string clip_echo(const std::string& s) {
  constexpr size_t kEchoMax = 64;
  if (s.size() <= kEchoMax) return s;
  size_t cut = kEchoMax;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

}  // namespace keel
