// resolve_data_dir and data_dir_of: keel-data's output directory as data.path (see header).
#include "framework/data/data_dir.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "framework/data/tokenizer_json.h"
#include "framework/error.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kTrainGlob = "train_*.bin";
constexpr const char* kValGlob = "val_*.bin";

// `s` with glob(3)'s special characters escaped, so a directory named "runs[1]" matches itself.
std::string glob_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string glob_unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) ++i;
    out += s[i];
  }
  return out;
}

// keel-data.json's vocab_size, checked.
int64_t metadata_vocab_size(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  KEEL_CHECK(in.good(), kData, file, ": cannot open");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    KEEL_FAIL(kData, file, ": not JSON (", e.what(), ")");
  }
  KEEL_CHECK(j.is_object() && j.contains("vocab_size") && j["vocab_size"].is_number_integer(),
             kData, file, ": no integer vocab_size (is it keel-data's metadata?)");
  const int64_t v = j["vocab_size"].get<int64_t>();
  KEEL_CHECK(v > 0 && v <= std::numeric_limits<int32_t>::max(), kData, file, ": vocab_size ", v,
             " is outside [1, 2^31 - 1]");
  return v;
}

}  // namespace

std::optional<DataDir> resolve_data_dir(config::KeelConfig& cfg) {
  config::Data& d = *cfg.mutable_data();
  std::string dir = d.path();
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return std::nullopt;
  const std::string meta = (fs::path(dir) / kDataDirMetadata).string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  KEEL_CHECK(fs::exists(meta, ec), kData, "data.path='", dir,
             "' is not a regular file but a directory without ", kDataDirMetadata,
             ": give a text file, llm.c shards (a file or a glob), or a directory "
             "launch/tools/keel-data wrote");
  KEEL_CHECK(d.format() == config::AUTO || d.format() == config::SHARDS, kConfig,
             "data.format=", config::DataFormat_Name(d.format()), " but data.path='", dir,
             "' is a keel-data directory (it holds ", kDataDirMetadata,
             "): leave data.format at AUTO or set SHARDS");

  DataDir out;
  out.dir = dir;
  out.vocab_size = metadata_vocab_size(meta);
  std::string source = meta;
  const std::string tok = (fs::path(dir) / kDataDirTokenizer).string();
  if (fs::exists(tok, ec)) {
    const int64_t tv = TokenizerJson::load(tok).vocab_size();
    KEEL_CHECK(tv == out.vocab_size, kData, meta, " says vocab_size ", out.vocab_size, " but ", tok,
               " holds ", tv, " tokens: they are not from the same keel-data run");
    out.tokenizer = tok;
    source = tok;
  }
  config::Model& m = *cfg.mutable_model();
  if (m.vocab_size() == 0) m.set_vocab_size(static_cast<int32_t>(out.vocab_size));
  KEEL_CHECK(m.vocab_size() >= out.vocab_size, kConfig, "model.vocab_size=", m.vocab_size(),
             " is smaller than the ", out.vocab_size, " tokens of ", source,
             ": set model.vocab_size=", out.vocab_size, " (or 0 to take it from data.path)");

  d.set_path(glob_escape(dir) + "/" + kTrainGlob);
  if (d.val_path().empty()) d.set_val_path(glob_escape(dir) + "/" + kValGlob);
  d.set_format(config::SHARDS);
  return out;
}

std::string data_dir_of(const std::string& data_path) {
  const std::string suffix = std::string("/") + kTrainGlob;
  if (data_path.size() <= suffix.size() ||
      data_path.compare(data_path.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return "";
  }
  const std::string dir = glob_unescape(data_path.substr(0, data_path.size() - suffix.size()));
  std::error_code ec;
  return fs::exists(fs::path(dir) / kDataDirMetadata, ec) ? dir : "";
}

}  // namespace keel
