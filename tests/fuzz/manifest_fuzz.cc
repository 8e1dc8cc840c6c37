// Fuzzes the checkpoint manifest reader and validator (checkpoints/manifest_io.h parse_manifest:
// no file system). Each input is parsed as it is, and again with a correct checksum record
// appended (so mutations get past the checksum into the validator, as an edit by someone who
// recomputed it would). A manifest that is accepted must write (serialize_manifest) and read
// back to the same manifest.
#include <google/protobuf/util/message_differencer.h>
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoints/manifest_io.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using google::protobuf::util::MessageDifferencer;

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
  keel::fuzz::check(MessageDifferencer::Equals(m, again),
                    "an accepted manifest reads back as another one");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  parse_and_round_trip(bytes);
  parse_and_round_trip(with_checksum(bytes));
  return 0;
}
