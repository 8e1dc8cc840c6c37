// Deterministic batches. The training stream is cut into W = floor((size - 1) / seq_len)
// non-overlapping windows (window w is the seq_len + 1 tokens from w * seq_len). Training sample s
// (a global index, counted over the whole run) is epoch e = s / W, position p = s % W, and reads
// window perm_{seed,e}(p), a seeded permutation of [0, W) that differs per epoch: each epoch reads
// every window exactly once. The order depends on (train.seed, s) alone, so the data a run sees
// does not depend on the number of ranks: a data-parallel rank fills its slice of a global batch
// with fill_samples(first + rank_offset, ...). Validation reads fixed, evenly spaced,
// non-overlapping windows of the validation stream. See Note [layout-independent data order].
#pragma once

#include <cstdint>
#include <string>

#include "framework/config/keel.pb.h"
#include "framework/data/dataset.h"
#include "framework/data/token_stream.h"

namespace keel {

// Note [layout-independent data order]: the sampler's whole state is the next global sample
// index. A checkpoint stores it; a rewind restores it; skipping bad data advances it. The
// window of sample s is a pure function of (seed, s, W): perm_{seed,e} is a Feistel network over
// the next power of two >= W, cycle-walked back into [0, W), so it is computed per sample in
// O(1) expected time without storing a shuffled index. Which rank or micro-batch asks for s
// changes nothing. (Changing seq_len or the training stream changes W, hence the order.)
struct SamplerState {
  uint64_t next_sample = 0;

  std::string serialize() const;  // decimal, e.g. "6400"
  // Inverse of serialize(); throws kData naming the text when it is not a decimal uint64.
  static SamplerState parse(const std::string& text);
  bool operator==(const SamplerState&) const = default;
};

class Sampler {
 public:
  // train: the training stream (>= seq_len + 1 tokens); val: the validation stream (may be
  // empty); seed: train.seed; eval_windows: validation windows one evaluation reads
  // (eval_batches x global_batch), spread evenly over val; 0 spreads over every window.
  Sampler(TokenStream train, TokenStream val, int32_t seq_len, uint64_t seed, int64_t eval_windows);
  // From a dataset and its validated config.
  Sampler(const Dataset& data, const config::KeelConfig& cfg);

  int32_t seq_len() const { return seq_len_; }
  const SamplerState& state() const { return state_; }
  void set_state(SamplerState state) { state_ = state; }
  void skip(uint64_t n_samples) { state_.next_sample += n_samples; }

  // inputs, targets: [n_seqs, seq_len]; samples state().next_sample ... + n_seqs - 1, then
  // advances the state by n_seqs. targets[i][t] = inputs[i][t + 1] of the same window.
  void next_batch(int64_t n_seqs, int32_t* inputs, int32_t* targets);
  // Stateless: inputs, targets [n, seq_len] = samples first_sample ... first_sample + n - 1.
  void fill_samples(uint64_t first_sample, int64_t n, int32_t* inputs, int32_t* targets) const;
  // Offset in the training stream of sample s's window: window_of(s) * seq_len.
  int64_t sample_offset(uint64_t sample) const;
  // Window index of sample s in [0, windows_per_epoch()): perm_{seed, epoch_of(s)}(s % W).
  int64_t window_of(uint64_t sample) const;
  // Epoch of sample s: s / W.
  uint64_t epoch_of(uint64_t sample) const { return sample / windows_; }
  // W: non-overlapping training windows, each read once per epoch.
  int64_t windows_per_epoch() const { return static_cast<int64_t>(windows_); }

  // Validation batch `batch_index` of n_seqs windows (windows batch_index * n_seqs + i, wrapping
  // around after the last). inputs, targets: [n_seqs, seq_len]. Needs a validation stream.
  void val_batch(int64_t batch_index, int64_t n_seqs, int32_t* inputs, int32_t* targets) const;
  // Stateless: validation windows first_window ... first_window + n - 1 (for a DP rank's slice).
  void fill_val(int64_t first_window, int64_t n, int32_t* inputs, int32_t* targets) const;
  // Offset in the validation stream of window w.
  int64_t val_offset(int64_t window) const;
  // Distinct validation windows before val_batch wraps around.
  int64_t val_windows() const { return val_distinct_; }

 private:
  TokenStream train_;
  TokenStream val_;
  int32_t seq_len_;
  uint64_t seed_;
  uint64_t windows_ = 0;      // W
  int perm_bits_ = 0;         // the Feistel domain is [0, 2^perm_bits_) >= W
  int64_t val_slots_ = 0;     // non-overlapping windows that fit in val_
  int64_t val_distinct_ = 0;  // of which evaluation uses this many, evenly spaced
  SamplerState state_;
};

}  // namespace keel
