// Fuzzes the safetensors header reader and writer (checkpoints/export.h) as a round trip.
// Read: an input is a whole safetensors file; a header that decodes (and whose tensors are all
// F32, what keel writes) is written again from what was read, and must decode to the same tensors,
// offsets and metadata. Write: the same input, read as a plan (names, shapes, metadata: any
// bytes), is encoded, and the header must decode to that plan, with the file's size checked.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "checkpoints/export.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using keel::fuzz::check;

bool utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// The first 8 + N bytes of a file: the header's length and the header.
std::string head_of(const std::string& header) {
  const uint64_t n = header.size();
  std::string head(8, '\0');
  std::memcpy(head.data(), &n, 8);
  return head + header;
}

// Encodes `plan` and `metadata`, decodes the file, and checks it against them.
void round_trip(const keel::ExportPlan& plan, const std::map<std::string, std::string>& metadata) {
  const std::string header = keel::encode_safetensors_header(plan, metadata);
  check(header.size() % 8 == 0 && !header.empty() && header[0] == '{', "header not padded or '{'");
  int64_t data = 0;
  for (const keel::ExportTensor& t : plan.tensors) data += keel::shape_numel(t.shape) * 4;
  const std::string head = head_of(header);  // the data is not made: only its size counts
  keel::SafetensorsHeader h;
  check(keel::fuzz::accepts([&] {
          h = keel::decode_safetensors_header(head, static_cast<int64_t>(head.size()) + data, "w");
        }),
        "the writer's header is refused by the reader: " + header);
  check(h.header_bytes == static_cast<int64_t>(header.size()) && h.data_bytes == data,
        "sizes differ after a round trip");
  check(h.tensors.size() == plan.tensors.size(), "tensor count differs after a round trip");
  // Decoded tensors are in data order, which is plan order; zero-byte tensors at one offset may
  // swap, so each is found by name.
  std::map<std::string, keel::SafetensorsTensor> by_name;
  for (const keel::SafetensorsTensor& t : h.tensors) by_name[t.name] = t;
  int64_t offset = 0;
  for (const keel::ExportTensor& t : plan.tensors) {
    const int64_t bytes = keel::shape_numel(t.shape) * 4;
    const auto it = by_name.find(t.name);
    check(it != by_name.end(), "a tensor's name changed in a round trip");
    check(it->second == keel::SafetensorsTensor{t.name, "F32", t.shape, offset, offset + bytes},
          "a tensor changed in a round trip: " + t.name);
    offset += bytes;
  }
  for (const auto& [k, v] : metadata) {
    const auto it = h.metadata.find(k);
    check(it != h.metadata.end(), "a metadata key is lost in a round trip");
    if (utf8(v)) check(it->second == v, "a metadata value changed in a round trip");
  }
  check(h.metadata.size() == metadata.size(), "metadata count differs after a round trip");
}

void read_then_write(const std::string& file) {
  keel::SafetensorsHeader h;
  if (!keel::fuzz::accepts([&] {
        h = keel::decode_safetensors_header(file, static_cast<int64_t>(file.size()), "f");
      })) {
    return;
  }
  // The header alone, without the file's size, reads the same.
  keel::SafetensorsHeader alone;
  check(keel::fuzz::accepts([&] {
          alone = keel::decode_safetensors_header(
              std::string_view(file).substr(0, static_cast<size_t>(8 + h.header_bytes)),
              std::nullopt, "f");
        }) &&
            alone.tensors == h.tensors && alone.metadata == h.metadata,
        "the header alone reads differently");
  keel::ExportPlan plan;
  for (const keel::SafetensorsTensor& t : h.tensors) {
    if (t.dtype != "F32") return;
    keel::ExportTensor e;
    e.name = t.name;
    e.shape = t.shape;
    plan.tensors.push_back(e);
  }
  round_trip(plan, h.metadata);
}

void write_then_read(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  std::map<std::string, std::string> metadata;
  const int n_meta = in.ConsumeIntegralInRange(0, 4);
  for (int i = 0; i < n_meta; ++i) {
    std::string key = in.ConsumeRandomLengthString(32);
    std::string value = in.ConsumeRandomLengthString(64);
    if (utf8(key)) metadata[key] = value;  // keys are keel's own names (the writer checks)
  }
  keel::ExportPlan plan;
  std::set<std::string> names;
  const int n_tensors = in.ConsumeIntegralInRange(0, 8);
  for (int i = 0; i < n_tensors; ++i) {
    keel::ExportTensor t;
    t.name = in.ConsumeRandomLengthString(48);
    const int rank = in.ConsumeIntegralInRange(0, 4);
    for (int d = 0; d < rank; ++d) t.shape.push_back(in.ConsumeIntegralInRange<int64_t>(0, 4096));
    // A plan's names are distinct UTF-8 and not "__metadata__" (the writer refuses others as
    // keel's bug, kInternal).
    if (t.name == "__metadata__" || !utf8(t.name) || !names.insert(t.name).second) continue;
    plan.tensors.push_back(t);
  }
  round_trip(plan, metadata);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  read_then_write(std::string(reinterpret_cast<const char*>(data), size));
  write_then_read(data, size);
  return 0;
}
