// Command-line parsing shared by keel-train and keel-bench, and the one place that turns a
// keel::Error into a one-line message and an exit code.
#pragma once

#include <string>
#include <vector>

#include "launch/train/trainer.h"

namespace keel {

struct TrainArgs {
  std::string config_path;        // may be empty: defaults only
  std::vector<std::string> sets;  // "dotted.path=value"
  std::string run_dir = "runs/default";
  ResumeOptions resume;  // --no-resume, --overwrite, --resume-from PATH
  bool help = false;
};

// Throws kUsage for an unknown flag, a missing value (or another option where the value belongs:
// "--set --run-dir out"), a --set value without '=', or a second config path.
TrainArgs parse_train_args(int argc, char** argv);
const char* train_usage();

}  // namespace keel
