// Fuzzes the checkpoint manifest reader and validator (checkpoints/manifest_io.h parse_manifest:
// no file system). Each input is parsed as it is, and again with a correct checksum record
// appended (so mutations get past the checksum into the validator, as an edit by someone who
// recomputed it would). A manifest that is accepted must write (serialize_manifest) and read
// back to the same manifest, byte for byte (a NaN in its config included). Then keel-ckpt
// export's plan for it (plan_export, checkpoints/export.h: its model config is untrusted too)
// must be refused with a keel::Error or give a safetensors header that reads back as the plan.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "checkpoints/export.h"
#include "checkpoints/manifest_io.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// The message's bytes in field-number order (unknown fields last): equal bytes, equal manifests,
// where a field-by-field comparison would call NaN unequal to itself.
std::string canonical(const keel::ckpt::Manifest& m) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  (void)m.ByteSizeLong();  // caches the sizes SerializeWithCachedSizes writes
  m.SerializeWithCachedSizes(&coded);
  return out;
}

// keel-ckpt export's plan for `m`, written as a safetensors header and read back.
void export_plan(const keel::ckpt::Manifest& m) {
  keel::ExportPlan plan;
  if (!keel::fuzz::accepts([&] { plan = keel::plan_export("step_00000020", m); })) return;
  std::string head;
  keel::fuzz::check(
      keel::fuzz::accepts([&] {
        const std::string header = keel::encode_safetensors_header(plan, {{"format", "pt"}});
        const uint64_t n = header.size();
        head.assign(reinterpret_cast<const char*>(&n), 8);
        head += header;
      }),
      "the export plan of an accepted manifest cannot be written");
  keel::SafetensorsHeader h;
  keel::fuzz::check(keel::fuzz::accepts([&] {
                      h = keel::decode_safetensors_header(head, std::nullopt, "model.safetensors");
                    }),
                    "the export plan's header is refused");
  keel::fuzz::check(h.tensors.size() == plan.tensors.size(),
                    "the export plan's header lost tensors");
}

// `bytes` followed by manifest_xxh3 (field 15, fixed64) holding the XXH3-64 of `bytes`: the
// checksum record serialize_manifest ends a manifest with.
std::string with_checksum(const std::string& bytes) {
  const uint64_t h = XXH3_64bits(bytes.data(), bytes.size());
  std::string out = bytes;
  out.push_back(static_cast<char>((15 << 3) | 1));
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h >> (8 * i)) & 0xff));
  return out;
}

void parse_and_round_trip(const std::string& bytes) {
  const std::string path = "step_00000020/manifest.pb";
  keel::ckpt::Manifest m;
  if (!keel::fuzz::accepts([&] { m = keel::parse_manifest(bytes, path); })) return;
  const std::string written = keel::serialize_manifest(m);
  keel::ckpt::Manifest again;
  keel::fuzz::check(keel::fuzz::accepts([&] { again = keel::parse_manifest(written, path); }),
                    "an accepted manifest, written again, is refused");
  m.clear_manifest_xxh3();
  again.clear_manifest_xxh3();
  keel::fuzz::check(canonical(m) == canonical(again),
                    "an accepted manifest reads back as another one");
  export_plan(m);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Protobuf logs every string field that is not UTF-8 (the parse then fails, as it should).
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  parse_and_round_trip(bytes);
  parse_and_round_trip(with_checksum(bytes));
  return 0;
}
