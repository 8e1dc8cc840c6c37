// Text sampling from a trained model: a prompt from the data (the start of the validation split,
// or of the training data), then n characters drawn one at a time at a temperature, reproducibly
// from a seed (Philox). Byte-level vocabularies: each token is one character.
#pragma once

#include <cstdint>
#include <string>

#include "framework/data/dataset.h"
#include "layers/gpt.h"
#include "parallel/communicator.h"

namespace keel {

// Needs parallel.tp=1 (it reads whole logit rows).
std::string sample_text(GPT& model, const Dataset& data, const Topology& topo, int64_t n_chars,
                        uint64_t seed, float temperature);

}  // namespace keel
