// The built-in corpus: seeded, generated English-looking text whose entropy rate is known exactly,
// so a training run on it has a loss floor to compare against (nothing is copied from anywhere).
//
// A lexicon of invented lowercase words (2-9 letters, built from syllables) and sentence-final
// variants ("word.") forms the states of a sparse first-order Markov chain: each state has 3-8
// successors with Zipf-like probabilities. A state emits its word (capitalised after a
// sentence-final state) and one separator (a space, or a newline after a paragraph end).
#pragma once

#include <cstdint>
#include <vector>

namespace keel {

struct Corpus {
  std::vector<uint8_t> bytes;         // exactly n_bytes; ASCII letters, '.', ' ', '\n'
  double entropy_rate_nats_per_byte;  // exact entropy rate of the generating process
  double unigram_entropy_nats;        // empirical byte-unigram entropy of `bytes`
  double entropy_nats_per_word;       // sum_i pi_i H(P_i): the chain's entropy per state (word)
  double mean_bytes_per_word;         // sum_i pi_i (len(w_i) + 1): bytes per state incl. separator
};

// Deterministic in (seed, n_bytes); a prefix of a longer corpus with the same seed.
Corpus generate_corpus(uint64_t seed, int64_t n_bytes);

}  // namespace keel
