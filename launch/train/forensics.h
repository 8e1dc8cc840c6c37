// Spike forensics: replaying an anomalous step to tell a faulty machine from a bad batch
// (Note [replay]), and the evidence kept for every anomaly (RUN/anomalies/step_N/).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/tensor.h"
#include "parallel/communicator.h"

namespace keel {

// Note [replay]
// ~~~~~~~~~~~~~
// A loss spike or a non-finite value has two kinds of cause: the data and the optimisation, which
// a rewind and skipping data cure, and the hardware (a silent data corruption on one GPU, a
// flaky link), which they only hide. keel tells them apart cheaply because a step is bitwise
// reproducible and the spike guard decides before the update is applied: when the guard sees an
// anomaly (and spike.replay is on, the default), the trainer computes the same step again from
// the same parameters on the same batch and compares, bit for bit on every rank, the all-reduced
// loss and gradient norm and a fingerprint of the rank's own figures (its loss partials before
// the all-reduce and the gradients it holds).
//   - identical: the anomaly is in the data or the optimisation; the guard acts as before.
//   - different: some rank computed differently from itself. The ranks whose own fingerprint
//     changed, with their hosts, are named in a `nondeterministic_step` alert, and
//     spike.on_hardware_fault decides: CONTINUE (the default) takes the replayed result in place
//     of the first one (if the replay is itself anomalous, the guard acts on it as usual); STOP
//     saves the state (the update was not applied) and exits 4, so the scheduler can drain the
//     node and the run resumes elsewhere.
// The cost is one extra step per anomaly. Bit-for-bit equality is the right test where every
// kernel is deterministic: the CPU backend, and the CUDA backend with cuDNN's deterministic
// attention backward (keel asks for it). A backend that is not deterministic would need a
// tolerance instead; keel has none today.
// debug.inject_bitflip_at_step (debug.inject_bitflip_rank, default 0) tests it: on that rank, on
// the first computation of the step only, bit 30 (the exponent's top bit) of the first non-zero
// gradient element the rank holds is flipped after the gradient sync, as a corrupted memory
// word would be. The replay does not flip it, so the verdict is "different", naming that rank.

// What one computation of a step produced, as one rank sees it.
struct StepPrint {
  double loss = 0.0, grad_norm = 0.0;  // all-reduced: alike on every rank
  uint64_t local = 0;                  // local_print() of the rank's own figures
};

// XXH3-64 over `n_stats` loss partials and elements [offset, offset + n) of `grads` (fp32; copied
// to the host first when it lives on a device).
uint64_t local_print(const double* stats, int n_stats, const Tensor& grads, int64_t offset,
                     int64_t n);

struct ReplayVerdict {
  bool same = true;
  std::vector<int> ranks;          // the world ranks whose own fingerprint changed
  std::vector<std::string> hosts;  // their hosts, in the same order
};

// Collective over `world` (null: one process): every rank's flag `mine` and host name gathered;
// the ranks that raised it, with their hosts, alike on every rank (same: none did).
ReplayVerdict name_ranks(Communicator* world, bool mine, const std::string& host);

// Collective over `world` (null: one process): name_ranks() of the ranks whose own fingerprint
// changed; `same` also needs the all-reduced loss and gradient norm unchanged.
ReplayVerdict compare_replay(Communicator* world, const StepPrint& first, const StepPrint& replay,
                             const std::string& host);

// debug.inject_*bitflip*: flips bit `bit` of the first non-zero element of [offset, offset + n)
// of fp32 `t` (or of element `offset` when all are zero). Returns the element's index.
int64_t flip_bit(const Tensor& t, int64_t offset, int64_t n, int bit);

// This machine's host name ("an unknown host" when it has none).
std::string host_name();

// "rank 1 (host a)", "ranks 0 (host a), 3 (host b)".
std::string describe_ranks(const ReplayVerdict& v);

// The evidence of one anomaly, written by rank 0 into RUN/anomalies/step_N/ (Note [anomaly
// evidence] in forensics.cc).
struct AnomalyEvidence {
  int64_t step = 0;
  std::string kind;     // the guard's anomaly: loss_spike, grad_spike, nonfinite_loss, ...
  std::string verdict;  // "same" (data or optimisation) or "different" (suspected hardware)
  std::string ranks;    // describe_ranks() when different
  double loss = 0.0, grad_norm = 0.0, replay_loss = 0.0, replay_grad_norm = 0.0;
  double z_loss = 0.0, log_z = 0.0;
  std::vector<float> max_attn_logit_layers;  // [n_layers]
  std::vector<double> grad_norm_layers;      // [n_layers + 1]: blocks, then everything else
  std::vector<double> act_norm_layers;       // [n_layers] each block's output norm (replay's)
  uint64_t first_sample = 0;
  std::vector<uint64_t> sample_offsets;  // each sample's window offset in the training stream
  int32_t seq_len = 0;
  std::vector<int32_t> tokens;  // [global_batch, seq_len] input token ids
};

// Writes `e` into `anomalies_dir`/step_N/ (summary.json, tokens.bin), then removes the oldest
// step directories past `keep` (0: keep none, write nothing). Never throws for I/O: evidence is
// best effort, and a failure is one line on stderr.
void write_anomaly(const std::string& anomalies_dir, const AnomalyEvidence& e, int keep);

// Appends one alert line (alert_json) to RUN/anomalies/step_N/alerts.jsonl when that directory
// exists.
void append_anomaly_alert(const std::string& anomalies_dir, int64_t step, const std::string& json);

}  // namespace keel
