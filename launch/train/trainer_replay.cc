// The Trainer's spike forensics (Note [replay] and Note [anomaly evidence] in forensics.h and
// forensics.cc): an anomalous step computed again and compared, and the evidence it leaves.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "launch/train/forensics.h"
#include "launch/train/trainer.h"
#include "parallel/agree.h"

namespace keel {

const Tensor& Trainer::held_grads(int64_t* n) const {
  const ZeroPartition& part = state_->partition();
  if (part.sharded()) {
    *n = part.mine().n;
    return shard_grads_;
  }
  *n = model_->params().grads().numel();
  return model_->params().grads();
}

std::optional<Verdict> Trainer::replay(StepResult& r, const GuardState& before) {
  if (host_.empty()) host_ = host_name();
  int64_t n = 0;
  const Tensor& g = held_grads(&n);
  const StepPrint first{r.loss, r.grad_norm, local_print(r.local_stats, 3, g, 0, n)};
  // The first computation's per-block gradient norms, for the evidence (the replay overwrites
  // the gradients).
  const std::vector<double> norms = keeps_evidence() ? layer_grad_norms() : std::vector<double>{};
  // The same inputs: the guard's state before it saw the step (the learning rate's cool-down
  // and the skipped ranges are read from it), the same first sample, the same injections.
  const GuardState observed = state_->guard;
  const uint64_t next_sample = state_->sampler.next_sample;
  state_->guard = before;
  state_->sampler.next_sample = r.first_sample;
  const FaultInjector::Injection first_injection = injection_;
  // The replay also records each block's activation norm, for the evidence.
  model_->set_record_activation_norms(keeps_evidence());
  StepResult again = compute_gradients(&first_injection);
  model_->set_record_activation_norms(false);
  const StepPrint second{again.loss, again.grad_norm, local_print(again.local_stats, 3, g, 0, n)};
  state_->sampler.next_sample = next_sample;
  const ReplayVerdict v = compare_replay(topo_.world_comm, first, second, host_);
  if (v.same) {
    state_->guard = observed;
    r.replay = "same";
    // A healthy step replayed by spike.replay_every leaves no evidence.
    if (r.guard.anomaly != Anomaly::kNone) keep_evidence(r, &again, norms);
    return std::nullopt;
  }
  const std::string policy = config::HardwareFault_Name(cfg_.spike().on_hardware_fault());
  char figures[200];
  std::snprintf(figures, sizeof(figures), "loss %.9g then %.9g, gradient norm %.9g then %.9g",
                r.loss, again.loss, r.grad_norm, again.grad_norm);
  const std::string who = describe_ranks(v);
  r.replay = "different: " + who;
  keep_evidence(r, &again, norms);
  const bool stop = cfg_.spike().on_hardware_fault() == config::STOP;
  const std::string message =
      "step " + std::to_string(state_->step + 1) + " computed differently on a replay of the " +
      "same batch from the same parameters (" + figures + "; changed: " + who +
      "): suspected hardware fault; spike.on_hardware_fault=" + policy +
      (stop ? ": the state is saved without the step's update and the run stops (exit 4); "
              "resume it on other nodes"
            : ": the replayed result is used");
  StepResult shown = r;
  shown.step = state_->step + 1;
  report(shown, "nondeterministic_step", stop ? "halt" : "none", "", -1, message);
  if (stop) return Verdict{StepDecision::kHardwareStop, message};
  // CONTINUE: the replay stands in for the first computation; the guard judges it afresh.
  const uint64_t first_sample = r.first_sample;
  const std::string verdict = r.replay;
  r = again;
  r.first_sample = first_sample;
  r.replay = verdict;
  r.guard = guard_.observe(state_->guard, state_->step + 1, r.first_sample, r.loss, r.grad_norm);
  return std::nullopt;
}

std::vector<double> Trainer::layer_grad_norms() const {
  // Each block's gradient norm (and everything outside the blocks last), counted once over TP
  // as the global norm is: collective, alike on every rank.
  const int L = model_->dims().L;
  std::vector<double> sq(static_cast<size_t>(L) + 1, 0.0);
  int64_t n = 0;
  const Tensor& g = held_grads(&n);
  const ZeroPartition& part = state_->partition();
  std::vector<float> buf;
  for (const StateParam& p : state_->tensors()) {
    if (!p.info->sharded() && topo_.tp_rank != 0) continue;
    if (p.moments.empty()) continue;
    buf.resize(static_cast<size_t>(p.moments.n));
    g.copy_to_host(p.moments.offset - part.mine().offset, p.moments.n, buf.data());
    double s = 0.0;
    for (float x : buf) s += static_cast<double>(x) * x;
    int layer = L;
    const std::string& name = p.info->spec.name;
    if (name.rfind("blocks.", 0) == 0) layer = std::stoi(name.substr(7));
    sq[static_cast<size_t>(layer)] += s;
  }
  Communicator* comm = part.sharded() ? topo_.world_comm : topo_.tp_comm;
  if (comm) comm->all_reduce(sq.data(), static_cast<int64_t>(sq.size()), ReduceOp::kSum);
  for (double& v : sq) v = std::sqrt(v);
  return sq;
}

bool Trainer::keeps_evidence() const {
  return !opts_.run_dir.empty() && cfg_.spike().keep_anomalies() > 0;
}

void Trainer::keep_evidence(const StepResult& r, const StepResult* replayed,
                            const std::vector<double>& grad_norm_layers) {
  if (!keeps_evidence()) return;
  const int keep = cfg_.spike().keep_anomalies();
  // Each block's output norm over the global batch, from the replay: the ranks' sums of squares
  // summed over the world, where the TP ranks of a replica hold the same rows unless the stream
  // is split over them (sequence parallelism). Collective, alike on every rank.
  std::vector<double> act;
  if (replayed && !replayed->act_sq_layers.empty()) {
    act = replayed->act_sq_layers;
    if (topo_.world_comm) {
      topo_.world_comm->all_reduce(act.data(), static_cast<int64_t>(act.size()), ReduceOp::kSum);
    }
    const double copies = model_->dims().sp ? 1.0 : static_cast<double>(topo_.tp);
    for (double& v : act) v = std::sqrt(v / copies);
  }
  if (topo_.world_rank != 0) return;
  AnomalyEvidence e;
  e.step = state_->step + 1;
  e.kind = anomaly_name(r.guard.anomaly);
  e.verdict = r.replay.empty() ? "not replayed" : r.replay.substr(0, r.replay.find(':'));
  if (r.replay.rfind("different: ", 0) == 0) e.ranks = r.replay.substr(11);
  e.loss = r.loss;
  e.grad_norm = r.grad_norm;
  e.replay_loss = replayed ? replayed->loss : std::nan("");
  e.replay_grad_norm = replayed ? replayed->grad_norm : std::nan("");
  e.z_loss = r.z_loss;
  e.log_z = r.log_z;
  e.max_attn_logit_layers = r.max_attn_logit_layers;
  e.grad_norm_layers = grad_norm_layers;
  e.act_norm_layers = act;
  e.first_sample = r.first_sample;
  const int64_t batch = cfg_.train().global_batch();
  e.seq_len = sampler_.seq_len();
  e.tokens.resize(static_cast<size_t>(batch * e.seq_len));
  std::vector<int32_t> targets(e.tokens.size());
  sampler_.fill_samples(r.first_sample, batch, e.tokens.data(), targets.data());
  for (int64_t i = 0; i < batch; ++i) {
    e.sample_offsets.push_back(
        static_cast<uint64_t>(sampler_.sample_offset(r.first_sample + static_cast<uint64_t>(i))));
  }
  write_anomaly(opts_.run_dir + "/anomalies", e, keep);
}

// Note [replica check]
// ~~~~~~~~~~~~~~~~~~~~
// DP replicas hold the same parameters by construction: the same initial values, the same
// all-reduced (or all-gathered) updates. A corrupted word on one replica's device need not cause
// a spike, and without ZeRO-1 nothing ever overwrites it: the replicas drift apart, and the
// checkpoint keeps DP rank 0's. So before each periodic save (spike.check_replicas, on by default)
// every rank hashes the parameters it holds (XXH3) and the ranks compare each replica with DP
// rank 0 of the same TP rank. A mismatch is a suspected hardware fault: an alert
// replica_mismatch names the ranks and hosts that differ from DP rank 0, and
// spike.on_hardware_fault decides: CONTINUE copies DP rank 0's parameters to its replicas (the
// reference is DP rank 0 by convention: with two replicas nothing tells which one is wrong) and
// saves; STOP stops without saving (exit 4), the previous checkpoint being the last one known
// good. The cost is one hash of the parameters and one small all-gather per save.
bool Trainer::check_replicas() {
  if (!cfg_.spike().check_replicas() || topo_.dp < 2 || !topo_.world_comm) return true;
  if (host_.empty()) host_ = host_name();
  const Tensor& params = model_->params().params();
  const uint64_t h = local_print(nullptr, 0, params, 0, params.numel());
  const std::vector<int64_t> mine = {static_cast<int64_t>(h), topo_.dp_rank, topo_.tp_rank};
  const std::vector<int64_t> table = every_rank(topo_.world_comm, mine);
  const int world = topo_.world_size;
  std::vector<int64_t> reference(static_cast<size_t>(topo_.tp), 0);
  for (int r = 0; r < world; ++r) {
    if (table[3 * r + 1] == 0) reference[static_cast<size_t>(table[3 * r + 2])] = table[3 * r];
  }
  const int me = topo_.world_rank;
  bool any = false;
  for (int r = 0; r < world; ++r) {
    any = any || table[3 * r] != reference[static_cast<size_t>(table[3 * r + 2])];
  }
  if (!any) return true;
  const ReplayVerdict v = name_ranks(
      topo_.world_comm, table[3 * me] != reference[static_cast<size_t>(topo_.tp_rank)], host_);
  const bool stop = cfg_.spike().on_hardware_fault() == config::STOP;
  const std::string message =
      "DP replicas differ at step " + std::to_string(state_->step) + ": " + describe_ranks(v) +
      " hold parameters unlike DP rank 0's of the same TP rank: suspected hardware fault; "
      "spike.on_hardware_fault=" +
      config::HardwareFault_Name(cfg_.spike().on_hardware_fault()) +
      (stop ? ": the run stops without saving (exit 4); the previous checkpoint is the last one "
              "known good"
            : ": DP rank 0's parameters are copied to its replicas and the checkpoint is saved");
  StepResult shown = last_;
  shown.step = state_->step;
  report(shown, "replica_mismatch", stop ? "halt" : "repair", "", -1, message);
  if (stop) {
    halted_ = true;
    hardware_stop_ = true;
    return false;
  }
  // DP rank 0's parameters to every replica, staged through the host.
  std::vector<float> buf(static_cast<size_t>(params.numel()));
  params.copy_to_host(0, params.numel(), buf.data());
  topo_.dp_comm->broadcast_bytes(buf.data(), static_cast<int64_t>(buf.size() * sizeof(float)), 0);
  params.copy_from_host(0, params.numel(), buf.data());
  return true;
}

}  // namespace keel
