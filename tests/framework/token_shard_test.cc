// Tests for uint32 token shards (llm.c's "llama-3" layout: magic 20240801, version 7) in
// framework/data/token_stream: read back, vocabulary check naming file, token and index, the
// header's refusals (version, truncation, trailing bytes), peek_size, and uint16 and uint32 shards
// mixed in one glob. The uint16 layout's own tests are in data_test.cc.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "framework/data/fingerprint.h"
#include "framework/data/token_stream.h"
#include "framework/error.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;
using testing::TempDir;

#define EXPECT_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "'" << (part) << "' not in: " << (message)

struct Header {
  int32_t magic = kShardMagicU32;
  int32_t version = kShardVersionU32;
  int64_t tokens = -1;      // -1: the true count
  int64_t drop_bytes = 0;   // cut this many bytes off the end
  int64_t extra_bytes = 0;  // append this many zero bytes
};

// A shard of `tokens` at `width` bytes each (2 or 4), little-endian (the host's order).
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int width,
                 Header h = {}) {
  std::vector<int32_t> header(256, 0);
  header[0] = h.magic;
  header[1] = h.version;
  header[2] = static_cast<int32_t>(h.tokens < 0 ? static_cast<int64_t>(tokens.size()) : h.tokens);
  std::string bytes(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  for (uint32_t t : tokens) {
    if (width == 2) {
      const auto v = static_cast<uint16_t>(t);
      bytes.append(reinterpret_cast<const char*>(&v), 2);
    } else {
      bytes.append(reinterpret_cast<const char*>(&t), 4);
    }
  }
  bytes.append(static_cast<size_t>(h.extra_bytes), '\0');
  bytes.resize(bytes.size() - static_cast<size_t>(h.drop_bytes));
  std::ofstream(path, std::ios::binary) << bytes;
}

std::vector<int32_t> all_tokens(const TokenStream& s) {
  std::vector<int32_t> out(static_cast<size_t>(s.size()));
  s.copy(0, s.size(), out.data());
  return out;
}

TEST(TokenShardU32, ReadsBackTokensAboveUint16) {
  TempDir dir;
  const std::string path = dir.file("big_vocab.bin");
  // Qwen-sized and Gemma-sized ids, and ones past 2^16 and 2^24 (each byte of the encoding used).
  const std::vector<uint32_t> tokens = {0, 65535, 65536, 151642, 262143, 16777216, 7};
  write_shard(path, tokens, 4);
  const TokenStream s = TokenStream::open_shards(path, 16777217, "data.path");
  ASSERT_EQ(s.size(), 7);
  EXPECT_EQ(all_tokens(s), (std::vector<int32_t>{0, 65535, 65536, 151642, 262143, 16777216, 7}));
  EXPECT_EQ(s.at(3), 151642);
  EXPECT_EQ(all_tokens(s.slice(2, 3)), (std::vector<int32_t>{65536, 151642, 262143}));
  EXPECT_EQ(TokenStream::peek_size(path, true), 7);
}

TEST(TokenShardU32, ReadsAcrossBlocks) {
  // More tokens than one 16 KiB read block holds (4096 uint32), read whole and from an offset.
  TempDir dir;
  const std::string path = dir.file("long.bin");
  std::vector<uint32_t> tokens(10000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(70000 + i * 13);
  write_shard(path, tokens, 4);
  const TokenStream s = TokenStream::open_shards(path, 300000, "data.path");
  const std::vector<int32_t> got = all_tokens(s);
  ASSERT_EQ(got.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(got[i], static_cast<int32_t>(tokens[i]));
  std::vector<int32_t> window(5000);
  s.copy(4000, 5000, window.data());
  EXPECT_EQ(window[0], static_cast<int32_t>(tokens[4000]));
  EXPECT_EQ(window[4999], static_cast<int32_t>(tokens[8999]));
}

TEST(TokenShardU32, OutOfVocabularyNamesFileTokenAndIndex) {
  TempDir dir;
  const std::string path = dir.file("oov.bin");
  std::vector<uint32_t> tokens(50, 3);
  tokens[31] = 100000;
  tokens[40] = 100001;
  write_shard(path, tokens, 4);
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { TokenStream::open_shards(path, 100000, "data.path"); }),
      path + ": token 100000 at index 31 >= model.vocab_size=100000");
  EXPECT_NO_THROW(TokenStream::open_shards(path, 100002, "data.path"));
  // A token past INT32_MAX is out of any vocabulary, not a negative id.
  const std::string huge = dir.file("huge.bin");
  write_shard(huge, {1, 0xFFFFFFFFu}, 4);
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { TokenStream::open_shards(huge, 2147483647, "data.path"); }),
      huge + ": token 4294967295 at index 1 >= model.vocab_size=2147483647");
}

TEST(TokenShardU32, BadVersionListsBothLayouts) {
  TempDir dir;
  const std::string both =
      "(expected magic 20240520 version 1 = uint16 tokens, or magic 20240801 version 7 = uint32 "
      "tokens)";
  const std::string v2 = dir.file("v2.bin");
  write_shard(v2, {1, 2, 3}, 4, {.version = 2});
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { TokenStream::open_shards(v2, 256, "data.path"); }),
             v2 + ": unsupported version 2 for magic 20240801 " + both);
  // The uint16 magic with the uint32 version (and the reverse) is neither layout.
  const std::string crossed = dir.file("crossed.bin");
  write_shard(crossed, {1, 2, 3}, 2, {.magic = kShardMagic, .version = kShardVersionU32});
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { TokenStream::open_shards(crossed, 256, "data.path"); }),
      crossed + ": unsupported version 7 for magic 20240520 " + both);
  EXPECT_EQ(TokenStream::peek_size(v2, true), std::nullopt);
  EXPECT_EQ(TokenStream::peek_size(crossed, true), std::nullopt);
}

TEST(TokenShardU32, TruncatedAndTrailingBytesAreCountedInUint32) {
  TempDir dir;
  const auto open = [](const std::string& path) {
    return [=] { TokenStream::open_shards(path, 1000, "data.path"); };
  };
  std::vector<uint32_t> tokens(50, 9);
  const std::string cut = dir.file("cut.bin");
  write_shard(cut, tokens, 4, {.drop_bytes = 5});  // 195 bytes: 48 whole tokens
  EXPECT_HAS(error_of(ErrorKind::kData, open(cut)),
             cut + ": truncated: header says 50 tokens, file holds 48");
  const std::string more = dir.file("more.bin");
  write_shard(more, tokens, 4, {.tokens = 60});
  EXPECT_HAS(error_of(ErrorKind::kData, open(more)),
             more + ": truncated: header says 60 tokens, file holds 50");
  // A uint16-sized payload under a uint32 header: half the tokens it declares.
  const std::string narrow = dir.file("narrow.bin");
  write_shard(narrow, tokens, 2, {.magic = kShardMagicU32, .version = kShardVersionU32});
  EXPECT_HAS(error_of(ErrorKind::kData, open(narrow)),
             narrow + ": truncated: header says 50 tokens, file holds 25");
  const std::string trailing = dir.file("trailing.bin");
  write_shard(trailing, tokens, 4, {.extra_bytes = 2});
  EXPECT_HAS(error_of(ErrorKind::kData, open(trailing)),
             trailing + ": header says 50 tokens but the file holds 202 bytes of tokens");
  const std::string header_only = dir.file("header_only.bin");
  write_shard(header_only, {}, 4);
  EXPECT_HAS(error_of(ErrorKind::kData, open(header_only)),
             header_only + ": header says 0 tokens (expected > 0)");
  // The header check on bytes alone (what the fuzzer drives).
  std::vector<int32_t> header(256, 0);
  header[0] = kShardMagicU32;
  header[1] = kShardVersionU32;
  header[2] = 10;
  const std::string head(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  const ShardHeader h = read_shard_header(head, kShardHeaderBytes + 40, "x.bin");
  EXPECT_EQ(h.tokens, 10);
  EXPECT_EQ(h.width, 4);
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { read_shard_header(head, kShardHeaderBytes + 20, "x.bin"); }),
      "x.bin: truncated: header says 10 tokens, file holds 5");
}

TEST(TokenShardU32, MixedWidthsInOneGlobReadInOrder) {
  // Mixed uint16 and uint32 shards in one data.path are read, each at its own width: a corpus
  // re-tokenized part by part stays one stream. The fingerprint depends on the tokens only.
  TempDir dir;
  write_shard(dir.file("train_000000.bin"), {1, 2, 3}, 2,
              {.magic = kShardMagic, .version = kShardVersion});
  write_shard(dir.file("train_000001.bin"), {70000, 5}, 4);
  write_shard(dir.file("train_000002.bin"), {6, 7, 8, 9}, 2,
              {.magic = kShardMagic, .version = kShardVersion});
  const TokenStream s = TokenStream::open_shards(dir.file("train_*.bin"), 70001, "data.path");
  EXPECT_EQ(all_tokens(s), (std::vector<int32_t>{1, 2, 3, 70000, 5, 6, 7, 8, 9}));
  EXPECT_EQ(all_tokens(s.slice(2, 4)), (std::vector<int32_t>{3, 70000, 5, 6}));
  EXPECT_EQ(s.at(4), 5);
  EXPECT_EQ(TokenStream::peek_size(dir.file("train_*.bin"), true), 9);

  write_shard(dir.file("same.bin"), {1, 2, 3, 70000, 5, 6, 7, 8, 9}, 4);
  const TokenStream one = TokenStream::open_shards(dir.file("same.bin"), 70001, "data.path");
  EXPECT_EQ(fingerprint(one), fingerprint(s));
}

}  // namespace
}  // namespace keel
