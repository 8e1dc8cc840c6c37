// Helpers shared by the single-process tests: a temporary directory and the "expect a keel::Error
// of this kind with a one-line message" check.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "framework/error.h"

namespace keel::testing {

// A temporary directory removed (with its contents) when it goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "keel_test") {
    std::string tmpl = std::filesystem::temp_directory_path() / (prefix + "_XXXXXX");
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // Writes `text` to file `name` in the directory; returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::string f = file(name);
    std::ofstream(f, std::ios::binary) << text;
    return f;
  }

 private:
  std::string path_;
};

// Runs `fn`, expects a keel::Error of `kind` with a one-line message, and returns the message.
template <typename Fn>
std::string error_of(ErrorKind kind, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    return message;
  }
  ADD_FAILURE() << "no keel::Error thrown";
  return "";
}

}  // namespace keel::testing
