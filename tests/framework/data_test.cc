// Tests for framework/data: shard and text validation and their one-line errors, glob order,
// dataset splits, the sampler's per-epoch permutation of non-overlapping windows (coverage,
// determinism, seeds, data-parallel independence), fixed validation windows,
// and the built-in corpus's determinism and entropy figures (checked against measured ones).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "framework/config/config.h"
#include "framework/data/corpus.h"
#include "framework/data/dataset.h"
#include "framework/data/fingerprint.h"
#include "framework/data/sampler.h"
#include "framework/data/token_stream.h"
#include "framework/error.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;
using testing::TempDir;

struct ShardSpec {
  int32_t magic = kShardMagic;
  int32_t version = kShardVersion;
  int64_t header_tokens = -1;  // -1: the true count
  int64_t drop_bytes = 0;      // cut this many bytes off the end
};

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens,
                 ShardSpec spec = {}) {
  std::vector<int32_t> header(256, 0);
  header[0] = spec.magic;
  header[1] = spec.version;
  header[2] = static_cast<int32_t>(spec.header_tokens < 0 ? tokens.size() : spec.header_tokens);
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), 2 * tokens.size());
  bytes.resize(bytes.size() - spec.drop_bytes);
  std::ofstream(path, std::ios::binary) << bytes;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::vector<uint16_t> iota_tokens(int n, int first) {
  std::vector<uint16_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(first + i);
  return t;
}

#define EXPECT_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "'" << (part) << "' not in: " << (message)

std::vector<int32_t> all_tokens(const TokenStream& s) {
  std::vector<int32_t> out(s.size());
  s.copy(0, s.size(), out.data());
  return out;
}

// ---- shards ------------------------------------------------------------------------------------

TEST(Shards, GoodShardReadsBack) {
  TempDir dir;
  const std::string path = dir.file("a.bin");
  write_shard(path, {5, 0, 65535, 7});
  TokenStream s = TokenStream::open_shards(path, 65536, "data.path");
  ASSERT_EQ(s.size(), 4);
  EXPECT_EQ(s.at(0), 5);
  EXPECT_EQ(s.at(2), 65535);  // uint16 tokens are read unsigned
  EXPECT_EQ(all_tokens(s), (std::vector<int32_t>{5, 0, 65535, 7}));
  EXPECT_HAS(s.describe(), path);
}

TEST(Shards, MalformedShardsNameTheFileAndReason) {
  TempDir dir;
  const auto open = [&](const std::string& path, int32_t vocab = 50257) {
    return [=] { TokenStream::open_shards(path, vocab, "data.path"); };
  };
  const std::string magic = dir.file("magic.bin");
  write_shard(magic, iota_tokens(10, 0), {.magic = 123});
  EXPECT_HAS(error_of(ErrorKind::kData, open(magic)),
             magic +
                 ": bad magic 123 (expected an llm.c token shard: 20240520 for uint16 tokens or "
                 "20240801 for uint32 tokens)");

  const std::string version = dir.file("version.bin");
  write_shard(version, iota_tokens(10, 0), {.version = 2});
  EXPECT_HAS(error_of(ErrorKind::kData, open(version)),
             version +
                 ": unsupported version 2 for magic 20240520 (expected magic 20240520 "
                 "version 1 = uint16 tokens, or magic 20240801 version 7 = uint32 tokens)");

  const std::string truncated = dir.file("truncated.bin");
  write_shard(truncated, iota_tokens(50, 0), {.header_tokens = 100});
  EXPECT_HAS(error_of(ErrorKind::kData, open(truncated)),
             truncated + ": truncated: header says 100 tokens, file holds 50");

  const std::string cut = dir.file("cut.bin");
  write_shard(cut, iota_tokens(50, 0), {.drop_bytes = 3});
  EXPECT_HAS(error_of(ErrorKind::kData, open(cut)),
             cut + ": truncated: header says 50 tokens, file holds 48");

  const std::string tiny = dir.file("tiny.bin");
  write_bytes(tiny, "0123456789");
  EXPECT_HAS(error_of(ErrorKind::kData, open(tiny)), tiny + ": truncated: 10 bytes");

  const std::string empty = dir.file("empty.bin");
  write_bytes(empty, "");
  EXPECT_HAS(error_of(ErrorKind::kData, open(empty)), empty + ": truncated: 0 bytes");

  const std::string trailing = dir.file("trailing.bin");
  write_shard(trailing, iota_tokens(50, 0), {.header_tokens = 40});
  EXPECT_HAS(error_of(ErrorKind::kData, open(trailing)),
             trailing + ": header says 40 tokens but the file holds 100 bytes");

  const std::string zero = dir.file("zero.bin");
  write_shard(zero, {}, {});
  EXPECT_HAS(error_of(ErrorKind::kData, open(zero)), zero + ": header says 0 tokens");

  const std::string big = dir.file("big.bin");
  std::vector<uint16_t> tokens = iota_tokens(20, 100);
  tokens[12] = 60000;
  tokens[15] = 60001;
  write_shard(big, tokens);
  EXPECT_HAS(error_of(ErrorKind::kData, open(big)),
             big + ": token 60000 at index 12 >= model.vocab_size=50257");
  EXPECT_NO_THROW(open(big, 60002)());
}

TEST(Shards, MissingFileOrEmptyGlobNamesTheField) {
  TempDir dir;
  const std::string missing = dir.file("nope.bin");
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { TokenStream::open_shards(missing, 256, "data.path"); }),
      "data.path: no file matches '" + missing + "'");
  const std::string pattern = dir.file("train_*.bin");
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { TokenStream::open_shards(pattern, 256, "data.val_path"); }),
      "data.val_path: no file matches '" + pattern + "'");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { TokenStream::open_shards(dir.file(""), 256, "f"); }),
             "not a regular file");
}

TEST(Shards, GlobConcatenatesInNameOrder) {
  TempDir dir;
  // Written out of order; read back sorted by name.
  write_shard(dir.file("train_000002.bin"), iota_tokens(7, 200));
  write_shard(dir.file("train_000000.bin"), iota_tokens(5, 0));
  write_shard(dir.file("train_000001.bin"), iota_tokens(3, 100));
  write_shard(dir.file("val_000000.bin"), iota_tokens(4, 900));  // not matched
  TokenStream s = TokenStream::open_shards(dir.file("train_*.bin"), 1000, "data.path");
  std::vector<int32_t> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(i);
  for (int i = 0; i < 3; ++i) expected.push_back(100 + i);
  for (int i = 0; i < 7; ++i) expected.push_back(200 + i);
  ASSERT_EQ(s.size(), 15);
  EXPECT_EQ(all_tokens(s), expected);
  for (int64_t i = 0; i < s.size(); ++i) EXPECT_EQ(s.at(i), expected[i]);
  EXPECT_HAS(s.describe(), "3 shards");
  // Reads that cross shard boundaries, and slices that start and end inside shards.
  std::vector<int32_t> window(9);
  s.copy(3, 9, window.data());
  EXPECT_EQ(window, std::vector<int32_t>(expected.begin() + 3, expected.begin() + 12));
  TokenStream middle = s.slice(4, 6);
  EXPECT_EQ(all_tokens(middle), std::vector<int32_t>(expected.begin() + 4, expected.begin() + 10));
  EXPECT_EQ(middle.at(5), expected[9]);
  EXPECT_EQ(all_tokens(middle.slice(1, 3)),
            std::vector<int32_t>(expected.begin() + 5, expected.begin() + 8));
  EXPECT_EQ(s.slice(15, 0).size(), 0);
}

TEST(Shards, HeaderIsCheckedOnBytes) {
  // The header check the fuzzer runs on arbitrary bytes (tests/fuzz/shard_fuzz.cc).
  std::vector<int32_t> header(256, 0);
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = 10;
  const std::string head(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  EXPECT_EQ(shard_token_count(head, kShardHeaderBytes + 20, "x.bin"), 10);
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { shard_token_count(head, kShardHeaderBytes + 18, "x.bin"); }),
      "x.bin: truncated: header says 10 tokens, file holds 9");
  EXPECT_HAS(
      error_of(ErrorKind::kData,
               [&] { shard_token_count(head.substr(0, 12), kShardHeaderBytes + 20, "x.bin"); }),
      "x.bin: truncated");
  header[2] = -5;
  const std::string negative(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
  EXPECT_HAS(error_of(ErrorKind::kData,
                      [&] { shard_token_count(negative, kShardHeaderBytes + 20, "x.bin"); }),
             "x.bin: header says -5 tokens (expected > 0)");
}

// Each shard stays open: a glob of more shards than the soft descriptor limit allows raises it
// (towards the hard limit) instead of failing with "Too many open files".
TEST(Shards, ManyShardsRaiseTheSoftDescriptorLimit) {
  struct rlimit before {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 600) GTEST_SKIP() << "hard limit";
  TempDir dir;
  for (int i = 0; i < 300; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "s_%04d.bin", i);
    write_shard(dir.file(name), iota_tokens(3, i));
  }
  struct rlimit low = before;
  low.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::optional<TokenStream> s;
  EXPECT_NO_THROW(s = TokenStream::open_shards(dir.file("s_*.bin"), 1000, "data.path"));
  struct rlimit raised {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &raised), 0);
  EXPECT_GE(raised.rlim_cur, 300u);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->size(), 900);
  EXPECT_EQ(s->at(899), 299 + 2);
  s.reset();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

// Note [token files are read, not mapped]: a shard cut short after it was opened (another job
// rewriting the data, a full disk during a copy) makes the next read that reaches past the new end
// a kData error naming the file; with a mapping it was SIGBUS.
TEST(Shards, TruncatedWhileInUseIsADataErrorNamingTheFile) {
  TempDir dir;
  write_shard(dir.file("train_000000.bin"), iota_tokens(3000, 0));
  write_shard(dir.file("train_000001.bin"), iota_tokens(5000, 0));
  const std::string second = dir.file("train_000001.bin");
  const TokenStream s = TokenStream::open_shards(dir.file("train_*.bin"), 8000, "data.path");
  ASSERT_EQ(s.size(), 8000);
  // Cut the second shard to its header and 1000 tokens: tokens up to 4000 still read back.
  ASSERT_EQ(truncate(second.c_str(), kShardHeaderBytes + 2000), 0);
  std::vector<int32_t> out(2000);
  s.copy(2000, 2000, out.data());
  EXPECT_EQ(out[1999], 999);
  const std::string message = error_of(ErrorKind::kData, [&] { s.copy(3500, 1000, out.data()); });
  EXPECT_HAS(message, second + ": truncated while in use");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { s.at(7999); }), second + ": truncated while in use");
  // Views share the open file; the fingerprint's parallel read reports it too (an exception
  // leaving its OpenMP region would end the process instead).
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { s.slice(4000, 10).at(0); }),
             "truncated while in use");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { fingerprint(s); }),
             second + ": truncated while in use");
  // Emptied altogether: the same.
  ASSERT_EQ(truncate(second.c_str(), 0), 0);
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { s.copy(3000, 1, out.data()); }),
             second + ": truncated while in use");
}

TEST(Shards, ASamplerOverATruncatedShardThrowsNamingTheFile) {
  TempDir dir;
  const std::string path = dir.file("a.bin");
  write_shard(path, iota_tokens(4096, 0));
  Sampler sampler(TokenStream::open_shards(path, 4096, "data.path"), TokenStream(), 64, 1, 0);
  std::vector<int32_t> inputs(8 * 64), targets(8 * 64);
  sampler.next_batch(8, inputs.data(), targets.data());
  ASSERT_EQ(truncate(path.c_str(), kShardHeaderBytes + 100), 0);
  // Every window of 65 tokens reaches past the 50 tokens left.
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { sampler.next_batch(8, inputs.data(), targets.data()); }),
      path + ": truncated while in use");
}

// ---- text --------------------------------------------------------------------------------------

TEST(Text, ReadsBytesAndChecksThem) {
  TempDir dir;
  const std::string good = dir.file("t.txt");
  write_bytes(good, std::string("hi\xff", 3));
  TokenStream s = TokenStream::open_text(good, 256, "data.path");
  EXPECT_EQ(all_tokens(s), (std::vector<int32_t>{'h', 'i', 255}));

  EXPECT_HAS(error_of(ErrorKind::kData, [&] { TokenStream::open_text(good, 128, "data.path"); }),
             good + ": byte 255 at index 2 >= model.vocab_size=128");
  const std::string empty = dir.file("empty.txt");
  write_bytes(empty, "");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { TokenStream::open_text(empty, 256, "data.path"); }),
             empty + ": empty text file");
  const std::string missing = dir.file("missing.txt");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { TokenStream::open_text(missing, 256, "data.path"); }),
             missing + ": cannot open");
}

TEST(Text, TruncatedWhileInUseIsADataErrorNamingTheFile) {
  TempDir dir;
  const std::string path = dir.file("t.txt");
  write_bytes(path, std::string(10000, 'a'));
  const TokenStream s = TokenStream::open_text(path, 256, "data.path");
  ASSERT_EQ(truncate(path.c_str(), 5000), 0);
  std::vector<int32_t> out(100);
  s.copy(4900, 100, out.data());
  EXPECT_EQ(out[99], 'a');
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { s.copy(4901, 100, out.data()); }),
             path + ": truncated while in use");
}

TEST(Text, FromBytesChecksVocab) {
  EXPECT_EQ(TokenStream::from_bytes({1, 2, 3}, "mem", 4).size(), 3);
  EXPECT_HAS(error_of(ErrorKind::kData,
                      [] {
                        TokenStream::from_bytes({1, 2, 9}, "mem", 4);
                      }),
             "mem: token 9 at index 2 >= model.vocab_size=4");
}

// ---- dataset -----------------------------------------------------------------------------------

TEST(Dataset, BuiltinSplitsTailForValidation) {
  config::KeelConfig cfg = load_config("", {"data.builtin_bytes=200000"});
  Dataset ds = Dataset::open(cfg);
  EXPECT_EQ(ds.train().size(), 190000);
  EXPECT_EQ(ds.val().size(), 10000);
  ASSERT_TRUE(ds.has_val());
  ASSERT_TRUE(ds.entropy_rate_nats_per_token().has_value());
  const Corpus corpus = generate_corpus(7, 200000);
  EXPECT_EQ(*ds.entropy_rate_nats_per_token(), corpus.entropy_rate_nats_per_byte);
  EXPECT_EQ(ds.val().at(0), corpus.bytes[190000]);  // val is the tail
  EXPECT_EQ(ds.val().at(9999), corpus.bytes[199999]);
  EXPECT_EQ(ds.train().at(189999), corpus.bytes[189999]);
}

TEST(Dataset, TextAndSeparateValidationShards) {
  TempDir dir;
  write_bytes(dir.file("a.txt"), std::string(1000, 'x'));
  config::KeelConfig cfg = load_config("", {"data.path=" + dir.file("a.txt"), "model.seq_len=16"});
  Dataset text = Dataset::open(cfg);
  EXPECT_EQ(text.train().size(), 950);
  EXPECT_EQ(text.val().size(), 50);
  EXPECT_FALSE(text.entropy_rate_nats_per_token().has_value());

  write_shard(dir.file("train_0.bin"), iota_tokens(100, 0));
  write_shard(dir.file("train_1.bin"), iota_tokens(100, 100));
  write_shard(dir.file("val_0.bin"), iota_tokens(40, 7));
  cfg = load_config("", {"data.path=" + dir.file("train_*.bin"),
                         "data.val_path=" + dir.file("val_*.bin"), "model.seq_len=16"});
  Dataset shards = Dataset::open(cfg);
  EXPECT_EQ(shards.train().size(), 200);  // all of data.path
  EXPECT_EQ(shards.val().size(), 40);
  EXPECT_EQ(shards.val().at(0), 7);
}

TEST(Dataset, NoValidationSplitWhenDisabled) {
  config::KeelConfig cfg =
      load_config("", {"data.builtin_bytes=5000", "data.val_fraction=0", "train.eval_every=0"});
  Dataset ds = Dataset::open(cfg);
  EXPECT_EQ(ds.train().size(), 5000);
  EXPECT_FALSE(ds.has_val());
}

TEST(Dataset, TooSmallSplitsNameTheField) {
  EXPECT_HAS(error_of(ErrorKind::kData,
                      [] { Dataset::open(load_config("", {"data.builtin_bytes=100"})); }),
             "data.builtin_bytes=100");
  EXPECT_HAS(
      error_of(
          ErrorKind::kData,
          [] {
            Dataset::open(load_config("", {"data.builtin_bytes=2000", "data.val_fraction=0.01"}));
          }),
      "data.val_fraction=0.01: holds out 20 of 2000 tokens");
  TempDir dir;
  write_shard(dir.file("t.bin"), iota_tokens(300, 0));
  write_shard(dir.file("v.bin"), iota_tokens(100, 0));
  const std::string vocab = "model.vocab_size=1000";
  EXPECT_HAS(
      error_of(ErrorKind::kData,
               [&] {
                 Dataset::open(load_config("", {"data.path=" + dir.file("t.bin"),
                                                "data.val_path=" + dir.file("v.bin"), vocab}));
               }),
      "data.val_path: ");
  EXPECT_HAS(
      error_of(ErrorKind::kData,
               [&] {
                 Dataset::open(load_config("", {"data.path=" + dir.file("t.bin"),
                                                "data.val_path=" + dir.file("x*.bin"), vocab}));
               }),
      "data.val_path: no file matches");
}

// ---- sampler -----------------------------------------------------------------------------------

TokenStream counting_stream(int n) {
  std::vector<uint8_t> bytes(n);
  for (int i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i % 251);
  return TokenStream::from_bytes(std::move(bytes), "counting", 256);
}

TEST(Sampler, WindowsAreShiftedPairsOnTheWindowGrid) {
  const int T = 8;
  // 1000 tokens: W = floor(999 / 8) = 124 windows; the last starts at 984 and ends at 992 < 1000.
  Sampler sampler(counting_stream(1000), TokenStream(), T, 42, 0);
  ASSERT_EQ(sampler.windows_per_epoch(), 124);
  std::vector<int32_t> in(4 * T), tgt(4 * T);
  sampler.fill_samples(0, 4, in.data(), tgt.data());
  for (int i = 0; i < 4; ++i) {
    const int64_t off = sampler.sample_offset(i);
    EXPECT_EQ(off, sampler.window_of(i) * T);
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(in[i * T + t], (off + t) % 251);
      EXPECT_EQ(tgt[i * T + t], (off + t + 1) % 251);
    }
  }
  // Every offset is a window start, and the window with its target fits in the stream.
  for (uint64_t s = 0; s < 3 * 124; ++s) {
    const int64_t off = sampler.sample_offset(s);
    EXPECT_EQ(off % T, 0) << s;
    EXPECT_GE(off, 0) << s;
    EXPECT_LE(off + T + 1, 1000) << s;
  }
}

// The windows of samples [epoch W, (epoch + 1) W): a permutation of [0, W) when correct.
std::vector<int64_t> epoch_order(const Sampler& s, uint64_t epoch) {
  const int64_t W = s.windows_per_epoch();
  std::vector<int64_t> order(W);
  for (int64_t p = 0; p < W; ++p) order[p] = s.window_of(epoch * W + p);
  return order;
}

TEST(Sampler, EachEpochReadsEveryWindowExactlyOnce) {
  const int T = 4;
  // W = 1, primes, powers of two and their neighbours (the Feistel domain is the next power of
  // two; 65 and 129 make cycle-walking reject almost half of it), and a larger W.
  for (int64_t W : {1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 65, 97, 100, 129, 1000, 4099}) {
    SCOPED_TRACE(W);
    // W T + 1 tokens are just enough; up to T - 1 more fit no further window.
    for (int extra : {0, T - 1}) {
      Sampler s(counting_stream(static_cast<int>(W * T + 1 + extra)), TokenStream(), T, 77, 0);
      ASSERT_EQ(s.windows_per_epoch(), W);
      for (uint64_t epoch : {0, 1, 2, 1000}) {
        std::vector<int64_t> order = epoch_order(s, epoch);
        for (int64_t p = 0; p < W; ++p) {
          EXPECT_EQ(s.epoch_of(epoch * W + p), epoch);
        }
        std::sort(order.begin(), order.end());
        for (int64_t w = 0; w < W; ++w) ASSERT_EQ(order[w], w) << "epoch " << epoch;
      }
    }
  }
  // Too short for a second window: W = 1 until the stream holds 2 T + 1 tokens.
  EXPECT_EQ(Sampler(counting_stream(2 * T), TokenStream(), T, 1, 0).windows_per_epoch(), 1);
  EXPECT_EQ(Sampler(counting_stream(2 * T + 1), TokenStream(), T, 1, 0).windows_per_epoch(), 2);
}

TEST(Sampler, WindowsOfAnEpochNeverOverlap) {
  // Every token position the windows can cover is an input position of exactly one sample of
  // the epoch, and a window's target is the next window's first input (or the stream's end).
  const int T = 6;
  for (int size : {6 * 50 + 1, 6 * 50 + 5, 6 * 37 + 3}) {
    SCOPED_TRACE(size);
    Sampler s(counting_stream(size), TokenStream(), T, 3, 0);
    const int64_t W = s.windows_per_epoch();
    ASSERT_EQ(W, (size - 1) / T);
    for (uint64_t epoch : {0, 1}) {
      std::vector<int> covered(size, 0);
      for (int64_t p = 0; p < W; ++p) {
        const int64_t off = s.sample_offset(epoch * W + p);
        for (int t = 0; t < T; ++t) covered[off + t] += 1;
      }
      for (int i = 0; i < size; ++i) EXPECT_EQ(covered[i], i < W * T ? 1 : 0) << i;
    }
  }
}

TEST(Sampler, OrderDiffersAcrossEpochsAndSeeds) {
  const int T = 4, W = 1000;
  const TokenStream train = counting_stream(W * T + 1);
  const Sampler a(train, TokenStream(), T, 1234, 0), same(train, TokenStream(), T, 1234, 0),
      other(train, TokenStream(), T, 1235, 0);
  // Two independent uniform permutations of 1000 agree at ~1 position; equal orders at all W.
  // "Different" here means they agree at fewer than 2% of positions.
  const auto agreements = [](const std::vector<int64_t>& x, const std::vector<int64_t>& y) {
    int n = 0;
    for (size_t i = 0; i < x.size(); ++i) n += x[i] == y[i];
    return n;
  };
  std::vector<int64_t> identity(W);
  for (int w = 0; w < W; ++w) identity[w] = w;
  std::vector<std::vector<int64_t>> epochs;
  for (uint64_t e = 0; e < 4; ++e) {
    epochs.push_back(epoch_order(a, e));
    EXPECT_EQ(epochs.back(), epoch_order(same, e)) << "same seed, epoch " << e;
    EXPECT_LT(agreements(epochs.back(), epoch_order(other, e)), W / 50) << "seeds, epoch " << e;
    EXPECT_LT(agreements(epochs.back(), identity), W / 50) << "not shuffled, epoch " << e;
    // Neighbouring positions are not neighbouring windows (a shuffle, not a rotation).
    int adjacent = 0;
    for (int p = 0; p + 1 < W; ++p)
      adjacent += std::abs(epochs.back()[p + 1] - epochs.back()[p]) == 1;
    EXPECT_LT(adjacent, W / 50) << "epoch " << e;
  }
  for (size_t i = 0; i < epochs.size(); ++i) {
    for (size_t j = i + 1; j < epochs.size(); ++j) {
      EXPECT_LT(agreements(epochs[i], epochs[j]), W / 50) << "epochs " << i << ", " << j;
    }
  }
}

TEST(Sampler, DeterministicAndSeeded) {
  const int T = 16;
  TokenStream train = counting_stream(5000);
  Sampler a(train, TokenStream(), T, 1234, 0), b(train, TokenStream(), T, 1234, 0),
      c(train, TokenStream(), T, 1235, 0);
  std::vector<int32_t> ia(8 * T), ta(8 * T), ib(8 * T), tb(8 * T), ic(8 * T), tc(8 * T);
  a.next_batch(8, ia.data(), ta.data());
  b.next_batch(8, ib.data(), tb.data());
  c.next_batch(8, ic.data(), tc.data());
  EXPECT_EQ(ia, ib);
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ia, ic);
  EXPECT_EQ(a.state().next_sample, 8u);
  // The next batch differs from the first.
  a.next_batch(8, ia.data(), ta.data());
  EXPECT_NE(ia, ib);
  EXPECT_EQ(a.state().next_sample, 16u);
}

TEST(Sampler, OrderIsTheSameAtEveryDataParallelLayout) {
  // One stream of samples drawn by next_batch, against the trainer's way of drawing it: step
  // k's global batch is samples [8 k, 8 k + 8); DP rank d of dp fills its contiguous slice, in
  // micro-batches, from a sampler of its own. 13 steps of 8 cross two epoch boundaries (W = 41).
  const int T = 5, batch = 8, steps = 13;
  const TokenStream train = counting_stream(41 * T + 3);
  Sampler stream(train, TokenStream(), T, 99, 0);
  ASSERT_EQ(stream.windows_per_epoch(), 41);
  std::vector<int32_t> in(steps * batch * T), tgt(steps * batch * T);
  for (int k = 0; k < steps; ++k) {
    stream.next_batch(batch, in.data() + k * batch * T, tgt.data() + k * batch * T);
  }
  EXPECT_EQ(stream.state().next_sample, static_cast<uint64_t>(steps * batch));
  for (int dp : {1, 2, 4, 8}) {
    for (int micro : {batch / dp, 1}) {
      SCOPED_TRACE("dp=" + std::to_string(dp) + " micro=" + std::to_string(micro));
      const int per_rank = batch / dp;
      std::vector<int32_t> joined_in(in.size(), -1), joined_tgt(tgt.size(), -1);
      for (int rank = 0; rank < dp; ++rank) {
        Sampler mine(train, TokenStream(), T, 99, 0);  // only (seed, global index) decides
        for (int k = 0; k < steps; ++k) {
          const uint64_t rank_first = static_cast<uint64_t>(k * batch + rank * per_rank);
          for (int m = 0; m < per_rank / micro; ++m) {
            const size_t at = (rank_first + m * micro) * T;
            mine.fill_samples(rank_first + m * micro, micro, joined_in.data() + at,
                              joined_tgt.data() + at);
          }
        }
      }
      EXPECT_EQ(joined_in, in);
      EXPECT_EQ(joined_tgt, tgt);
    }
  }
}

TEST(Sampler, StateRoundTripsAndResumes) {
  const int T = 8;
  TokenStream train = counting_stream(2000);
  Sampler a(train, TokenStream(), T, 5, 0);
  std::vector<int32_t> in(4 * T), tgt(4 * T), in2(4 * T), tgt2(4 * T);
  a.next_batch(4, in.data(), tgt.data());
  a.next_batch(4, in.data(), tgt.data());
  const std::string saved = a.state().serialize();
  EXPECT_EQ(saved, "8");
  a.next_batch(4, in.data(), tgt.data());

  Sampler b(train, TokenStream(), T, 5, 0);
  b.set_state(SamplerState::parse(saved));
  b.next_batch(4, in2.data(), tgt2.data());
  EXPECT_EQ(in, in2);
  EXPECT_EQ(tgt, tgt2);

  EXPECT_EQ(SamplerState::parse("18446744073709551615").next_sample, 18446744073709551615ull);
  for (const char* bad : {"", "x", "12x", "-1", "18446744073709551616", " 3"}) {
    EXPECT_HAS(error_of(ErrorKind::kData, [&] { SamplerState::parse(bad); }),
               "sampler state '" + std::string(bad) + "'");
  }
}

TEST(Sampler, ValidationWindowsAreFixedSpreadAndNonOverlapping) {
  const int T = 10;
  // 1001 tokens of validation hold 100 non-overlapping windows; an evaluation reads 8.
  Sampler s(counting_stream(500), counting_stream(1001), T, 3, 8);
  EXPECT_EQ(s.val_windows(), 8);
  std::vector<int64_t> offsets;
  for (int w = 0; w < 8; ++w) offsets.push_back(s.val_offset(w));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 120, 250, 370, 500, 620, 750, 870}));
  for (int w = 1; w < 8; ++w) EXPECT_GE(offsets[w] - offsets[w - 1], T);  // no overlap
  EXPECT_LE(offsets.back() + T + 1, 1001);                                // inside the stream

  std::vector<int32_t> in(4 * T), tgt(4 * T), in2(4 * T), tgt2(4 * T);
  s.val_batch(1, 4, in.data(), tgt.data());
  s.val_batch(1, 4, in2.data(), tgt2.data());
  EXPECT_EQ(in, in2);  // fixed
  for (int t = 0; t < T; ++t) {
    EXPECT_EQ(in[t], (500 + t) % 251);  // window 4
    EXPECT_EQ(tgt[t], (501 + t) % 251);
  }
  // Wraps around: batch 2 reads windows 8..11 = windows 0..3.
  s.val_batch(2, 4, in.data(), tgt.data());
  s.val_batch(0, 4, in2.data(), tgt2.data());
  EXPECT_EQ(in, in2);
  // Validation reads do not move the training state.
  EXPECT_EQ(s.state().next_sample, 0u);

  // More windows asked for than fit: every slot, each once, then wrap.
  Sampler small(counting_stream(500), counting_stream(45), T, 3, 64);
  EXPECT_EQ(small.val_windows(), 4);
  EXPECT_EQ(small.val_offset(3), 30);
  EXPECT_EQ(small.val_offset(4), 0);

  Sampler none(counting_stream(500), TokenStream(), T, 3, 8);
  EXPECT_EQ(none.val_windows(), 0);
  EXPECT_THROW(none.val_batch(0, 1, in.data(), tgt.data()), Error);
}

TEST(Sampler, FromDatasetAndConfig) {
  config::KeelConfig cfg = load_config("", {"data.builtin_bytes=400000"});
  Dataset ds = Dataset::open(cfg);
  Sampler s(ds, cfg);
  EXPECT_EQ(s.seq_len(), 128);
  EXPECT_EQ(s.val_windows(), 4 * 16);                    // eval_batches x global_batch
  EXPECT_EQ(s.windows_per_epoch(), (380000 - 1) / 128);  // the training split's windows
  std::vector<int32_t> in(2 * 128), tgt(2 * 128);
  s.next_batch(2, in.data(), tgt.data());
  for (int t = 0; t + 1 < 128; ++t) EXPECT_EQ(in[t + 1], tgt[t]);
  // The default job: 3,800,000 training tokens hold 29687 windows of 128 + 1.
  const config::KeelConfig defaults = load_config("", {});
  EXPECT_EQ(Sampler(Dataset::open(defaults), defaults).windows_per_epoch(), 29687);
  // docs/data.md ("Sampling"): the default job (launch/configs/default.pbtxt: 600 steps of 16
  // sequences) reads 32.3% of an epoch.
  const config::KeelConfig job =
      load_config(std::string(KEEL_SOURCE_DIR) + "/launch/configs/default.pbtxt", {});
  const double windows = static_cast<double>(Sampler(Dataset::open(job), job).windows_per_epoch());
  EXPECT_NEAR(100.0 * job.train().steps() * job.train().global_batch() / windows, 32.3, 0.05);
}

// ---- built-in corpus ---------------------------------------------------------------------------

TEST(Corpus, DeterministicPerSeedAndPrefixStable) {
  const Corpus a = generate_corpus(7, 100000);
  const Corpus b = generate_corpus(7, 100000);
  const Corpus c = generate_corpus(8, 100000);
  const Corpus shorter = generate_corpus(7, 1234);
  ASSERT_EQ(a.bytes.size(), 100000u);
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.entropy_rate_nats_per_byte, b.entropy_rate_nats_per_byte);
  EXPECT_NE(a.bytes, c.bytes);
  EXPECT_NE(a.entropy_rate_nats_per_byte, c.entropy_rate_nats_per_byte);
  ASSERT_EQ(shorter.bytes.size(), 1234u);
  EXPECT_TRUE(std::equal(shorter.bytes.begin(), shorter.bytes.end(), a.bytes.begin()));
  for (uint8_t byte : a.bytes) {
    ASSERT_TRUE(std::isalpha(byte) || byte == ' ' || byte == '.' || byte == '\n') << int(byte);
  }
}

// Splits the corpus into its states (words with their '.', first letter lower-cased) and measures
// the empirical conditional entropy H(next word | word) in nats.
struct Measured {
  double nats_per_word = 0;
  double bytes_per_word = 0;
  size_t distinct_words = 0;
};

Measured measure(const std::vector<uint8_t>& bytes) {
  std::vector<int> ids;
  std::unordered_map<std::string, int> index;
  std::string word;
  size_t last_end = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const char c = static_cast<char>(bytes[i]);
    if (c != ' ' && c != '\n') {
      word += word.empty() ? static_cast<char>(std::tolower(c)) : c;
      continue;
    }
    ids.push_back(index.emplace(word, static_cast<int>(index.size())).first->second);
    word.clear();
    last_end = i + 1;
  }
  std::map<std::pair<int, int>, double> pairs;
  std::vector<double> firsts(index.size(), 0);
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    pairs[{ids[i], ids[i + 1]}] += 1;
    firsts[ids[i]] += 1;
  }
  const double n = static_cast<double>(ids.size() - 1);
  Measured m;
  for (const auto& [pair, count] : pairs) {
    m.nats_per_word -= count / n * std::log(count / firsts[pair.first]);
  }
  m.bytes_per_word = static_cast<double>(last_end) / static_cast<double>(ids.size());
  m.distinct_words = index.size();
  return m;
}

TEST(Corpus, EntropyFiguresMatchTheMeasuredText) {
  // The default corpus (data.builtin_seed=7, data.builtin_bytes=4000000) has the figures the
  // docs/data.md quotes, at the precision it prints them.
  const Corpus c = generate_corpus(7, 4000000);
  ASSERT_EQ(c.bytes.size(), 4000000u);
  std::printf("[corpus] entropy rate %.9g nats/byte, unigram entropy %.9g nats\n",
              c.entropy_rate_nats_per_byte, c.unigram_entropy_nats);
  EXPECT_NEAR(c.entropy_rate_nats_per_byte, 0.3075, 0.00005);  // docs/data.md: 0.3075 nats/byte
  EXPECT_NEAR(c.unigram_entropy_nats, 2.854, 0.0005);          // docs/data.md: 2.854 nats
  EXPECT_LT(c.entropy_rate_nats_per_byte, c.unigram_entropy_nats / 4);
  EXPECT_NEAR(c.entropy_rate_nats_per_byte, c.entropy_nats_per_word / c.mean_bytes_per_word, 1e-12);

  const Measured m = measure(c.bytes);
  EXPECT_LE(m.distinct_words, 400u);  // a closed lexicon: the text decodes to the chain's states
  EXPECT_NEAR(m.nats_per_word, c.entropy_nats_per_word, 0.05 * c.entropy_nats_per_word);
  EXPECT_NEAR(m.bytes_per_word, c.mean_bytes_per_word, 0.02 * c.mean_bytes_per_word);
  EXPECT_NEAR(m.nats_per_word / m.bytes_per_word, c.entropy_rate_nats_per_byte,
              0.05 * c.entropy_rate_nats_per_byte);

  // The reported unigram entropy is the text's.
  std::vector<double> counts(256, 0);
  for (uint8_t b : c.bytes) counts[b] += 1;
  double h = 0;
  for (double k : counts) {
    if (k > 0) h -= k / 4e6 * std::log(k / 4e6);
  }
  EXPECT_NEAR(h, c.unigram_entropy_nats, 1e-9);
}

TEST(Corpus, OtherSeedsStayInRange) {
  for (uint64_t seed : {1, 2, 3, 1000}) {
    const Corpus c = generate_corpus(seed, 1000);
    EXPECT_GT(c.entropy_rate_nats_per_byte, 0.2) << seed;
    EXPECT_LT(c.entropy_rate_nats_per_byte, 0.5) << seed;
  }
}

}  // namespace
}  // namespace keel
