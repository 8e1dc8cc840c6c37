// The data fingerprint (framework/data/fingerprint.h): it depends on the token values and their
// order only (bytes and uint16 shards holding the same tokens agree), every token counts (one
// changed token, two swapped tokens or one token more change it), it does not depend on the
// thread count, and it is XXH3-64 of the layout Note [data fingerprint] states.
#include "framework/data/fingerprint.h"

#include <gtest/gtest.h>
#include <omp.h>
#include <xxhash.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace keel {
namespace {

using testing::TempDir;

std::vector<uint8_t> pattern(int64_t n, uint32_t salt = 0) {
  std::vector<uint8_t> b(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>((i * 131 + i / 7 + salt) % 251);
  return b;
}

TokenStream bytes_stream(std::vector<uint8_t> b) {
  return TokenStream::from_bytes(std::move(b), "test bytes", 256);
}

void write_shard(const std::string& path, const std::vector<uint8_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  for (uint8_t t : tokens) {
    bytes += static_cast<char>(t);
    bytes += '\0';
  }
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(Fingerprint, MatchesTheDocumentedTreeHash) {
  // Two blocks and a bit: the note's construction, computed here directly.
  const int64_t n = 2 * kFingerprintBlock + 123;
  const std::vector<uint8_t> b = pattern(n);
  std::vector<uint64_t> words = {static_cast<uint64_t>(n)};
  for (int64_t start = 0; start < n; start += kFingerprintBlock) {
    const int64_t len = std::min(kFingerprintBlock, n - start);
    std::vector<uint32_t> tokens(b.begin() + start, b.begin() + start + len);
    words.push_back(XXH3_64bits(tokens.data(), tokens.size() * 4));
  }
  EXPECT_EQ(fingerprint(bytes_stream(b)), XXH3_64bits(words.data(), words.size() * 8));
}

TEST(Fingerprint, SameTokensSameFingerprintWhateverTheFormat) {
  TempDir dir;
  const std::vector<uint8_t> b = pattern(5000);
  write_shard(dir.file("a_000.bin"), std::vector<uint8_t>(b.begin(), b.begin() + 3000));
  write_shard(dir.file("a_001.bin"), std::vector<uint8_t>(b.begin() + 3000, b.end()));
  const TokenStream shards = TokenStream::open_shards(dir.file("a_*.bin"), 256, "data.path");
  ASSERT_EQ(shards.size(), 5000);
  EXPECT_EQ(fingerprint(shards), fingerprint(bytes_stream(b)));
  // A slice is the stream of its own tokens.
  EXPECT_EQ(fingerprint(shards.slice(1000, 2500)),
            fingerprint(bytes_stream(std::vector<uint8_t>(b.begin() + 1000, b.begin() + 3500))));
}

TEST(Fingerprint, EveryTokenCounts) {
  const int64_t n = kFingerprintBlock + 77;  // the change lands in the second block too
  const std::vector<uint8_t> b = pattern(n);
  const uint64_t base = fingerprint(bytes_stream(b));
  for (int64_t at : {int64_t{0}, int64_t{17}, kFingerprintBlock - 1, kFingerprintBlock, n - 1}) {
    std::vector<uint8_t> changed = b;
    changed[at] ^= 1;
    EXPECT_NE(fingerprint(bytes_stream(changed)), base) << "token " << at;
  }
  std::vector<uint8_t> swapped = b;
  std::swap(swapped[10], swapped[11]);
  ASSERT_NE(swapped[10], swapped[11]);
  EXPECT_NE(fingerprint(bytes_stream(swapped)), base);
  std::vector<uint8_t> longer = b;
  longer.push_back(0);
  EXPECT_NE(fingerprint(bytes_stream(longer)), base);
  std::vector<uint8_t> shorter(b.begin(), b.end() - 1);
  EXPECT_NE(fingerprint(bytes_stream(shorter)), base);
  EXPECT_NE(fingerprint(bytes_stream(pattern(n, 1))), base);
  EXPECT_NE(fingerprint(TokenStream()), base);
}

TEST(Fingerprint, IndependentOfTheThreadCount) {
  const TokenStream s = bytes_stream(pattern(3 * kFingerprintBlock + 5));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const uint64_t one = fingerprint(s);
  omp_set_num_threads(3);
  const uint64_t three = fingerprint(s);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, three);
}

TEST(Fingerprint, PrintsAsXxh3Hex) {
  EXPECT_EQ(fingerprint_hex(0x0123456789abcdefull), "xxh3:0123456789abcdef");
  EXPECT_EQ(fingerprint_hex(0), "xxh3:0000000000000000");
}

}  // namespace
}  // namespace keel
