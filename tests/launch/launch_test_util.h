// Helpers shared by the launch tests: a temporary directory, whole-file reads and writes, and
// running a command line through the shell with its stdout, stderr and exit status captured.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace keel::testing {

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Single-quotes `s` for sh.
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

struct CommandResult {
  int exit_code = -1;  // the exit status, or 128 + signal when killed by one
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs `command` (a shell command line) under `timeout 120` in the directory `scratch`, with
// stdout and stderr captured separately through files there.
inline CommandResult run_command(const std::string& command, const TempDir& scratch) {
  const std::string out_path = scratch.file("captured.stdout");
  const std::string err_path = scratch.file("captured.stderr");
  const std::string line = "cd " + shell_quote(scratch.path()) + " && timeout 120 " + command +
                           " >" + shell_quote(out_path) + " 2>" + shell_quote(err_path) +
                           " </dev/null";
  const int status = std::system(line.c_str());
  CommandResult r;
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (status != -1 && WIFSIGNALED(status)) r.exit_code = 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return r;
}

// `program` followed by each of `args`, quoted for sh.
inline std::string command_line(const std::string& program, const std::vector<std::string>& args) {
  std::string line = shell_quote(program);
  for (const std::string& a : args) {
    line += ' ';
    line += shell_quote(a);
  }
  return line;
}

// The "loss" of every line of a metrics.jsonl's text, in order.
inline std::vector<double> metric_losses(const std::string& metrics) {
  std::vector<double> out;
  std::istringstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find("\"loss\": ");  // not "z_loss": the quote comes first
    if (at != std::string::npos) out.push_back(std::strtod(line.c_str() + at + 8, nullptr));
  }
  return out;
}

#if defined(KEEL_TRAIN_BIN) && defined(KEEL_MPIEXEC)
// keel-train with `args` as a shell command line: on `ranks` ranks under mpiexec (as root,
// oversubscribed, unbound, with `mpi_opts`), or directly when ranks is 1.
inline std::string train_command(const std::vector<std::string>& args, int ranks,
                                 const std::string& mpi_opts = "") {
  const std::string cmd = command_line(KEEL_TRAIN_BIN, args);
  if (ranks <= 1) return cmd;
  return "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " +
         shell_quote(KEEL_MPIEXEC) + " -n " + std::to_string(ranks) +
         " --oversubscribe --bind-to none " + (mpi_opts.empty() ? "" : mpi_opts + " ") + cmd;
}
#endif

}  // namespace keel::testing
