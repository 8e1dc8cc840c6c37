// A directory keel-data wrote (launch/tools/keel-data, docs/data.md): keel-data.json (its
// metadata), train_*.bin and val_*.bin (llm.c shards) and tokenizer.json. `--set data.path=DIR`
// names one; resolve_data_dir turns that into the shard globs Dataset reads, before the config is
// validated, and checks model.vocab_size against the tokenizer.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "framework/config/keel.pb.h"

namespace keel {

inline constexpr const char* kDataDirMetadata = "keel-data.json";
inline constexpr const char* kDataDirTokenizer = "tokenizer.json";

struct DataDir {
  std::string dir;
  int64_t vocab_size = 0;  // keel-data.json's (the tokenizer's, when it has one)
  std::string tokenizer;   // DIR/tokenizer.json, or "" when there is none
};

// When `cfg.data.path` (of a config not yet validated) names a directory that holds
// keel-data.json: sets data.path to DIR/train_*.bin, data.val_path to DIR/val_*.bin unless it is
// set, data.format to SHARDS (refusing TEXT and BUILTIN), and model.vocab_size to the data's
// when it is 0; then refuses (kConfig, naming both numbers) a model.vocab_size below the
// tokenizer's (a larger one pads the embedding, as llm.c pads GPT-2's 50257 to 50304). Throws
// kData naming the file for malformed metadata or tokenizer, and for a directory without
// keel-data.json. Returns nullopt, and changes nothing, when data.path is not a directory.
std::optional<DataDir> resolve_data_dir(config::KeelConfig& cfg);

// The keel-data directory whose training shards `data_path` (a resolved data.path, as a
// checkpoint's config records it) names: DIR when data_path is DIR/train_*.bin and DIR holds
// keel-data.json; "" otherwise.
std::string data_dir_of(const std::string& data_path);

}  // namespace keel
