// Generator of the built-in corpus (see corpus.h): lexicon, chain, stationary distribution,
// exact entropy rate, and the byte stream.
//
// Why the per-byte rate is h_w / E[L]: the chain over states X_1, X_2, ... has entropy rate
// h_w = sum_i pi_i H(P_i) nats per state. The byte stream is an invertible function of the state
// sequence: every state's string is distinct, has no separator inside it, and its capitalisation
// is a function of the previous state, so splitting at separators and lower-casing the first
// letter recovers the states. State i always takes L_i = len(w_i) + 1 bytes, so by the renewal
// reward theorem N bytes hold N / E[L] states (E[L] = sum_i pi_i L_i), and the entropy of N bytes
// is N h_w / E[L] + o(N): the rate is h_w / E[L] nats per byte.
#include "framework/data/corpus.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_set>

#include "framework/error.h"

namespace keel {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a tiny seeded generator, deterministic everywhere.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }  // [0, 1)
  uint64_t below(uint64_t n) { return next() % n; }  // n is tiny here: bias < 2^-50

 private:
  uint64_t state_;
};

struct Part {
  const char* text;
  int weight;
};

// Weights roughly follow English letter frequencies, so the text looks English and its byte
// unigram entropy is English-like (about 2.9 nats).
constexpr Part kOnsets[] = {{"", 14},  {"t", 9},  {"n", 6}, {"s", 7},  {"r", 5},  {"l", 5},
                            {"d", 5},  {"m", 4},  {"k", 2}, {"th", 6}, {"st", 2}, {"br", 1},
                            {"p", 3},  {"g", 2},  {"v", 2}, {"f", 3},  {"h", 5},  {"w", 4},
                            {"ch", 1}, {"sh", 2}, {"b", 3}, {"c", 3},  {"y", 1},  {"pl", 1},
                            {"tr", 1}, {"gr", 1}, {"wh", 1}};
constexpr Part kNuclei[] = {{"a", 8},  {"e", 11}, {"i", 7},  {"o", 7},  {"u", 3},
                            {"ea", 2}, {"ou", 2}, {"ai", 1}, {"ee", 1}, {"io", 1}};
constexpr Part kCodas[] = {{"", 16},  {"n", 6},  {"r", 5},  {"s", 5},  {"t", 4}, {"l", 3},
                           {"nd", 2}, {"st", 1}, {"m", 2},  {"ng", 2}, {"d", 3}, {"th", 1},
                           {"ck", 1}, {"x", 1},  {"ll", 1}, {"ve", 1}};

template <size_t N>
const char* pick(const Part (&parts)[N], SplitMix& rng) {
  int total = 0;
  for (const Part& p : parts) total += p.weight;
  int r = static_cast<int>(rng.below(static_cast<uint64_t>(total)));
  for (const Part& p : parts) {
    if (r < p.weight) return p.text;
    r -= p.weight;
  }
  return parts[N - 1].text;
}

constexpr int kWords = 300;         // base lexicon
constexpr int kSentenceFinal = 48;  // "word." states, of which the last kParagraphFinal
constexpr int kParagraphFinal = 6;  // are followed by '\n' instead of ' '
constexpr int kMinSuccessors = 3;
constexpr int kMaxSuccessors = 6;    // plus, at most, the cycle edge
constexpr double kFinalMass = 0.13;  // share of successor draws that end a sentence

struct State {
  std::string word;  // lowercase, with the '.' of a sentence-final state
  char separator;    // ' ' or '\n'
  bool final;        // ends a sentence: the next word is capitalised
  std::vector<int> next;
  std::vector<double> cumulative;  // cumulative successor probabilities; back() == 1
  std::vector<double> prob;
};

std::vector<State> build_chain(SplitMix& rng) {
  // Lexicon: unique words of 2-9 letters, sorted by length so frequent (low-rank) words are short.
  std::vector<std::string> words;
  std::unordered_set<std::string> seen;
  while (static_cast<int>(words.size()) < kWords) {
    const uint64_t r = rng.below(9);
    const int syllables = r < 3 ? 1 : (r < 7 ? 2 : 3);
    std::string w;
    for (int s = 0; s < syllables; ++s) {
      w += pick(kOnsets, rng);
      w += pick(kNuclei, rng);
      w += pick(kCodas, rng);
    }
    if (w.size() < 2 || w.size() > 9 || !seen.insert(w).second) continue;
    words.push_back(w);
  }
  std::stable_sort(words.begin(), words.end(),
                   [](const std::string& a, const std::string& b) { return a.size() < b.size(); });

  std::vector<State> states;
  for (const std::string& w : words) states.push_back({w, ' ', false, {}, {}, {}});
  for (int k = 0; k < kSentenceFinal; ++k) {
    // Sentence-final variants of distinct words spread over the ranks.
    const std::string& w = words[(k * 37 + 11) % kWords];
    const char separator = k >= kSentenceFinal - kParagraphFinal ? '\n' : ' ';
    states.push_back({w + ".", separator, true, {}, {}, {}});
  }
  const int n = static_cast<int>(states.size());

  // Popularity: Zipf over the base words' ranks; final states share kFinalMass equally.
  std::vector<double> popularity(n);
  double base_total = 0;
  for (int i = 0; i < kWords; ++i) base_total += popularity[i] = 1.0 / (i + 6.0);
  for (int i = 0; i < kWords; ++i) popularity[i] *= (1 - kFinalMass) / base_total;
  for (int i = kWords; i < n; ++i) popularity[i] = kFinalMass / kSentenceFinal;

  // A random Hamiltonian cycle through all states makes the chain irreducible; one shortcut
  // (order[0] -> order[2], a cycle of length n - 1 beside the one of length n) makes it aperiodic.
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  for (int i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  std::vector<int> cycle_next(n);
  for (int i = 0; i < n; ++i) cycle_next[order[i]] = order[(i + 1) % n];

  for (int i = 0; i < n; ++i) {
    State& s = states[i];
    const int m = kMinSuccessors + static_cast<int>(rng.below(kMaxSuccessors - kMinSuccessors + 1));
    while (static_cast<int>(s.next.size()) < m) {
      double u = rng.uniform();
      int j = 0;
      while (j < n - 1 && u >= popularity[j]) u -= popularity[j++];
      // A final state is never followed by another final state ("Foo. Bar." is fine, "foo. bar."
      // makes one-word sentences too common), and no state repeats itself.
      if (j == i || (s.final && states[j].final)) continue;
      if (std::find(s.next.begin(), s.next.end(), j) == s.next.end()) s.next.push_back(j);
    }
    for (int extra : {cycle_next[i], i == order[0] ? order[2] : -1}) {
      if (extra >= 0 && std::find(s.next.begin(), s.next.end(), extra) == s.next.end()) {
        s.next.push_back(extra);
      }
    }
    // Zipf-like successor probabilities p_k ~ 1 / (k + 1), in draw order.
    double total = 0;
    for (size_t k = 0; k < s.next.size(); ++k) total += 1.0 / (k + 1);
    double c = 0;
    for (size_t k = 0; k < s.next.size(); ++k) {
      s.prob.push_back(1.0 / (k + 1) / total);
      c += s.prob.back();
      s.cumulative.push_back(c);
    }
    s.cumulative.back() = 1.0;
  }
  return states;
}

// Stationary distribution by power iteration (the chain is irreducible and aperiodic).
std::vector<double> stationary(const std::vector<State>& states) {
  const size_t n = states.size();
  std::vector<double> pi(n, 1.0 / n), next(n);
  for (int iter = 0; iter < 100000; ++iter) {
    std::fill(next.begin(), next.end(), 0.0);
    for (size_t i = 0; i < n; ++i) {
      for (size_t k = 0; k < states[i].next.size(); ++k) {
        next[states[i].next[k]] += pi[i] * states[i].prob[k];
      }
    }
    double change = 0;
    for (size_t i = 0; i < n; ++i) change += std::abs(next[i] - pi[i]);
    pi.swap(next);
    if (change < 1e-15) break;
  }
  return pi;
}

}  // namespace

Corpus generate_corpus(uint64_t seed, int64_t n_bytes) {
  KEEL_CHECK(n_bytes > 0, kConfig, "data.builtin_bytes=", n_bytes, " must be > 0");
  SplitMix rng(seed ^ 0x6b65656c636f7270ull);  // "keelcorp": keeps streams apart from other uses
  const std::vector<State> states = build_chain(rng);
  const std::vector<double> pi = stationary(states);

  Corpus corpus{};
  for (size_t i = 0; i < states.size(); ++i) {
    double h = 0;
    for (double p : states[i].prob) h -= p * std::log(p);
    corpus.entropy_nats_per_word += pi[i] * h;
    corpus.mean_bytes_per_word += pi[i] * static_cast<double>(states[i].word.size() + 1);
  }
  corpus.entropy_rate_nats_per_byte = corpus.entropy_nats_per_word / corpus.mean_bytes_per_word;

  // The stream starts in a state drawn from pi, so it is stationary from its first byte.
  size_t state = 0;
  {
    double u = rng.uniform();
    while (state + 1 < states.size() && u >= pi[state]) u -= pi[state++];
  }
  std::vector<uint8_t>& out = corpus.bytes;
  out.resize(static_cast<size_t>(n_bytes));
  size_t at = 0;
  bool capital = true;
  while (at < out.size()) {
    const State& s = states[state];
    for (size_t k = 0; k <= s.word.size() && at < out.size(); ++k, ++at) {
      char c = k < s.word.size() ? s.word[k] : s.separator;
      if (k == 0 && capital) c = static_cast<char>(c - 'a' + 'A');
      out[at] = static_cast<uint8_t>(c);
    }
    capital = s.final;
    const double u = rng.uniform();
    size_t k = 0;
    while (k + 1 < s.next.size() && u >= s.cumulative[k]) ++k;
    state = static_cast<size_t>(s.next[k]);
  }

  double counts[256] = {};
  for (uint8_t b : out) counts[b] += 1;
  for (double c : counts) {
    if (c > 0) corpus.unigram_entropy_nats -= c / n_bytes * std::log(c / n_bytes);
  }
  return corpus;
}

}  // namespace keel
