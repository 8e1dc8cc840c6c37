// The training and validation token streams a validated config describes: the built-in corpus, a
// text file or llm.c shards; validation is the tail data.val_fraction of the stream, or the
// separate data.val_path (read in the same data.format) when that is set.
#pragma once

#include <optional>

#include "framework/config/keel.pb.h"
#include "framework/data/token_stream.h"

namespace keel {

class Dataset {
 public:
  // `cfg` must have been through validate() (data.format resolved). Throws kData when a source is
  // missing or malformed, or a split holds fewer than model.seq_len + 1 tokens.
  static Dataset open(const config::KeelConfig& cfg);

  // Refuses (kConfig) a train.eval_batches that reads more than one pass over the validation
  // split per evaluation: eval_batches x global_batch windows when the split holds W distinct
  // windows of seq_len tokens, so at most ceil(W / global_batch) batches (at least 1). Beyond that
  // an evaluation only re-reads windows it has already read, at the cost of more forward passes
  // (2^31 - 1 batches never ends). Sizes come from TokenStream::peek_size, so this runs before
  // anything is opened or allocated; a source it cannot size is left to open() to report.
  // Does nothing when train.eval_every is 0.
  static void check_eval_batches(const config::KeelConfig& cfg);

  const TokenStream& train() const { return train_; }
  const TokenStream& val() const { return val_; }  // empty when there is no validation split
  bool has_val() const { return !val_.empty(); }

  // The source's exact entropy rate in nats per token (the loss floor), for the built-in corpus.
  std::optional<double> entropy_rate_nats_per_token() const { return entropy_rate_; }

 private:
  TokenStream train_;
  TokenStream val_;
  std::optional<double> entropy_rate_;
};

}  // namespace keel
