// The Trainer's spike forensics (Note [replay] and Note [anomaly evidence] in forensics.h and
// forensics.cc): an anomalous step computed again and compared, and the evidence it leaves.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "launch/train/forensics.h"
#include "launch/train/trainer.h"

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
  // The same inputs: the guard's state before it saw the step (the learning rate's cool-down
  // and the skipped ranges are read from it), the same first sample, the same injections.
  const GuardState observed = state_->guard;
  const uint64_t next_sample = state_->sampler.next_sample;
  state_->guard = before;
  state_->sampler.next_sample = r.first_sample;
  const FaultInjector::Injection first_injection = injection_;
  StepResult again = compute_gradients(&first_injection);
  const StepPrint second{again.loss, again.grad_norm, local_print(again.local_stats, 3, g, 0, n)};
  state_->sampler.next_sample = next_sample;
  const ReplayVerdict v = compare_replay(topo_.world_comm, first, second, host_);
  if (v.same) {
    state_->guard = observed;
    r.replay = "same";
    keep_evidence(r, &again);
    return std::nullopt;
  }
  const std::string policy = config::HardwareFault_Name(cfg_.spike().on_hardware_fault());
  char figures[200];
  std::snprintf(figures, sizeof(figures), "loss %.9g then %.9g, gradient norm %.9g then %.9g",
                r.loss, again.loss, r.grad_norm, again.grad_norm);
  const std::string who = describe_ranks(v);
  r.replay = "different: " + who;
  keep_evidence(r, &again);
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

void Trainer::keep_evidence(const StepResult& r, const StepResult* replayed) {
  const int keep = cfg_.spike().keep_anomalies();
  if (opts_.run_dir.empty() || keep <= 0) return;
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
  for (double s : sq) e.grad_norm_layers.push_back(std::sqrt(s));
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

}  // namespace keel
