// Sampler: per-epoch permuted, non-overlapping training windows and fixed validation windows
// (see header).
#include "framework/data/sampler.h"

#include <algorithm>
#include <charconv>
#include <utility>

#include "framework/error.h"

namespace keel {
namespace {

// splitmix64's finaliser: a bijective 64-bit mix with full avalanche.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr uint64_t kDataDomain = 0x64617461u;  // "data": apart from init's use of train.seed
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr int kFeistelRounds = 6;

// A bijection on [0, 2^bits): an unbalanced Feistel network. Each round splits x into hi (wh
// bits) and lo (wl bits) and maps it to (lo, hi ^ F(lo)), i.e. lo becomes the high part; the
// round is inverted by reading lo back and xoring F(lo) off again, so every round (and the
// network) is a permutation for any width, odd ones included.
uint64_t feistel(uint64_t x, int bits, uint64_t key) {
  int wh = bits / 2, wl = bits - wh;
  for (int round = 0; round < kFeistelRounds; ++round) {
    const uint64_t lo_mask = (uint64_t{1} << wl) - 1, hi_mask = (uint64_t{1} << wh) - 1;
    const uint64_t hi = x >> wl, lo = x & lo_mask;
    const uint64_t f = mix64(key + mix64(lo + static_cast<uint64_t>(round) * kGolden));
    x = (lo << wh) | ((hi ^ f) & hi_mask);
    std::swap(wh, wl);
  }
  return x;
}

}  // namespace

std::string SamplerState::serialize() const { return std::to_string(next_sample); }

SamplerState SamplerState::parse(const std::string& text) {
  SamplerState s;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, s.next_sample);
  KEEL_CHECK(ec == std::errc() && ptr == end && !text.empty(), kData, "sampler state '", text,
             "': expected a decimal sample index");
  return s;
}

Sampler::Sampler(TokenStream train, TokenStream val, int32_t seq_len, uint64_t seed,
                 int64_t eval_windows)
    : train_(std::move(train)), val_(std::move(val)), seq_len_(seq_len), seed_(seed) {
  KEEL_CHECK(seq_len > 0, kUsage, "Sampler: seq_len=", seq_len, " must be > 0");
  KEEL_CHECK(train_.size() >= seq_len + 1, kData, train_.describe(), ": holds ", train_.size(),
             " tokens, fewer than model.seq_len+1=", seq_len + 1);
  KEEL_CHECK(eval_windows >= 0, kUsage, "Sampler: eval_windows=", eval_windows, " must be >= 0");
  windows_ = static_cast<uint64_t>((train_.size() - 1) / seq_len);
  while ((uint64_t{1} << perm_bits_) < windows_) ++perm_bits_;
  val_slots_ = val_.empty() ? 0 : (val_.size() - 1) / seq_len;
  val_distinct_ = eval_windows > 0 ? std::min(eval_windows, val_slots_) : val_slots_;
}

Sampler::Sampler(const Dataset& data, const config::KeelConfig& cfg)
    : Sampler(data.train(), data.val(), cfg.model().seq_len(), cfg.train().seed(),
              static_cast<int64_t>(cfg.train().eval_batches()) * cfg.train().global_batch()) {}

int64_t Sampler::window_of(uint64_t sample) const {
  const uint64_t epoch = sample / windows_;
  uint64_t w = sample % windows_;
  const uint64_t key = mix64(mix64(seed_ ^ kDataDomain) + mix64(epoch + kGolden));
  // Cycle-walking: the domain is under 2 W, so this loops fewer than 2 times on average. It
  // ends because w lies on a cycle of the permutation that returns to the start (< W).
  do {
    w = feistel(w, perm_bits_, key);
  } while (w >= windows_);
  return static_cast<int64_t>(w);
}

int64_t Sampler::sample_offset(uint64_t sample) const { return window_of(sample) * seq_len_; }

void Sampler::fill_samples(uint64_t first_sample, int64_t n, int32_t* inputs,
                           int32_t* targets) const {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t offset = sample_offset(first_sample + static_cast<uint64_t>(i));
    train_.copy(offset, seq_len_, inputs + i * seq_len_);
    train_.copy(offset + 1, seq_len_, targets + i * seq_len_);
  }
}

void Sampler::next_batch(int64_t n_seqs, int32_t* inputs, int32_t* targets) {
  fill_samples(state_.next_sample, n_seqs, inputs, targets);
  state_.next_sample += static_cast<uint64_t>(n_seqs);
}

int64_t Sampler::val_offset(int64_t window) const {
  KEEL_CHECK(val_distinct_ > 0, kUsage, "no validation split (", val_.describe(), ")");
  const int64_t k = window % val_distinct_;
  // Slot floor(k * slots / distinct): evenly spaced over the stream, distinct, non-overlapping.
  const int64_t slot =
      static_cast<int64_t>((static_cast<__int128>(k) * val_slots_) / val_distinct_);
  return slot * seq_len_;
}

void Sampler::fill_val(int64_t first_window, int64_t n, int32_t* inputs, int32_t* targets) const {
  KEEL_ASSERT(first_window >= 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t offset = val_offset(first_window + i);
    val_.copy(offset, seq_len_, inputs + i * seq_len_);
    val_.copy(offset + 1, seq_len_, targets + i * seq_len_);
  }
}

void Sampler::val_batch(int64_t batch_index, int64_t n_seqs, int32_t* inputs,
                        int32_t* targets) const {
  fill_val(batch_index * n_seqs, n_seqs, inputs, targets);
}

}  // namespace keel
