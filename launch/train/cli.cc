// keel-train command line: keel-train [CONFIG.pbtxt] [--set path=value]... [--run-dir DIR]
// [--no-resume [--overwrite] | --resume-from PATH [--overwrite]]
#include "launch/train/cli.h"

#include <cstring>
#include <string>

#include "framework/error.h"

namespace keel {

const char* train_usage() {
  return "usage: keel-train [CONFIG.pbtxt] [--set path.to.field=value]... [--run-dir DIR]\n"
         "                  [--no-resume [--overwrite] | --resume-from PATH [--overwrite]]\n"
         "  CONFIG.pbtxt        Protobuf text-format config (framework/config/keel.proto); "
         "optional\n"
         "  --set k=v           override one field by its dotted path, e.g. --set "
         "model.n_layers=6\n"
         "  --run-dir DIR       where metrics.jsonl, config.pbtxt and checkpoints go "
         "(runs/default)\n"
         "  --no-resume         start fresh even if DIR/checkpoints holds checkpoints (refused\n"
         "                      unless --overwrite, which deletes them); default: resume from\n"
         "                      DIR/checkpoints/LATEST\n"
         "  --resume-from PATH  load this checkpoint directory (exit 2 if it is unusable); one of\n"
         "                      DIR/checkpoints starts a new lineage there (the newer ones are\n"
         "                      deleted); one from elsewhere needs DIR/checkpoints empty, or\n"
         "                      --overwrite to delete what it holds\n";
}

TrainArgs parse_train_args(int argc, char** argv) {
  TrainArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* flag) -> std::string {
      KEEL_CHECK(i + 1 < argc, kUsage, flag, " needs a value");
      const std::string v = argv[++i];
      // "--set --run-dir out": the next option is not this flag's value.
      KEEL_CHECK(v.rfind("--", 0) != 0, kUsage, flag, " needs a value, got the option ",
                 clip_echo(v));
      return v;
    };
    // A --set value must be an assignment, not a bare word taken by mistake.
    auto assignment = [&](const std::string& v) {
      KEEL_CHECK(v.find('=') != std::string::npos, kUsage, "--set ", clip_echo(v),
                 ": expected dotted.path=value (e.g. --set model.n_heads=8)");
      return v;
    };
    if (arg == "-h" || arg == "--help") {
      a.help = true;
    } else if (arg == "--set") {
      a.sets.push_back(assignment(value("--set")));
    } else if (arg.rfind("--set=", 0) == 0) {
      a.sets.push_back(assignment(arg.substr(6)));
    } else if (arg == "--run-dir") {
      a.run_dir = value("--run-dir");
    } else if (arg.rfind("--run-dir=", 0) == 0) {
      a.run_dir = arg.substr(10);
    } else if (arg == "--no-resume") {
      a.resume.mode = ResumeMode::kFresh;
    } else if (arg == "--overwrite") {
      a.resume.overwrite = true;
    } else if (arg == "--resume-from") {
      a.resume.mode = ResumeMode::kFrom;
      a.resume.path = value("--resume-from");
    } else if (arg.rfind("--resume-from=", 0) == 0) {
      a.resume.mode = ResumeMode::kFrom;
      a.resume.path = arg.substr(14);
    } else if (arg.rfind("-", 0) == 0) {
      KEEL_FAIL(kUsage, "unknown option ", clip_echo(arg), " (see --help)");
    } else {
      KEEL_CHECK(a.config_path.empty(), kUsage, "more than one config file given: ", a.config_path,
                 " and ", arg);
      a.config_path = arg;
    }
  }
  KEEL_CHECK(!a.run_dir.empty(), kUsage, "--run-dir must not be empty");
  KEEL_CHECK(!a.resume.overwrite || a.resume.mode != ResumeMode::kAuto, kUsage,
             "--overwrite only goes with --no-resume or --resume-from (it deletes the run's "
             "checkpoints)");
  KEEL_CHECK(a.resume.mode != ResumeMode::kFrom || !a.resume.path.empty(), kUsage,
             "--resume-from needs a checkpoint directory");
  return a;
}

}  // namespace keel
