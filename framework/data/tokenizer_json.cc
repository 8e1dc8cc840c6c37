// TokenizerJson: a tokenizer.json's vocabulary and id -> bytes decoding (see header).
#include "framework/data/tokenizer_json.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "framework/error.h"

namespace keel {
namespace {

using nlohmann::json;

// GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py), inverted: bytes '!'..'~', 0xA1..0xAC and
// 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order, for U+0100...U+0143.
std::array<int, 324> inverse_byte_table() {
  std::array<int, 324> inv{};
  inv.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    inv[printable ? b : next++] = b;
  }
  return inv;
}

// The code points of UTF-8 `s`; a malformed sequence gives U+FFFD for its first byte.
std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int len = c < 0x80           ? 1
                    : (c >> 5) == 0x6  ? 2
                    : (c >> 4) == 0xE  ? 3
                    : (c >> 3) == 0x1E ? 4
                                       : 0;
    bool ok = len > 0 && i + len <= s.size();
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (int k = 1; ok && k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      ok = (cc & 0xC0) == 0x80;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += static_cast<size_t>(len);
  }
  return out;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// A byte-level token string's bytes: each character through the inverted table (a character
// outside it, which a byte-level vocabulary does not hold, keeps its UTF-8 bytes).
std::string byte_level_bytes(const std::string& token) {
  std::string out;
  for (uint32_t cp : code_points(token)) {
    const int b = byte_of_code_point(cp);
    if (b >= 0) {
      out += static_cast<char>(b);
    } else {
      append_utf8(cp, out);
    }
  }
  return out;
}

// A SentencePiece-style token's bytes: "<0xNN>" is byte NN, and U+2581 ("▁") is a space.
std::string metaspace_bytes(const std::string& token) {
  if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>') {
    const std::string hex = token.substr(3, 2);
    if (hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos) {
      return std::string(1, static_cast<char>(std::stoi(hex, nullptr, 16)));
    }
  }
  std::string out;
  for (size_t i = 0; i < token.size(); ++i) {
    if (token.compare(i, 3, "\xE2\x96\x81") == 0) {
      out += ' ';
      i += 2;
    } else {
      out += token[i];
    }
  }
  return out;
}

// Whether `decoder` (tokenizer.json's "decoder") is ByteLevel, or a Sequence holding one.
bool is_byte_level(const json& decoder) {
  if (!decoder.is_object()) return false;
  const auto type = decoder.find("type");
  if (type == decoder.end() || !type->is_string()) return false;
  if (*type == "ByteLevel") return true;
  const auto seq = decoder.find("decoders");
  if (*type != "Sequence" || seq == decoder.end() || !seq->is_array()) return false;
  for (const json& d : *seq) {
    if (is_byte_level(d)) return true;
  }
  return false;
}

// An id as tokenizer.json writes it, checked: a non-negative integer below 2^31 - 1.
int64_t checked_id(const json& v, const std::string& path, const std::string& where) {
  KEEL_CHECK(v.is_number_integer(), kData, path, ": ", where, " is not an integer id");
  const int64_t id = v.get<int64_t>();
  KEEL_CHECK(id >= 0 && id < std::numeric_limits<int32_t>::max(), kData, path, ": ", where,
             " has id ", id, ", outside [0, 2^31 - 1)");
  return id;
}

}  // namespace

int byte_of_code_point(uint32_t cp) {
  static const std::array<int, 324> inv = inverse_byte_table();
  return cp < inv.size() ? inv[cp] : -1;
}

TokenizerJson TokenizerJson::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KEEL_CHECK(in.good(), kData, path, ": cannot open tokenizer");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    KEEL_FAIL(kData, path, ": not a tokenizer.json (", e.what(), ")");
  }
  KEEL_CHECK(j.is_object() && j.contains("model") && j["model"].is_object() &&
                 j["model"].contains("vocab"),
             kData, path, ": not a Hugging Face tokenizer.json (no model.vocab)");
  const json& vocab = j["model"]["vocab"];
  std::vector<std::pair<int64_t, std::string>> tokens;  // (id, token string)
  if (vocab.is_object()) {
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      tokens.emplace_back(
          checked_id(it.value(), path, "model.vocab entry '" + clip_echo(it.key()) + "'"),
          it.key());
    }
  } else if (vocab.is_array()) {  // Unigram: [[token, score], ...], ids are positions
    for (size_t i = 0; i < vocab.size(); ++i) {
      const json& e = vocab[i];
      KEEL_CHECK(e.is_array() && !e.empty() && e[0].is_string(), kData, path, ": model.vocab[", i,
                 "] is not a [token, score] pair");
      tokens.emplace_back(static_cast<int64_t>(i), e[0].get<std::string>());
    }
  } else {
    KEEL_FAIL(kData, path, ": model.vocab is neither an object nor an array");
  }
  std::vector<std::pair<int64_t, std::string>> added;  // (id, content)
  if (j.contains("added_tokens")) {
    const json& a = j["added_tokens"];
    KEEL_CHECK(a.is_array(), kData, path, ": added_tokens is not an array");
    for (size_t i = 0; i < a.size(); ++i) {
      const json& e = a[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      KEEL_CHECK(
          e.is_object() && e.contains("id") && e.contains("content") && e["content"].is_string(),
          kData, path, ": ", where, " has no id and content");
      added.emplace_back(checked_id(e["id"], path, where), e["content"].get<std::string>());
    }
  }
  KEEL_CHECK(!tokens.empty() || !added.empty(), kData, path, ": the vocabulary is empty");

  TokenizerJson t;
  t.byte_level_ = j.contains("decoder") && is_byte_level(j["decoder"]);
  int64_t top = -1;
  for (const auto& [id, s] : tokens) top = std::max(top, id);
  for (const auto& [id, s] : added) top = std::max(top, id);
  t.bytes_.assign(static_cast<size_t>(top + 1), std::string());
  for (const auto& [id, s] : tokens) {
    t.bytes_[static_cast<size_t>(id)] = t.byte_level_ ? byte_level_bytes(s) : metaspace_bytes(s);
  }
  for (const auto& [id, s] : added) t.bytes_[static_cast<size_t>(id)] = s;  // as written
  return t;
}

const std::string& TokenizerJson::decode(int64_t id) const {
  static const std::string kNone;
  return id >= 0 && id < vocab_size() ? bytes_[static_cast<size_t>(id)] : kNone;
}

std::string TokenizerJson::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += decode(id);
  return out;
}

}  // namespace keel
