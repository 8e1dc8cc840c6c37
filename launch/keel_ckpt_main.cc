// keel-ckpt: look at and check checkpoints without training.
//   keel-ckpt info PATH     step, tokens, the layout that wrote it, data fingerprints, and every
//                           tensor with its shape and slices
//   keel-ckpt verify PATH   every file size and every slice's XXH3 checksum and coverage
// PATH is a checkpoint directory (RUN/checkpoints/step_NNNNNNNN), or RUN/checkpoints or RUN, in
// which case LATEST picks it. Exit codes: 0 fine; 2 bad usage or a bad checkpoint (one line
// naming the file, the tensor and the reason); 1 anything else.
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "checkpoints/checkpoint.h"
#include "framework/data/fingerprint.h"
#include "framework/error.h"

namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: keel-ckpt info PATH | keel-ckpt verify PATH\n"
    "  PATH  a checkpoint directory (RUN/checkpoints/step_NNNNNNNN), or RUN/checkpoints or RUN\n"
    "        (then LATEST names the checkpoint)\n"
    "  info    step, tokens, writer layout, data fingerprints, tensors and their slices\n"
    "  verify  every file size and every slice checksum; exit 0 when all hold, 2 otherwise\n";

// A checkpoint directory from what the user typed.
std::string resolve(const std::string& path) {
  std::error_code ec;
  if (fs::exists(path + "/manifest.pb", ec)) return path;
  for (const std::string& root : {path, path + "/checkpoints"}) {
    if (!fs::exists(root + "/LATEST", ec)) continue;
    const keel::CheckpointStore store(root);
    const auto latest = store.latest();
    KEEL_CHECK(latest.has_value(), kData, root, "/LATEST: does not name a checkpoint that exists");
    return store.path_of(*latest);
  }
  // Not a checkpoint: let read_manifest name what is missing.
  KEEL_CHECK(fs::is_directory(path, ec), kUsage, path,
             ": no such directory (expected a checkpoint directory or a run directory)");
  return path;
}

std::string shape_text(const keel::ckpt::TensorRecord& t) {
  std::string s = "[";
  for (int i = 0; i < t.shape_size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape(i));
  return s + "]";
}

int info(const std::string& dir) {
  const keel::ckpt::Manifest m = keel::read_manifest(dir);
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("format version %u | step %lld | %lld tokens | next sample %llu | AdamW t %lld\n",
              m.format_version(), static_cast<long long>(m.step()),
              static_cast<long long>(m.tokens()), static_cast<unsigned long long>(m.next_sample()),
              static_cast<long long>(m.adam_t()));
  std::printf("written by %d ranks = dp %d x tp %d%s\n", m.layout().world(), m.layout().dp(),
              m.layout().tp(), m.layout().zero_stage() ? " (ZeRO-1)" : "");
  std::printf("data: train %s, validation %s | skipped ranges %d\n",
              keel::fingerprint_hex(m.train_fingerprint()).c_str(),
              keel::fingerprint_hex(m.val_fingerprint()).c_str(), m.skipped_size());
  int64_t bytes = 0;
  for (const auto& f : m.files()) bytes += f.bytes();
  std::printf("%d shard files, %lld bytes\n", m.files_size(), static_cast<long long>(bytes));
  int64_t params = 0;
  for (const auto& t : m.tensors()) {
    int64_t n = 1;
    for (int64_t d : t.shape()) n *= d;
    if (t.kind() == keel::ckpt::PARAM) params += n;
    std::printf("  %-28s %-7s %-5s %-18s %d slice(s)\n", t.name().c_str(),
                keel::tensor_kind_name(t.kind()), t.dtype().c_str(), shape_text(t).c_str(),
                t.slices_size());
  }
  std::printf("%lld parameters\n", static_cast<long long>(params));
  return 0;
}

int verify(const std::string& dir) {
  keel::verify_checkpoint(dir);
  const keel::ckpt::Manifest m = keel::read_manifest(dir);
  int slices = 0;
  for (const auto& t : m.tensors()) slices += t.slices_size();
  int64_t bytes = 0;
  for (const auto& f : m.files()) bytes += f.bytes();
  std::printf("%s: ok (step %lld, %d tensors, %d slices, %lld bytes checked)\n", dir.c_str(),
              static_cast<long long>(m.step()), m.tensors_size(), slices,
              static_cast<long long>(bytes));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "-h" || cmd == "--help") {
      std::printf("%s", kUsage);
      return 0;
    }
    KEEL_CHECK(argc == 3 && (cmd == "info" || cmd == "verify"), kUsage,
               "expected 'info PATH' or 'verify PATH' (see --help)");
    const std::string dir = resolve(argv[2]);
    return cmd == "info" ? info(dir) : verify(dir);
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "keel-ckpt: %s: %s\n", keel::error_kind_name(e.kind()), e.what());
    return keel::exit_code_for(e.kind());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-ckpt: internal error: %s\n", e.what());
    return 1;
  }
}
