// A Hugging Face tokenizer.json, read for what keel-train needs of it: the vocabulary size (to
// check model.vocab_size against) and decoding token ids to bytes (the text sample at the end of
// a run). Encoding is keel-data's job (launch/tools/keel-data), not keel-train's.
//
// Decoding: a byte-level tokenizer (decoder "ByteLevel": GPT-2, Llama 3, Qwen, keel-data's)
// writes each byte as one character of GPT-2's byte-to-unicode table (printable bytes as
// themselves, the other 68 as U+0100...), so a token's bytes are its string's characters mapped
// back through that table. Other tokenizers (SentencePiece conversions: "▁" for a space,
// "<0x0A>" byte fallback) decode by those two rules. Added tokens (<|endoftext|>) decode to their
// content. An id without a token decodes to nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

class TokenizerJson {
 public:
  // Throws kData naming `path` when it cannot be read, is not JSON, or has no model.vocab (an
  // object of token -> id, or Unigram's array of [token, score]) or a malformed entry.
  static TokenizerJson load(const std::string& path);

  // The highest id of the vocabulary and the added tokens, plus one: what model.vocab_size must
  // reach for every id to have an embedding row.
  int64_t vocab_size() const { return static_cast<int64_t>(bytes_.size()); }
  bool byte_level() const { return byte_level_; }

  // The bytes of token `id` ("" outside [0, vocab_size()) or for an id no token has).
  const std::string& decode(int64_t id) const;
  // The concatenated bytes of `ids`.
  std::string decode(const std::vector<int32_t>& ids) const;

 private:
  std::vector<std::string> bytes_;  // [id] = the token's bytes
  bool byte_level_ = false;
};

// GPT-2's byte-to-unicode table inverted: the byte a code point stands for in a byte-level
// token string, or -1 for a code point outside the table.
int byte_of_code_point(uint32_t cp);

}  // namespace keel
