// TFRecord framing, the container TensorBoard event files use. Each record is
//   uint64 length | uint32 masked_crc32c(the 8 length bytes) | data | uint32 masked_crc32c(data)
// all little-endian, with CRC32C (Castagnoli) masked as ((crc >> 15) | (crc << 17)) + 0xa282ead8.
// Debian 12 ships no C/C++ CRC32C library (only python3-crc32c), so a table-driven one lives here,
// tested against the RFC 3720 vectors.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

// CRC32C of `bytes`; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view bytes);
// The masked form TFRecord stores, so a CRC over bytes that themselves hold CRCs stays strong.
uint32_t masked_crc32c(std::string_view bytes);

// Appends one framed record holding `data` to `out`.
void append_tfrecord(std::string& out, std::string_view data);

// The records of a whole TFRecord file, each checked against both of its CRCs. Throws kIo when
// the file cannot be read and kData, naming the file, the record and its byte offset, for a
// truncated record or a CRC mismatch.
std::vector<std::string> read_tfrecords(const std::string& path);

// The whole, CRC-checked records at the start of `bytes`, up to the first truncated or corrupt
// one; `*whole_bytes` (when given) is how many bytes they span.
std::vector<std::string> split_tfrecords_prefix(std::string_view bytes,
                                                size_t* whole_bytes = nullptr);

}  // namespace keel
