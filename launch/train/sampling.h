// Text sampling from a trained model: a prompt from the data (the start of the validation split,
// or of the training data), then tokens drawn one at a time at a temperature, reproducibly from a
// seed (Philox), until n_chars bytes of text follow the prompt. Byte-level vocabularies: each
// token is one byte. With a tokenizer (a keel-data directory's tokenizer.json), each token
// decodes to its bytes through it.
#pragma once

#include <cstdint>
#include <string>

#include "framework/data/dataset.h"
#include "framework/data/tokenizer_json.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"

namespace keel {

// Needs parallel.tp=1 (it reads whole logit rows). Without a tokenizer every token must be < 256.
// At most n_chars tokens are drawn (a token that decodes to nothing still counts).
std::string sample_text(GPT& model, const Dataset& data, const Topology& topo, int64_t n_chars,
                        uint64_t seed, float temperature, const TokenizerJson* tokenizer = nullptr);

}  // namespace keel
