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

}  // namespace keel
