// Dataset::open: builds the sources a config names and splits off validation (see header).
#include "framework/data/dataset.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "framework/data/corpus.h"
#include "framework/error.h"

namespace keel {
namespace {

TokenStream open_source(config::DataFormat format, const std::string& path, int32_t vocab_size,
                        const std::string& field) {
  if (format == config::SHARDS) return TokenStream::open_shards(path, vocab_size, field);
  KEEL_ASSERT(format == config::TEXT);
  return TokenStream::open_text(path, vocab_size, field);
}

// Tokens of the validation split open() would build from `cfg`, without reading any token.
std::optional<int64_t> val_split_tokens(const config::KeelConfig& cfg) {
  const config::Data& d = cfg.data();
  const bool shards = d.format() == config::SHARDS;
  if (!d.val_path().empty()) return TokenStream::peek_size(d.val_path(), shards);
  std::optional<int64_t> all;
  if (d.format() == config::BUILTIN) {
    all = d.builtin_bytes();
  } else {
    all = TokenStream::peek_size(d.path(), shards);
  }
  if (!all) return std::nullopt;
  return std::llround(static_cast<double>(*all) * d.val_fraction());  // as open() rounds it
}

}  // namespace

void Dataset::check_eval_batches(const config::KeelConfig& cfg) {
  const config::Train& t = cfg.train();
  if (t.eval_every() == 0) return;
  const std::optional<int64_t> tokens = val_split_tokens(cfg);
  const int64_t seq_len = cfg.model().seq_len();
  if (!tokens || *tokens < seq_len + 1) return;  // open() names the missing or small split
  const int64_t windows = (*tokens - 1) / seq_len;
  const int64_t batch = t.global_batch();
  const int64_t most = std::max<int64_t>(1, (windows + batch - 1) / batch);
  const std::string split = cfg.data().val_path().empty()
                                ? detail::concat("data.val_fraction=", cfg.data().val_fraction())
                                : std::string("data.val_path");
  KEEL_CHECK(t.eval_batches() <= most, kConfig, "train.eval_batches=", t.eval_batches(), " reads ",
             static_cast<int64_t>(t.eval_batches()) * batch,
             " validation windows per evaluation, but the validation split (", split, ", ", *tokens,
             " tokens) holds only ", windows, " distinct windows of model.seq_len=", seq_len,
             ": more would re-read them; use at most ", most,
             " (batches of train.global_batch=", batch, ")");
}

Dataset Dataset::open(const config::KeelConfig& cfg) {
  const config::Data& d = cfg.data();
  const int32_t vocab = cfg.model().vocab_size();
  const int64_t need = static_cast<int64_t>(cfg.model().seq_len()) + 1;
  KEEL_CHECK(
      d.format() == config::BUILTIN || d.format() == config::TEXT || d.format() == config::SHARDS,
      kInternal,
      "Dataset::open needs a validated config (data.format=", config::DataFormat_Name(d.format()),
      ")");

  Dataset ds;
  TokenStream all;
  std::string field = "data.path";
  if (d.format() == config::BUILTIN) {
    Corpus corpus = generate_corpus(d.builtin_seed(), d.builtin_bytes());
    ds.entropy_rate_ = corpus.entropy_rate_nats_per_byte;
    all = TokenStream::from_bytes(
        std::move(corpus.bytes),
        "built-in corpus (data.builtin_seed=" + std::to_string(d.builtin_seed()) + ", " +
            std::to_string(d.builtin_bytes()) + " bytes)",
        vocab);
    field = "data.builtin_bytes=" + std::to_string(d.builtin_bytes());
  } else {
    all = open_source(d.format(), d.path(), vocab, "data.path");
  }

  if (!d.val_path().empty()) {
    ds.train_ = all;
    ds.val_ = open_source(d.format(), d.val_path(), vocab, "data.val_path");
    KEEL_CHECK(ds.val_.size() >= need, kData, "data.val_path: ", ds.val_.describe(), " holds ",
               ds.val_.size(), " tokens, fewer than model.seq_len+1=", need);
    KEEL_CHECK(ds.train_.size() >= need, kData, field, ": ", all.describe(), " holds ",
               ds.train_.size(), " tokens, fewer than model.seq_len+1=", need);
    return ds;
  }
  // Rounded, so a float fraction like 0.01f (0.0099999998) holds out 20 of 2000 tokens, not 19.
  const int64_t n_val = std::llround(static_cast<double>(all.size()) * d.val_fraction());
  const int64_t n_train = all.size() - n_val;
  KEEL_CHECK(n_train >= need, kData, field, ": ", all.describe(), " leaves ", n_train,
             " training tokens after data.val_fraction=", d.val_fraction(),
             ", fewer than model.seq_len+1=", need);
  ds.train_ = all.slice(0, n_train);
  if (n_val > 0 || d.val_fraction() > 0) {
    KEEL_CHECK(n_val >= need, kData, "data.val_fraction=", d.val_fraction(), ": holds out ", n_val,
               " of ", all.size(), " tokens for validation, fewer than model.seq_len+1=", need);
    ds.val_ = all.slice(n_train, n_val);
  }
  return ds;
}

}  // namespace keel
