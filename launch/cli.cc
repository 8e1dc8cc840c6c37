// keel-train command line: keel-train [CONFIG.pbtxt] [--set path=value]... [--run-dir DIR]
#include "launch/cli.h"

#include <cstring>

#include "framework/error.h"

namespace keel {

const char* train_usage() {
  return "usage: keel-train [CONFIG.pbtxt] [--set path.to.field=value]... [--run-dir DIR]\n"
         "  CONFIG.pbtxt   Protobuf text-format config (framework/config/keel.proto); optional\n"
         "  --set k=v      override one field by its dotted path, e.g. --set model.n_layers=6\n"
         "  --run-dir DIR  where metrics.jsonl, config.pbtxt and checkpoints go (runs/default)\n";
}

TrainArgs parse_train_args(int argc, char** argv) {
  TrainArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> std::string {
      KEEL_CHECK(i + 1 < argc, kUsage, flag, " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      a.help = true;
    } else if (arg == "--set") {
      a.sets.push_back(value("--set"));
    } else if (arg.rfind("--set=", 0) == 0) {
      a.sets.push_back(arg.substr(6));
    } else if (arg == "--run-dir") {
      a.run_dir = value("--run-dir");
    } else if (arg.rfind("--run-dir=", 0) == 0) {
      a.run_dir = arg.substr(10);
    } else if (arg.rfind("-", 0) == 0) {
      KEEL_FAIL(kUsage, "unknown option ", arg, " (see --help)");
    } else {
      KEEL_CHECK(a.config_path.empty(), kUsage, "more than one config file given: ", a.config_path,
                 " and ", arg);
      a.config_path = arg;
    }
  }
  KEEL_CHECK(!a.run_dir.empty(), kUsage, "--run-dir must not be empty");
  return a;
}

}  // namespace keel
