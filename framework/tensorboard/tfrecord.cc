// TFRecord framing and CRC32C (see tfrecord.h).
#include "framework/tensorboard/tfrecord.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "framework/error.h"

namespace keel {
namespace {

// Reflected CRC32C polynomial (Castagnoli, 0x1EDC6F41 bit-reversed).
constexpr uint32_t kCastagnoli = 0x82F63B78u;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kCastagnoli : 0u);
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

uint64_t get_le(std::string_view in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (char c : bytes) crc = kTable[(crc ^ static_cast<unsigned char>(c)) & 0xffu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

void append_tfrecord(std::string& out, std::string_view data) {
  std::string header;
  put_le(header, data.size(), 8);
  out += header;
  put_le(out, masked_crc32c(header), 4);
  out += data;
  put_le(out, masked_crc32c(data), 4);
}

std::vector<std::string> read_tfrecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KEEL_CHECK(in, kIo, path, ": cannot open (", std::strerror(errno), ")");
  std::ostringstream os;
  os << in.rdbuf();
  KEEL_CHECK(!in.bad(), kIo, path, ": read failed");
  const std::string bytes = os.str();
  const std::string_view all(bytes);

  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < all.size()) {
    const size_t index = records.size();
    KEEL_CHECK(all.size() - pos >= 12, kData, path, ": record ", index, " at byte ", pos,
               ": truncated header");
    const std::string_view header = all.substr(pos, 8);
    KEEL_CHECK(get_le(all.substr(pos + 8), 4) == masked_crc32c(header), kData, path, ": record ",
               index, " at byte ", pos, ": length CRC mismatch");
    const uint64_t length = get_le(header, 8);
    KEEL_CHECK(length <= all.size() - pos - 12 && all.size() - pos - 12 - length >= 4, kData, path,
               ": record ", index, " at byte ", pos, ": truncated (", length,
               " data bytes announced)");
    const std::string_view data = all.substr(pos + 12, length);
    KEEL_CHECK(get_le(all.substr(pos + 12 + length), 4) == masked_crc32c(data), kData, path,
               ": record ", index, " at byte ", pos, ": data CRC mismatch");
    records.emplace_back(data);
    pos += 12 + length + 4;
  }
  return records;
}

std::vector<std::string> split_tfrecords_prefix(std::string_view all, size_t* whole_bytes) {
  std::vector<std::string> records;
  size_t pos = 0;
  while (all.size() - pos >= 12) {
    const std::string_view header = all.substr(pos, 8);
    if (get_le(all.substr(pos + 8), 4) != masked_crc32c(header)) break;
    const uint64_t length = get_le(header, 8);
    if (length > all.size() - pos - 12 || all.size() - pos - 12 - length < 4) break;
    const std::string_view data = all.substr(pos + 12, length);
    if (get_le(all.substr(pos + 12 + length), 4) != masked_crc32c(data)) break;
    records.emplace_back(data);
    pos += 12 + length + 4;
  }
  if (whole_bytes) *whole_bytes = pos;
  return records;
}

}  // namespace keel
