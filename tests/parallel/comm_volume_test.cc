// Communication volume: the bytes every communicator of the topology moves in one training step
// equal, exactly, the analytic formula below (derived from layers/gpt.cc, layers/attention.cc,
// layers/mlp.cc, launch/train/trainer.cc and parallel/grad_sync.cc). Bytes are payload bytes as
// Communicator::bytes_moved counts them: n * 4 for an all-reduce of n floats (8 per double),
// size * n * 4 for an all-gather or reduce-scatter of n floats per rank (the whole buffer), 0 in a
// group of one.
//
// Notation: B micro-batch sequences, T seq_len, C d_model, L layers, D head_dim, A micro-batches
// per step (global_batch / dp / B), BT = B T tokens. PROJ = 1 when the QK-norm scope is
// PROJECTION and qk_norm is not NONE, else 0.
//
// Tensor parallel group (tp > 1), per micro-batch:
//   forward   (1 + 2L) x BT C floats  embedding output, then attention and MLP row-parallel outputs
//             3 x BT floats           vocab-parallel loss: row max (MAX), sum-exp, target logit
//             PROJ x 2L x 2 BT floats QK-norm statistics of q and k ([BT, 2] each) per layer
//   backward  (1 + 2L) x BT C floats  LM-head input gradient, then MLP and attention input grads
//             PROJ x 2L x 2 BT floats QK-norm backward partials of q and k per layer
// per step:
//   G floats of gains replicated over TP whose gradient is a TP partial sum, one call each:
//     RMS   HEAD_SHARED: 2L tensors of D (q, k gains)     LAYER HEAD_SHARED: 4L of D (+ biases;
//     2L of D with model.bias = false, which drops them)
//     L2 HEAD_SHARED or PROJECTION: L tensors of 1 (the logit scale)    otherwise: none
//   + 8 bytes (one double: the squared gradient norm), when zero_stage = 0.
//   TP bytes = A [w (2 + 4L) BT C + 4 (3 BT + PROJ 8 L BT)] + 4 G + 8 [zero_stage = 0]
//   where w = 4, or 2 with parallel.tp_comm_dtype=BF16 (Note [bf16 wire]: the (2 + 4L) BT C
//   activation and gradient all-reduces move bf16; the statistics and gains stay fp32)
//   TP calls = A [(5 + 4L) + PROJ 4L] + (tensors in G) + [zero_stage = 0]
//   With train.recompute_layers = N, R = max(N - 1, 0) block forwards run again in backward
//   (Note [recompute] in layers/gpt.h), repeating their collectives: (2 + 4L) becomes
//   (2 + 4L + 2R), PROJ 8 L BT becomes PROJ (8L + 4R) BT, and the calls grow by A (2R + PROJ 2R).
//   With parallel.sequence_parallel (Note [sequence parallel] in layers/gpt.h) all-gathers and
//   reduce-scatters of the whole [BT, C] replace the activation all-reduces: (2 + 4L + 2R) becomes
//   (4 + 10L + 4R) (fp32 always), and each micro-batch adds one all-reduce per block and final
//   norm of its weight (and bias) gradient: 4 (2L + 1) NB C bytes, NB = 2 for LAYERNORM with
//   model.bias, else 1; TP calls = A [(8 + 12L + 4R) + PROJ (4L + 2R)] + (tensors in G) + [zero 0].
//
// Data parallel group (dp > 1), per step:
//   zero_stage 0: each gradient bucket all-reduced once. A bucket is a run of consecutive
//     parameters, taken in backward order (last registered first), closed when its arena extent
//     reaches parallel.bucket_mb; its extent runs from its first parameter's offset to its last
//     one's end, so it includes the alignment padding inside it (every tensor starts at a multiple
//     of 16 floats) but not that between buckets or the arena's tail.
//     With one bucket: DP bytes = 4 x (arena offset of the last parameter + its size).
//   zero_stage 1: reduce-scatter of the whole arena + all-gather of the whole arena:
//     DP bytes = 2 x 4 x total_elems (the arena padded to a multiple of 16 dp floats), 2 calls.
//
// World group (world > 1), per step: 24 bytes (cross-entropy, z-loss and log Z sums, three
//   doubles) + 4L (each layer's max attention logit) + 8 when zero_stage = 1 (the squared gradient
//   norm over TP and DP shards together) + 16 when dp > 1 without ZeRO-1 (the largest replica's
//   squared norm and a non-finite flag, so a corrupted replica cannot decide differently: Note
//   [replay] in launch/train/forensics.h).
//
// The modern blocks add no TP term: RoPE rotates whole heads on their rank; the gated MLP's gate
// and up projections are both column-parallel from the same input, so their input gradients add
// up locally before the one backward all-reduce; POST_SUBLAYER norms act on the all-reduced
// sublayer output, replicated, so their gradients are whole on every rank. Their parameters
// (no wpe under RoPE, no biases with model.bias = false, the gate) change the arena, hence the DP
// bytes, which follow from the parameter list.
//
// Every layout that fits the world size runs; the step measured is the second (after a warm-up
// step and reset_counters()), and the first is checked too. The parameter count of every rank is
// derived from the model dimensions, not read from the model, and checked against the model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "launch/train/trainer.h"
#include "layers/params.h"
#include "parallel/communicator.h"
#include "parallel/topology.h"
#include "tests/parallel/parallel_test_util.h"

namespace keel {
namespace {

using testing::BlockKind;
using testing::kDff;
using testing::kDModel;
using testing::kGlobalBatch;
using testing::kHeads;
using testing::kLayers;
using testing::kSeqLen;
using testing::kVocab;
using testing::mpi_env;
using testing::QkMode;
using testing::tiny_config;
using testing::TinyJob;
using testing::world_size;

struct Case {
  int tp = 1, dp = 1;
  QkMode qk;
  int zero_stage = 0;
  int micro_batch = 0;
  bool tied = true;
  double bucket_mb = 25;   // 25: one bucket for the tiny model
  BlockKind block{};       // the GPT-2 block unless set
  bool bf16_wire = false;  // parallel.tp_comm_dtype=BF16
  int recompute = 0;       // train.recompute_layers
  bool sp = false;         // parallel.sequence_parallel

  std::string name() const {
    std::string s = "TP" + std::to_string(tp) + "xDP" + std::to_string(dp);
    if (zero_stage) s += "_ZeRO1";
    s += "_" + qk.name();
    if (qk.norm == config::NONE && qk.scope == config::PROJECTION) s += "_PROJECTION";
    if (micro_batch) s += "_mb" + std::to_string(micro_batch);
    if (!tied) s += "_untied";
    if (bucket_mb < 1) s += "_small_buckets";
    if (!block.tag.empty()) s += "_" + block.tag;
    if (bf16_wire) s += "_bf16_wire";
    if (recompute) s += "_recompute" + std::to_string(recompute);
    if (sp) s += "_sp";
    return s;
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  const QkMode rms_shared{config::RMS, config::HEAD_SHARED};
  out.push_back({1, 1, rms_shared, 0, 4});
  for (int tp : {2, 4}) {
    const std::vector<QkMode> modes = testing::all_qk_modes();
    for (size_t i = 0; i < modes.size(); ++i) {
      out.push_back({tp, 1, modes[i], 0, i % 2 == 1 ? 2 : 0, i % 3 != 2});
    }
    // NONE ignores the scope: no statistics are reduced.
    out.push_back({tp, 1, {config::NONE, config::PROJECTION}});
  }
  for (int dp : {2, 4}) {
    out.push_back({1, dp, rms_shared, 0, 0});
    out.push_back({1, dp, {config::L2, config::HEAD}, 0, 1, false});
    out.push_back({1, dp, rms_shared, 0, 0, true, 0.01});  // 2621-float buckets
    // Per-head L2 scales (Hl floats, padded to 16) put alignment gaps between buckets.
    out.push_back({1, dp, {config::L2, config::HEAD}, 0, 0, true, 0.002});
    out.push_back({1, dp, rms_shared, 1, 0});
    out.push_back({1, dp, {config::LAYER, config::PROJECTION}, 1, 1, false});
  }
  out.push_back({2, 2, rms_shared, 0, 0});
  out.push_back({2, 2, {config::LAYER, config::HEAD_SHARED}, 0, 2, false, 0.01});
  out.push_back({2, 2, {config::RMS, config::PROJECTION}, 1, 2});
  out.push_back({2, 2, {config::L2, config::HEAD_SHARED}, 1, 0, false});
  out.push_back({2, 2, {config::LAYER, config::HEAD_SHARED}, 1, 0});

  // Modern blocks: every QK-norm mode and scope under TP = 2 and 4, alternating the OLMo 2 block
  // (no biases: LAYER HEAD_SHARED reduces only its gains) and RoPE + GEGLU with biases, shifted
  // per tp so that each mode meets both.
  const BlockKind modern[] = {testing::olmo2_block(), testing::rope_geglu_bias_block()};
  for (int tp : {2, 4}) {
    const std::vector<QkMode> modes = testing::all_qk_modes();
    for (size_t i = 0; i < modes.size(); ++i) {
      Case c{tp, 1, modes[i], 0, i % 2 == 0 ? 2 : 0, i % 3 != 1};
      c.block = modern[(i + static_cast<size_t>(tp / 2)) % 2];
      out.push_back(c);
    }
  }
  // Data parallel and TP x DP, plain (one bucket and small buckets) and ZeRO-1, with the OLMo 2
  // and Qwen3 configurations and GEGLU with biases.
  const QkMode rms_projection{config::RMS, config::PROJECTION};
  for (int dp : {2, 4}) {
    Case olmo{1, dp, rms_projection, 0, 0, false};
    olmo.block = testing::olmo2_block();
    out.push_back(olmo);
    Case olmo_small{1, dp, rms_projection, 0, 0, false, 0.002};
    olmo_small.block = testing::olmo2_block();
    out.push_back(olmo_small);
    Case qwen{1, dp, rms_shared, 1, 0};
    qwen.block = testing::qwen3_block();
    out.push_back(qwen);
    Case geglu{1, dp, {config::LAYER, config::HEAD}, 0, 1, true, 0.01};
    geglu.block = testing::rope_geglu_bias_block();
    out.push_back(geglu);
  }
  Case olmo22{2, 2, rms_projection, 0, 2, false};
  olmo22.block = testing::olmo2_block();
  out.push_back(olmo22);
  Case qwen22{2, 2, rms_shared, 1, 0};
  qwen22.block = testing::qwen3_block();
  out.push_back(qwen22);
  Case geglu22{2, 2, {config::LAYER, config::HEAD_SHARED}, 0, 0, false, 0.01};
  geglu22.block = testing::rope_geglu_bias_block();
  out.push_back(geglu22);
  Case geglu22z{2, 2, {config::L2, config::PROJECTION}, 1, 2};
  geglu22z.block = testing::rope_geglu_bias_block();
  out.push_back(geglu22z);
  // bf16 on the TP wire: TP 2 and 4, TP x DP with ZeRO-1, the OLMo 2 block with its projection
  // statistics (which stay fp32); a DP layout, which has no TP all-reduce to change.
  for (int tp : {2, 4}) {
    Case c{tp, 1, rms_shared, 0, 2};
    c.bf16_wire = true;
    out.push_back(c);
    Case olmo{tp, 1, rms_projection, 0, 0, false};
    olmo.block = testing::olmo2_block();
    olmo.bf16_wire = true;
    out.push_back(olmo);
  }
  Case wire22{2, 2, {config::L2, config::PROJECTION}, 1, 2};
  wire22.bf16_wire = true;
  out.push_back(wire22);
  Case wire_dp{1, 2, rms_shared, 0, 0};
  wire_dp.bf16_wire = true;
  out.push_back(wire_dp);
  // Activation recomputation repeats the recomputed blocks' forward collectives: every block with
  // PROJECTION statistics at TP2 x DP2 (2 micro-batches), some blocks of the OLMo 2 block on the
  // bf16 wire, and a DP layout (no TP collectives to repeat; DP unchanged).
  Case rc22{2, 2, {config::RMS, config::PROJECTION}, 0, 2};
  rc22.recompute = kLayers;
  out.push_back(rc22);
  Case rc_olmo{2, 1, rms_projection, 1, 0, false};
  rc_olmo.block = testing::olmo2_block();
  rc_olmo.bf16_wire = true;
  rc_olmo.recompute = kLayers;
  out.push_back(rc_olmo);
  Case rc_dp{1, 2, rms_shared, 0, 0};
  rc_dp.recompute = kLayers;
  out.push_back(rc_dp);
  // Sequence parallelism: LayerNorm with biases (2C per norm gradient) with accumulation, the
  // OLMo 2 block (RMSNorm, post-sublayer) at TP4, TP x DP with ZeRO-1 and recomputation, and a
  // DP layout, where it changes nothing.
  Case sp2{2, 1, {config::LAYER, config::HEAD_SHARED}, 0, 2};
  sp2.sp = true;
  out.push_back(sp2);
  Case sp4{4, 1, rms_projection, 0, 0, false};
  sp4.block = testing::olmo2_block();
  sp4.sp = true;
  out.push_back(sp4);
  Case sp22{2, 2, rms_projection, 1, 2};
  sp22.block = testing::rope_geglu_bias_block();
  sp22.recompute = kLayers;
  sp22.sp = true;
  out.push_back(sp22);
  Case sp_olmo_rc{2, 1, rms_projection, 0, 0, false};
  sp_olmo_rc.block = testing::olmo2_block();
  sp_olmo_rc.recompute = kLayers;
  sp_olmo_rc.sp = true;
  out.push_back(sp_olmo_rc);
  Case sp_dp{1, 2, rms_shared, 0, 0};
  sp_dp.sp = true;
  out.push_back(sp_dp);
  return out;
}

// Local (this TP rank's) parameter sizes in registration order, from the dimensions alone.
std::vector<std::pair<std::string, int64_t>> local_params(const Case& c) {
  const int64_t tp = c.tp, C = kDModel, D = kDModel / kHeads, Hl = kHeads / tp, Fl = kDff / tp;
  const int64_t Vp = tp == 1 ? kVocab : (kVocab + 64 * tp - 1) / (64 * tp) * (64 * tp);
  const int64_t Vl = Vp / tp;
  const bool bias = c.block.bias;
  const bool ln_bias = c.block.norm == config::LAYERNORM && bias;
  const bool gated = c.block.mlp != config::GELU;
  std::vector<std::pair<std::string, int64_t>> p = {{"wte", Vl * C}};
  if (c.block.position == config::LEARNED) p.push_back({"wpe", kSeqLen * C});
  const bool shared = c.qk.scope == config::HEAD_SHARED;
  for (int l = 0; l < kLayers; ++l) {
    const std::string b = "blocks." + std::to_string(l);
    p.push_back({b + ".ln1.weight", C});
    if (ln_bias) p.push_back({b + ".ln1.bias", C});
    p.push_back({b + ".ln2.weight", C});
    if (ln_bias) p.push_back({b + ".ln2.bias", C});
    p.push_back({b + ".attn.qkv.weight", 3 * Hl * D * C});
    if (bias) p.push_back({b + ".attn.qkv.bias", 3 * Hl * D});
    const int64_t gain = shared ? D : Hl * D;
    if (c.qk.norm == config::RMS || c.qk.norm == config::LAYER) {
      p.push_back({b + ".attn.q_norm.weight", gain});
      p.push_back({b + ".attn.k_norm.weight", gain});
    }
    if (c.qk.norm == config::LAYER && bias) {
      p.push_back({b + ".attn.q_norm.bias", gain});
      p.push_back({b + ".attn.k_norm.bias", gain});
    }
    if (c.qk.norm == config::L2) {
      p.push_back({b + ".attn.qk_scale", c.qk.scope == config::HEAD ? Hl : 1});
    }
    p.push_back({b + ".attn.proj.weight", C * Hl * D});
    if (bias) p.push_back({b + ".attn.proj.bias", C});
    p.push_back({b + ".mlp.fc.weight", Fl * C});
    if (bias) p.push_back({b + ".mlp.fc.bias", Fl});
    if (gated) {
      p.push_back({b + ".mlp.gate.weight", Fl * C});
      if (bias) p.push_back({b + ".mlp.gate.bias", Fl});
    }
    p.push_back({b + ".mlp.proj.weight", C * Fl});
    if (bias) p.push_back({b + ".mlp.proj.bias", C});
  }
  p.push_back({"ln_f.weight", C});
  if (ln_bias) p.push_back({"ln_f.bias", C});
  if (!c.tied) p.push_back({"lm_head.weight", Vl * C});
  return p;
}

int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

struct Volume {
  int64_t tp_bytes = 0, tp_calls = 0;
  int64_t dp_bytes = 0, dp_calls = 0;
  int64_t world_bytes = 0, world_calls = 0;
};

struct Terms {  // the formula's pieces, for the printout
  int64_t A = 1, B = 0, act = 0, loss = 0, proj = 0, partial = 0, partial_tensors = 0;
  int64_t norms = 0;  // sequence parallelism: the block and final norms' gradients per micro-batch
  int64_t arena = 0, span = 0, buckets = 0;
};

Volume expected_volume(const Case& c, Terms* t) {
  const int64_t L = kLayers, C = kDModel, D = kDModel / kHeads;
  const int64_t per_rank = kGlobalBatch / c.dp;
  t->B = c.micro_batch ? c.micro_batch : per_rank;
  t->A = per_rank / t->B;
  const int64_t BT = t->B * kSeqLen;
  const bool proj = c.qk.scope == config::PROJECTION && c.qk.norm != config::NONE;
  const bool zero = c.zero_stage == 1 && c.dp > 1;
  Volume v;
  if (c.tp > 1) {
    // Note [recompute]: R block forwards run again in backward, each with its 2 all-reduces of
    // BT C and, PROJECTION scope, its 2 of 2 BT.
    const int64_t R = std::max(c.recompute - 1, 0);
    t->act = (2 + 4 * L + 2 * R) * BT * C;  // floats per micro-batch, forward + backward
    t->loss = 3 * BT;
    t->proj = proj ? (8 * L + 4 * R) * BT : 0;
    if (c.qk.scope == config::HEAD_SHARED && c.qk.norm == config::RMS) {
      t->partial_tensors = 2 * L;
      t->partial = 2 * L * D;
    } else if (c.qk.scope == config::HEAD_SHARED && c.qk.norm == config::LAYER) {
      const int64_t per_layer = c.block.bias ? 4 : 2;  // q, k gains (+ q, k biases)
      t->partial_tensors = per_layer * L;
      t->partial = per_layer * L * D;
    } else if (c.qk.norm == config::L2 && c.qk.scope != config::HEAD) {
      t->partial_tensors = L;
      t->partial = L;
    }
    const int64_t w = c.bf16_wire ? 2 : 4;  // bytes per activation element on the wire
    int64_t act_calls = 2 + 4 * L + 2 * R, norm_calls = 0;
    if (c.sp) {
      // Note [sequence parallel]: the embedding's reduce-scatter, per block 2 all-gathers and 2
      // reduce-scatters forward (again for each recomputed block) and 4 and 2 backward, the LM
      // head's all-gather and reduce-scatter, the all-gather for the embedding's backward: each
      // counted as the whole [BT, C]. Then one all-reduce per norm of its weight (and bias)
      // gradient.
      act_calls = 4 + 10 * L + 4 * R;
      t->act = act_calls * BT * C;
      norm_calls = 2 * L + 1;
      const bool ln_bias = c.block.norm == config::LAYERNORM && c.block.bias;
      t->norms = norm_calls * (ln_bias ? 2 : 1) * C;
    }
    v.tp_bytes =
        t->A * (w * t->act + 4 * (t->loss + t->proj + t->norms)) + 4 * t->partial + (zero ? 0 : 8);
    v.tp_calls = t->A * (act_calls + 3 + norm_calls + (proj ? 4 * L + 2 * R : 0)) +
                 t->partial_tensors + (zero ? 0 : 1);
  }
  // The arena: every tensor starts at a multiple of 16 floats; the total is padded to 16 dp.
  const auto params = local_params(c);
  std::vector<int64_t> offset;
  int64_t end = 0;
  for (const auto& [name, n] : params) {
    offset.push_back(end);
    end += align16(n);
  }
  t->arena = (end + 16 * c.dp - 1) / (16 * c.dp) * (16 * c.dp);
  t->span = offset.back() + params.back().second;
  if (c.dp > 1 && zero) {
    v.dp_bytes = 2 * 4 * t->arena;
    v.dp_calls = 2;
  } else if (c.dp > 1) {
    // Buckets in backward order, closed when their extent reaches bucket_mb.
    const float mb = static_cast<float>(c.bucket_mb);  // a float in keel.proto
    const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(mb * 1024.0 * 1024.0) / 4);
    int64_t lo = 0, hi = 0, members = 0;
    for (int i = static_cast<int>(params.size()) - 1; i >= 0; --i) {
      if (members == 0) hi = offset[i] + params[i].second;
      lo = offset[i];
      ++members;
      if (hi - lo >= cap || i == 0) {
        v.dp_bytes += 4 * (hi - lo);
        ++v.dp_calls;
        members = 0;
      }
    }
    t->buckets = v.dp_calls;
  }
  if (c.tp * c.dp > 1) {
    // loss, z-loss and log Z sums; each layer's max attention logit; ZeRO-1: the gradient's sum
    // of squares; plain DP: the largest replica norm and whether one is non-finite (Note [replay])
    const bool replicated_norm = c.dp > 1 && !zero;
    v.world_bytes = 24 + 4 * kLayers + (zero ? 8 : 0) + (replicated_norm ? 16 : 0);
    v.world_calls = 2 + (zero ? 1 : 0) + (replicated_norm ? 1 : 0);
  }
  return v;
}

Volume measured(const Topology& topo) {
  Volume v;
  v.tp_bytes = topo.tp_comm->bytes_moved();
  v.tp_calls = topo.tp_comm->calls();
  v.dp_bytes = topo.dp_comm->bytes_moved();
  v.dp_calls = topo.dp_comm->calls();
  v.world_bytes = topo.world_comm->bytes_moved();
  v.world_calls = topo.world_comm->calls();
  return v;
}

void reset(const Topology& topo) {
  topo.tp_comm->reset_counters();
  topo.dp_comm->reset_counters();
  topo.world_comm->reset_counters();
}

void expect_volume(const Volume& got, const Volume& want, const std::string& when) {
  EXPECT_EQ(got.tp_bytes, want.tp_bytes) << when << ": tensor-parallel bytes";
  EXPECT_EQ(got.tp_calls, want.tp_calls) << when << ": tensor-parallel collectives";
  EXPECT_EQ(got.dp_bytes, want.dp_bytes) << when << ": data-parallel bytes";
  EXPECT_EQ(got.dp_calls, want.dp_calls) << when << ": data-parallel collectives";
  EXPECT_EQ(got.world_bytes, want.world_bytes) << when << ": world bytes";
  EXPECT_EQ(got.world_calls, want.world_calls) << when << ": world collectives";
}

class CommVolume : public ::testing::TestWithParam<Case> {};

TEST_P(CommVolume, OneStepMatchesFormula) {
  const Case& c = GetParam();
  if (c.tp * c.dp != world_size()) {
    GTEST_SKIP() << c.name() << " needs " << c.tp * c.dp << " ranks, the world has "
                 << world_size();
  }
  TinyJob job;
  job.tp = c.tp;
  job.zero_stage = c.zero_stage;
  job.micro_batch = c.micro_batch;
  job.qk = c.qk;
  job.tied = c.tied;
  job.bucket_mb = c.bucket_mb;
  job.block = c.block;
  Distributed dist(mpi_env(), c.tp, 60.0);
  const Topology& topo = dist.topology();
  ASSERT_EQ(topo.dp, c.dp);
  TrainerOptions opts;
  opts.progress = false;
  config::KeelConfig cfg = tiny_config(job);
  if (c.bf16_wire) cfg.mutable_parallel()->set_tp_comm_dtype("BF16");
  cfg.mutable_train()->set_recompute_layers(c.recompute);
  cfg.mutable_parallel()->set_sequence_parallel(c.sp);
  Trainer trainer(cfg, topo, opts);
  EXPECT_EQ(trainer.model().dims().sp, c.sp && c.tp > 1);
  EXPECT_EQ(trainer.model().dims().tp_bf16_wire, c.bf16_wire);

  // The formula's parameter list is the model's.
  ParamStore& ps = trainer.model().params();
  const auto params = local_params(c);
  EXPECT_EQ(static_cast<size_t>(ps.size()), params.size());
  for (int id = 0; id < std::min<int>(ps.size(), static_cast<int>(params.size())); ++id) {
    EXPECT_EQ(ps.info(id).spec.name, params[id].first) << "parameter " << id;
    EXPECT_EQ(ps.info(id).numel(), params[id].second) << ps.info(id).spec.name;
  }
  Terms t;
  const Volume want = expected_volume(c, &t);
  EXPECT_EQ(ps.total_elems(), t.arena);
  EXPECT_EQ(trainer.accum_steps(), t.A);
  EXPECT_EQ(trainer.micro_batch(), t.B);

  reset(topo);  // constructing moved nothing; counted from zero anyway
  trainer.step();
  expect_volume(measured(topo), want, "step 1");
  reset(topo);
  trainer.step();
  const Volume got = measured(topo);
  expect_volume(got, want, "step 2");

  if (topo.world_rank == 0) {
    std::printf(
        "[ %s ] A=%lld B=%lld BT=%lld | TP %lld B = A %lld x (%d x act %lld + 4 x (loss %lld + "
        "qk-stats %lld + norms %lld)) + 4 x partial %lld + %d, %lld calls | DP %lld B (%s: arena "
        "%lld floats, span %lld, %lld calls) | world %lld B, %lld calls\n",
        c.name().c_str(), static_cast<long long>(t.A), static_cast<long long>(t.B),
        static_cast<long long>(t.B * kSeqLen), static_cast<long long>(got.tp_bytes),
        static_cast<long long>(t.A), c.bf16_wire ? 2 : 4, static_cast<long long>(t.act),
        static_cast<long long>(t.loss), static_cast<long long>(t.proj),
        static_cast<long long>(t.norms), static_cast<long long>(t.partial),
        c.tp > 1 && !(c.zero_stage && c.dp > 1) ? 8 : 0, static_cast<long long>(got.tp_calls),
        static_cast<long long>(got.dp_bytes),
        c.dp == 1 ? "none" : (c.zero_stage ? "ZeRO-1 reduce-scatter + all-gather" : "buckets"),
        static_cast<long long>(t.arena), static_cast<long long>(t.span),
        static_cast<long long>(got.dp_calls), static_cast<long long>(got.world_bytes),
        static_cast<long long>(got.world_calls));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CommVolume, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
}  // namespace keel
