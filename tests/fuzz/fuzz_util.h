// What every harness does with an input: run the reader on it and accept either a result or a
// keel::Error of a kind the user is told about (the reader refused the input with a one-line
// reason). Anything else is a bug and aborts, which libFuzzer records as a crash: an exception of
// another type (std::out_of_range, nlohmann's, protobuf's), a keel::Error of kind kInternal
// (KEEL_ASSERT: "a bug in keel, not in the user's input"), or a property a harness checks
// (round trips) failing. Sanitizer reports and timeouts are crashes by themselves.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "framework/error.h"

namespace keel::fuzz {

[[noreturn]] inline void bug(const std::string& what) {
  std::fprintf(stderr, "keel fuzz: BUG: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Runs fn(); returns true when it returned, false when it threw an expected keel::Error.
template <typename Fn>
bool accepts(Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kInternal) {
      bug(std::string("keel::Error of kind internal: ") + e.what() + " (" + e.file() + ":" +
          std::to_string(e.line()) + ")");
    }
    return false;
  } catch (const std::exception& e) {
    bug(std::string("exception that is not a keel::Error: ") + e.what());
  } catch (...) {
    bug("exception of an unknown type");
  }
}

// Aborts with `what` unless `ok`.
inline void check(bool ok, const std::string& what) {
  if (!ok) bug(what);
}

}  // namespace keel::fuzz
