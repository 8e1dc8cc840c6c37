// A training step's H200 roofline estimate from the emulator's measured records (roofline.h), for
// the GPU benchmark's --estimate mode (tests/gpu/train_bench.cc). The emulator cannot run the
// 124M shapes at 16 x 1024 tokens in reasonable time, so the benchmark runs them at their real
// widths on fewer layers and tokens, and this scales what it measured:
//  - tokens: two runs of the same depth at N_a < N_b tokens (one sequence each, lengths T_a, T_b),
//    their tasks matched in order within each kernel name; each task's bytes and matmul flops are
//    taken as linear in the tokens (a + b N) and extrapolated to N, its attention flops (B T^2)
//    scaled from the larger run by N T / (N_b T_b); then each task is priced (roofline::seconds);
//  - layers: the priced entries of a 1-layer and a 2-layer run, E(L) = E(1) + (L - 1)(E(2) - E(1)),
//    per kernel name and per field.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/cuda_emu/roofline.h"

namespace keel_emu::estimate {

// One kernel (or library call, or Label) summed over a step.
struct Entry {
  std::string name;
  double launches = 0, bytes_read = 0, bytes_written = 0, flops = 0, seconds = 0;
  bool whole = false;  // scaled whole: launched a different number of times at the two counts
};

// Run a's and run b's records (N_a < N_b tokens, T_b the longer run's sequence) scaled to N tokens
// at sequence length T, each priced, summed by name. Tasks are matched in order within their name;
// a name launched a different number of times in the two runs (a kernel whose launches depend on
// the rows) is scaled whole (its bytes and flops summed per run), with the larger run's launches.
// Throws std::runtime_error when a name ran in one run only.
std::vector<Entry> scale_tokens(const std::vector<roofline::Record>& a,
                                const std::vector<roofline::Record>& b, double n_a, double n_b,
                                double t_b, double n, double t);

// one + (layers - 1) * (two - one), per name and field, clamped at zero.
std::vector<Entry> scale_layers(const std::vector<Entry>& one, const std::vector<Entry>& two,
                                int layers);

// The table, largest time first: name, launches, MB read, MB written, GFLOP, ms, share; then the
// totals. Returns the total seconds.
double print_table(const std::vector<Entry>& entries, FILE* out);

}  // namespace keel_emu::estimate
