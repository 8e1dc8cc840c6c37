// Tests for framework/data/tokenizer_json (GPT-2's byte table inverted, decoding byte-level and
// SentencePiece-style tokens, vocabulary size, malformed files) and framework/data/data_dir
// (a keel-data directory as data.path: shard globs, model.vocab_size 0 taken from the data, the
// vocabulary check naming both numbers, the refusals).
#include "framework/data/data_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/data/dataset.h"
#include "framework/data/token_stream.h"
#include "framework/data/tokenizer_json.h"
#include "framework/error.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using testing::error_of;
using testing::TempDir;

#define EXPECT_HAS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "'" << (part) << "' not in: " << (message)

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A byte-level BPE tokenizer.json as keel-data writes it (trimmed to what the reader uses):
// "Ġ" (U+0120) is the space byte, "Ċ" (U+010A) the newline, "Ã©" the two bytes of UTF-8 "é".
const char* kByteLevel = R"({
  "version": "1.0",
  "added_tokens": [{"id": 0, "content": "<|endoftext|>", "special": true}],
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true},
  "model": {"type": "BPE", "vocab": {"<|endoftext|>": 0, "a": 1, "b": 2, "Ġ": 3, "Ċ": 4,
            "ab": 5, "Ġab": 6, "Ã©": 7, "ĉ": 8, "Ā": 9, "ÿ": 10, "Ń": 11}, "merges": []}
})";

TEST(TokenizerJson, GptByteTableInverted) {
  // Printable bytes stand for themselves; the other 68 follow U+0100 in increasing byte order.
  EXPECT_EQ(byte_of_code_point('A'), 'A');
  EXPECT_EQ(byte_of_code_point('~'), '~');
  EXPECT_EQ(byte_of_code_point(0xA1), 0xA1);
  EXPECT_EQ(byte_of_code_point(0xFF), 0xFF);
  EXPECT_EQ(byte_of_code_point(0x100), 0x00);  // Ā
  EXPECT_EQ(byte_of_code_point(0x109), '\t');  // ĉ
  EXPECT_EQ(byte_of_code_point(0x10A), '\n');  // Ċ
  EXPECT_EQ(byte_of_code_point(0x120), ' ');   // Ġ
  EXPECT_EQ(byte_of_code_point(0x121), 0x7F);  // ġ: DEL follows the 33 control bytes and space
  EXPECT_EQ(byte_of_code_point(0x143), 0xAD);  // Ń: the last, soft hyphen
  EXPECT_EQ(byte_of_code_point(0x144), -1);
  EXPECT_EQ(byte_of_code_point(' '), -1);   // space is not printable in the table
  EXPECT_EQ(byte_of_code_point(0xAD), -1);  // nor is the soft hyphen
  // The table is a bijection onto the 256 bytes.
  std::vector<int> seen(256, 0);
  for (uint32_t cp = 0; cp < 0x200; ++cp) {
    const int b = byte_of_code_point(cp);
    if (b >= 0) ++seen[b];
  }
  for (int b = 0; b < 256; ++b) EXPECT_EQ(seen[b], 1) << "byte " << b;
}

TEST(TokenizerJson, DecodesByteLevelTokens) {
  TempDir dir;
  write(dir.file("tokenizer.json"), kByteLevel);
  const TokenizerJson t = TokenizerJson::load(dir.file("tokenizer.json"));
  EXPECT_TRUE(t.byte_level());
  EXPECT_EQ(t.vocab_size(), 12);
  EXPECT_EQ(t.decode(std::vector<int32_t>{0, 5, 6, 4, 3, 7, 8}), "<|endoftext|>ab ab\n \xC3\xA9\t");
  EXPECT_EQ(t.decode(9), std::string(1, '\0'));
  EXPECT_EQ(t.decode(10), "\xFF");
  EXPECT_EQ(t.decode(11), "\xAD");
  EXPECT_EQ(t.decode(12), "");  // past the vocabulary
  EXPECT_EQ(t.decode(-1), "");
}

TEST(TokenizerJson, DecodesSentencePieceStyleTokensAndCountsAddedIds) {
  TempDir dir;
  // Metaspace: "▁" is a space, "<0x0A>" a byte. An added token past the vocabulary sets the size.
  write(dir.file("sp.json"), R"({
    "added_tokens": [{"id": 9, "content": "</s>"}],
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]},
    "model": {"type": "BPE", "vocab": {"<unk>": 0, "▁hello": 1, "<0x0A>": 2, "▁wor": 3, "ld": 4}}
  })");
  const TokenizerJson t = TokenizerJson::load(dir.file("sp.json"));
  EXPECT_FALSE(t.byte_level());
  EXPECT_EQ(t.vocab_size(), 10);
  EXPECT_EQ(t.decode(std::vector<int32_t>{1, 3, 4, 2, 9}), " hello world\n</s>");
  EXPECT_EQ(t.decode(5), "");  // an id no token has

  // Unigram's vocabulary: [token, score] pairs, ids are positions.
  write(dir.file("unigram.json"),
        R"({"model": {"type": "Unigram", "vocab": [["<unk>", 0], ["▁a", -1.5], ["b", -2]]}})");
  const TokenizerJson u = TokenizerJson::load(dir.file("unigram.json"));
  EXPECT_EQ(u.vocab_size(), 3);
  EXPECT_EQ(u.decode(std::vector<int32_t>{1, 2}), " ab");
}

TEST(TokenizerJson, MalformedFilesNameTheFile) {
  TempDir dir;
  const auto load = [](const std::string& path) { return [=] { TokenizerJson::load(path); }; };
  const std::string missing = dir.file("missing.json");
  EXPECT_HAS(error_of(ErrorKind::kData, load(missing)), missing + ": cannot open tokenizer");
  const std::string garbage = dir.file("garbage.json");
  write(garbage, "not json");
  EXPECT_HAS(error_of(ErrorKind::kData, load(garbage)), garbage + ": not a tokenizer.json (");
  const std::string novocab = dir.file("novocab.json");
  write(novocab, R"({"model": {"type": "BPE"}})");
  EXPECT_HAS(error_of(ErrorKind::kData, load(novocab)),
             novocab + ": not a Hugging Face tokenizer.json (no model.vocab)");
  const std::string negative = dir.file("negative.json");
  write(negative, R"({"model": {"vocab": {"a": -3}}})");
  EXPECT_HAS(error_of(ErrorKind::kData, load(negative)),
             negative + ": model.vocab entry 'a' has id -3, outside [0, 2^31 - 1)");
  const std::string text_id = dir.file("text_id.json");
  write(text_id, R"({"model": {"vocab": {"a": "1"}}})");
  EXPECT_HAS(error_of(ErrorKind::kData, load(text_id)),
             text_id + ": model.vocab entry 'a' is not an integer id");
  const std::string bad_added = dir.file("bad_added.json");
  write(bad_added, R"({"added_tokens": [{"id": 1}], "model": {"vocab": {"a": 0}}})");
  EXPECT_HAS(error_of(ErrorKind::kData, load(bad_added)),
             bad_added + ": added_tokens[0] has no id and content");
}

// ---- keel-data directories -------------------------------------------------------------------

// A keel-data directory: metadata with `vocab`, the byte-level tokenizer above (12 tokens) unless
// `tokenizer` is false, and one training and one validation shard of `n` tokens each.
void make_data_dir(const std::string& dir, int64_t vocab, bool tokenizer = true, int n = 40) {
  std::filesystem::create_directories(dir);
  write(dir + "/keel-data.json",
        R"({"format": "keel-data", "version": 1, "vocab_size": )" + std::to_string(vocab) + "}");
  if (tokenizer) write(dir + "/tokenizer.json", kByteLevel);
  for (const char* name : {"/train_000000.bin", "/val_000000.bin"}) {
    std::vector<int32_t> header(256, 0);
    header[0] = kShardMagic;
    header[1] = kShardVersion;
    header[2] = n;
    std::string bytes(reinterpret_cast<const char*>(header.data()), kShardHeaderBytes);
    for (int i = 0; i < n; ++i) {
      const auto t = static_cast<uint16_t>(i % 12);
      bytes.append(reinterpret_cast<const char*>(&t), 2);
    }
    write(dir + name, bytes);
  }
}

config::KeelConfig config_for(const std::string& path, int32_t vocab) {
  config::KeelConfig cfg = default_config();
  cfg.mutable_data()->set_path(path);
  cfg.mutable_model()->set_vocab_size(vocab);
  cfg.mutable_model()->set_seq_len(8);
  return cfg;
}

TEST(DataDir, ReadsTheShardsAndTakesVocabSizeWhenZero) {
  TempDir tmp;
  const std::string dir = tmp.file("data");
  make_data_dir(dir, 12);
  config::KeelConfig cfg = config_for(dir + "/", 0);  // a trailing slash is the same directory
  const std::optional<DataDir> d = resolve_data_dir(cfg);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->dir, dir);
  EXPECT_EQ(d->vocab_size, 12);
  EXPECT_EQ(d->tokenizer, dir + "/tokenizer.json");
  EXPECT_EQ(cfg.model().vocab_size(), 12);
  EXPECT_EQ(cfg.data().path(), dir + "/train_*.bin");
  EXPECT_EQ(cfg.data().val_path(), dir + "/val_*.bin");
  EXPECT_EQ(cfg.data().format(), config::SHARDS);
  validate(cfg);
  const Dataset ds = Dataset::open(cfg);
  EXPECT_EQ(ds.train().size(), 40);
  EXPECT_EQ(ds.val().size(), 40);  // the validation shards, not a fraction of the training ones
  EXPECT_EQ(data_dir_of(cfg.data().path()), dir);
  EXPECT_EQ(data_dir_of(dir + "/val_*.bin"), "");
  EXPECT_EQ(data_dir_of("/nonexistent/train_*.bin"), "");
}

TEST(DataDir, AGivenVocabSizeIsCheckedAgainstTheTokenizer) {
  TempDir tmp;
  const std::string dir = tmp.file("data");
  make_data_dir(dir, 12);
  config::KeelConfig small = config_for(dir, 11);
  EXPECT_HAS(error_of(ErrorKind::kConfig, [&] { resolve_data_dir(small); }),
             "model.vocab_size=11 is smaller than the 12 tokens of " + dir +
                 "/tokenizer.json: set model.vocab_size=12 (or 0 to take it from data.path)");
  config::KeelConfig padded = config_for(dir, 64);  // a padded embedding is allowed
  ASSERT_TRUE(resolve_data_dir(padded).has_value());
  EXPECT_EQ(padded.model().vocab_size(), 64);
  // Without a tokenizer the metadata's vocab_size is the one checked, and nothing decodes.
  const std::string bare = tmp.file("bare");
  make_data_dir(bare, 12, /*tokenizer=*/false);
  config::KeelConfig c = config_for(bare, 5);
  EXPECT_HAS(error_of(ErrorKind::kConfig, [&] { resolve_data_dir(c); }),
             "model.vocab_size=5 is smaller than the 12 tokens of " + bare + "/keel-data.json");
  config::KeelConfig z = config_for(bare, 0);
  EXPECT_EQ(resolve_data_dir(z)->tokenizer, "");
  EXPECT_EQ(z.model().vocab_size(), 12);
}

TEST(DataDir, RefusalsAndWhatIsLeftAlone) {
  TempDir tmp;
  const std::string dir = tmp.file("runs[1]");  // glob characters in the name are escaped
  make_data_dir(dir, 12);
  config::KeelConfig cfg = config_for(dir, 0);
  cfg.mutable_data()->set_val_path(tmp.file("elsewhere_*.bin"));  // a set val_path is kept
  ASSERT_TRUE(resolve_data_dir(cfg).has_value());
  EXPECT_EQ(cfg.data().val_path(), tmp.file("elsewhere_*.bin"));
  EXPECT_EQ(TokenStream::open_shards(cfg.data().path(), 12, "data.path").size(), 40);
  EXPECT_EQ(data_dir_of(cfg.data().path()), dir);

  config::KeelConfig text = config_for(dir, 0);
  text.mutable_data()->set_format(config::TEXT);
  EXPECT_HAS(error_of(ErrorKind::kConfig, [&] { resolve_data_dir(text); }),
             "data.format=TEXT but data.path='" + dir + "' is a keel-data directory");

  // Metadata and tokenizer that disagree, or malformed metadata: data errors naming the file.
  const std::string odd = tmp.file("odd");
  make_data_dir(odd, 13);
  config::KeelConfig c = config_for(odd, 0);
  EXPECT_HAS(
      error_of(ErrorKind::kData, [&] { resolve_data_dir(c); }),
      odd + "/keel-data.json says vocab_size 13 but " + odd + "/tokenizer.json holds 12 tokens");
  write(odd + "/keel-data.json", R"({"vocab": 12})");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { resolve_data_dir(c); }),
             odd + "/keel-data.json: no integer vocab_size");
  write(odd + "/keel-data.json", "{");
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { resolve_data_dir(c); }),
             odd + "/keel-data.json: not JSON");

  // A directory keel-data did not write is refused, not read as a text file.
  const std::string plain_dir = tmp.file("plain");
  std::filesystem::create_directories(plain_dir);
  config::KeelConfig p = config_for(plain_dir + "/", 0);
  EXPECT_HAS(error_of(ErrorKind::kData, [&] { resolve_data_dir(p); }),
             "data.path='" + plain_dir +
                 "' is not a regular file but a directory without keel-data.json: give a text "
                 "file, llm.c shards");
  // Not directories: a file, a glob, an empty path. Nothing changes.
  for (const std::string& path : {dir + "/train_000000.bin", tmp.file("x_*.bin"), std::string()}) {
    config::KeelConfig plain = config_for(path, 0);
    EXPECT_FALSE(resolve_data_dir(plain).has_value()) << path;
    EXPECT_EQ(plain.data().path(), path);
    EXPECT_EQ(plain.model().vocab_size(), 0);
  }
}

}  // namespace
}  // namespace keel
