// Tests for layers/memory_estimate: the parameter term equals a built model's arena exactly, for
// every norm, QK-norm scope, tying and TP layout, and for the modern blocks (RoPE, SwiGLU and
// GEGLU, bias-free layers, post-sublayer norms, OLMo-2- and Qwen3-like models); parameters +
// gradients + activations match the heap a GPT allocates (measured with mallinfo2) within 5% (+ 64
// KiB of bookkeeping); the AdamW and ZeRO-1 terms follow the layout; and sizes of 2^31 compute a
// huge finite number, not an overflowed one.
#include "layers/memory_estimate.h"

#include <gtest/gtest.h>
#include <malloc.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "layers/gpt.h"

namespace keel {
namespace {

config::KeelConfig small_config(const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"model.seq_len=32",     "model.d_model=64",
                                  "model.n_layers=2",     "model.n_heads=4",
                                  "train.global_batch=8", "model.vocab_size=300"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// A single-process topology that lays the model out as TP rank 0 of `tp` in a dp-wide job (the
// model's constructor allocates but does not communicate).
struct Layout {
  Layout(int tp, int dp) {
    topo = Topology::single(tp_holder, dp_holder);
    topo.tp = tp;
    topo.dp = dp;
    topo.world_size = tp * dp;
  }
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  Topology topo;
};

double heap_bytes() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<double>(mi.uordblks) + static_cast<double>(mi.hblkhd);
}

struct Case {
  std::vector<std::string> sets;
  int tp = 1, dp = 1;
  int64_t micro = 8;
};

class MemoryEstimateMatchesModel : public ::testing::TestWithParam<Case> {};

TEST_P(MemoryEstimateMatchesModel, ParametersExactlyAndHeapWithinFivePercent) {
  const Case& c = GetParam();
  const config::KeelConfig cfg = small_config(c.sets);
  Layout layout(c.tp, c.dp);
  const int threads = omp_get_max_threads();
  const MemoryEstimate e = estimate_memory(cfg, c.tp, c.dp, c.micro, threads);
  const double before = heap_bytes();
  auto model = std::make_unique<GPT>(cfg, layout.topo, c.micro);
  const double allocated = heap_bytes() - before;
  EXPECT_EQ(e.parameters, static_cast<double>(model->params().total_elems()) * 4.0);
  EXPECT_EQ(e.gradients, e.parameters);
  // What the GPT allocates: its arenas and activations (the trainer's batch buffers excluded).
  const double trainer_batch = 2.0 * static_cast<double>(c.micro) * cfg.model().seq_len() * 4.0;
  const double expected = e.parameters + e.gradients + e.activations - trainer_batch;
  // Beyond the buffers: parameter names, shapes and Tensor handles (tens of KiB here).
  EXPECT_NEAR(allocated, expected, 0.05 * expected + 64 * 1024)
      << "estimated " << format_bytes(expected) << ", allocated " << format_bytes(allocated);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MemoryEstimateMatchesModel,
    ::testing::Values(
        Case{{}}, Case{{"model.tie_embeddings=false"}},
        Case{{"model.norm=RMSNORM", "model.qk_norm=NONE"}},
        Case{{"model.qk_norm=LAYER", "model.qk_norm_scope=PROJECTION"}},
        Case{{"model.qk_norm=L2", "model.qk_norm_scope=HEAD"}},
        Case{{"model.qk_norm=RMS", "model.qk_norm_scope=HEAD"}, 2, 1, 8},
        Case{{"model.tie_embeddings=false", "model.max_positions=100"}, 4, 3, 3},
        Case{{"model.d_ff=96", "model.seq_len=8"}, 2, 2, 1},
        // Modern blocks, one option at a time, then combined.
        Case{{"model.position=ROPE"}},
        Case{{"model.mlp=SWIGLU"}},  // d_ff 0 -> 8/3 x 64 rounded up to 192
        Case{{"model.mlp=GEGLU", "model.d_ff=96"}, 2, 1, 8},
        Case{{"model.bias=false", "model.qk_norm=LAYER", "model.qk_norm_scope=HEAD"}},
        Case{{"model.bias=false", "model.norm=RMSNORM", "model.qk_norm=L2"}, 2, 2, 4},
        Case{{"model.norm_placement=POST_SUBLAYER"}},
        // OLMo 2
        Case{{"model.norm=RMSNORM", "model.qk_norm=RMS", "model.qk_norm_scope=PROJECTION",
              "model.position=ROPE", "model.mlp=SWIGLU", "model.bias=false",
              "model.norm_placement=POST_SUBLAYER", "model.tie_embeddings=false"},
             2,
             2,
             4},
        // Qwen3
        Case{{"model.norm=RMSNORM", "model.qk_norm=RMS", "model.position=ROPE", "model.mlp=SWIGLU",
              "model.bias=false"},
             4,
             3,
             3},
        // model.head_dim apart from d_model / n_heads (Qwen3-, Gemma 3-style), with GQA and MQA.
        Case{{"model.head_dim=32", "model.n_kv_heads=2", "model.norm=RMSNORM", "model.qk_norm=RMS",
              "model.position=ROPE", "model.mlp=SWIGLU", "model.bias=false"},
             2,
             1,
             4},
        Case{{"model.head_dim=8", "model.n_kv_heads=1", "model.qk_norm=LAYER",
              "model.qk_norm_scope=PROJECTION"}},
        // Sandwich norms (Note [sandwich norms]): alone, Gemma 3-style, with recomputation and SP.
        Case{{"model.norm_placement=SANDWICH"}},
        Case{{"model.norm_placement=SANDWICH", "model.norm=RMSNORM", "model.qk_norm=RMS",
              "model.position=ROPE", "model.mlp=GEGLU", "model.bias=false", "model.n_kv_heads=1",
              "model.head_dim=32"},
             2,
             1,
             4},
        Case{{"model.norm_placement=SANDWICH", "model.n_layers=3", "train.recompute_layers=3",
              "parallel.sequence_parallel=true"},
             2,
             2,
             4},
        // Activation recomputation (Note [recompute]): all blocks, some, and with
        // post-sublayer norms and PROJECTION statistics under TP.
        Case{{"model.n_layers=4", "train.recompute_layers=4"}},
        Case{{"model.n_layers=4", "train.recompute_layers=3", "model.mlp=SWIGLU",
              "model.position=ROPE"}},
        Case{{"model.n_layers=3", "train.recompute_layers=3", "model.norm_placement=POST_SUBLAYER",
              "model.qk_norm=LAYER", "model.qk_norm_scope=PROJECTION"},
             2,
             2,
             4},
        // Sequence parallelism (Note [sequence parallel]): pre- and post-sublayer norms, with
        // recomputation, and at tp = 1 (no change).
        Case{{"parallel.sequence_parallel=true"}, 2, 1, 8},
        Case{{"parallel.sequence_parallel=true", "model.norm_placement=POST_SUBLAYER",
              "model.norm=RMSNORM", "model.mlp=SWIGLU", "train.recompute_layers=2"},
             4,
             1,
             4},
        Case{{"parallel.sequence_parallel=true"}}));

// Note [sequence parallel]: what SP saves is what the model stops allocating. The difference
// between a TP4 model with and without it equals the estimate's difference within 1% (+ 16 KiB).
TEST(MemoryEstimate, SequenceParallelSavesWhatTheModelStopsAllocating) {
  for (const char* placement : {"PRE", "POST_SUBLAYER"}) {
    const std::vector<std::string> base = {"model.n_layers=4", "model.d_model=128",
                                           std::string("model.norm_placement=") + placement};
    std::vector<std::string> with_sp = base;
    with_sp.push_back("parallel.sequence_parallel=true");
    const config::KeelConfig off = small_config(base), on = small_config(with_sp);
    Layout layout(4, 1);
    const int threads = omp_get_max_threads();
    auto allocated = [&](const config::KeelConfig& cfg) {
      const double before = heap_bytes();
      auto model = std::make_unique<GPT>(cfg, layout.topo, 8);
      EXPECT_EQ(model->dims().sp, cfg.parallel().sequence_parallel());
      return heap_bytes() - before;
    };
    allocated(on);  // a first model may allocate process-wide state (thread pools) too
    const double got = allocated(off) - allocated(on);
    const double want = estimate_memory(off, 4, 1, 8, threads).activations -
                        estimate_memory(on, 4, 1, 8, threads).activations;
    EXPECT_GT(want, 0.0);
    EXPECT_NEAR(got, want, 0.01 * want + 16 * 1024)
        << placement << ": allocated " << format_bytes(got) << " less, estimated "
        << format_bytes(want);
  }
}

TEST(MemoryEstimate, OptimizerStateFollowsTheLayout) {
  const config::KeelConfig plain = small_config({});
  const MemoryEstimate one = estimate_memory(plain, 1, 1, 8, 1);
  EXPECT_EQ(one.optimizer, 2 * one.parameters);  // AdamW m and v
  EXPECT_EQ(one.communication, 0.0);
  const MemoryEstimate dp4 = estimate_memory(plain, 1, 4, 2, 1);
  EXPECT_EQ(dp4.optimizer, 2 * dp4.parameters);
  EXPECT_GT(dp4.communication, 0.0);
  // ZeRO-1: m, v and the gradient shard over dp ranks.
  const config::KeelConfig zero = small_config({"parallel.zero_stage=1"});
  const MemoryEstimate z4 = estimate_memory(zero, 1, 4, 2, 1);
  EXPECT_EQ(z4.optimizer, 3 * z4.parameters / 4);
  // More sequences per micro-batch: more activations, the same parameters.
  const MemoryEstimate big_micro = estimate_memory(plain, 1, 1, 16, 1);
  EXPECT_GT(big_micro.activations, 1.9 * one.activations);
  EXPECT_EQ(big_micro.parameters, one.parameters);
  // The built-in corpus is held in memory; a file is mapped and not counted.
  EXPECT_EQ(one.data, static_cast<double>(plain.data().builtin_bytes()));
  EXPECT_EQ(estimate_memory(small_config({"data.path=/d/x.txt"}), 1, 1, 8, 1).data, 0.0);
}

// 2^31 - 1 in any size field gives a finite estimate far beyond any machine, never a wrapped
// (negative or small) one.
// keel-train counts what the process already holds (resident_memory_bytes) instead of the fixed
// baseline when it is more; the reading follows memory the process touches.
TEST(MemoryEstimate, ResidentMemoryFollowsTouchedPages) {
  const double before = resident_memory_bytes();
  ASSERT_GT(before, 1024.0 * 1024.0);  // a running test binary holds more than 1 MiB
  std::vector<char> block(64 << 20);
  for (size_t i = 0; i < block.size(); i += 4096) block[i] = static_cast<char>(i);
  const double after = resident_memory_bytes();
  EXPECT_GE(after - before, 60.0 * 1024 * 1024) << "before " << before << ", after " << after;
  EXPECT_EQ(block[4096], static_cast<char>(4096));
  EXPECT_EQ(kProcessBaselineBytes, 24.0 * 1024 * 1024);
}

TEST(MemoryEstimate, HugeSizesDoNotOverflow) {
  for (const char* set :
       {"model.n_layers=2147483647", "model.vocab_size=2147483647", "model.d_ff=2147483647",
        "model.max_positions=2147483647", "train.global_batch=2147483647"}) {
    SCOPED_TRACE(set);
    const config::KeelConfig cfg = small_config({set});
    const int64_t micro = cfg.train().global_batch();
    const MemoryEstimate e = estimate_memory(cfg, 1, 1, micro, 2);
    EXPECT_TRUE(std::isfinite(e.total()));
    EXPECT_GT(e.total(), 1e12) << e.describe();
  }
}

TEST(MemoryEstimate, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1.5 * 1024 * 1024), "1.5 MiB");
  EXPECT_EQ(format_bytes(146.2 * 1024 * 1024), "146 MiB");
  EXPECT_EQ(format_bytes(3.25 * 1024 * 1024 * 1024), "3.25 GiB");
  EXPECT_EQ(format_bytes(1010 * 1024), "1010 KiB");
  EXPECT_EQ(format_bytes(2e6 * 1024 * 1024 * 1024 * 1024), "2000000 TiB");
  EXPECT_GT(physical_memory_bytes(), 0.0);
}

// On a GPU attention keeps its log-sum-exp [B, H, T] instead of the CPU's probabilities
// [B, H, T, T], and there is no per-thread T x T workspace; under BF16 (a GPU's default) the
// activations only matrix products read are bf16 (Note [act-dtype]); everything else is the same.
TEST(MemoryEstimate, GpuAttentionKeepsOnlyTheLogSumExp) {
  const config::KeelConfig cfg = small_config({"model.qk_norm=RMS"});
  const config::KeelConfig fp32 = small_config({"model.qk_norm=RMS", "train.precision=FP32"});
  const int64_t B = 4, threads = 3;
  const MemoryEstimate cpu = estimate_memory(cfg, 2, 1, B, threads);
  const MemoryEstimate gpu = estimate_memory(cfg, 2, 1, B, threads, Device::kCuda);
  const MemoryEstimate gpu_fp32 = estimate_memory(fp32, 2, 1, B, threads, Device::kCuda);
  const double T = cfg.model().seq_len(), L = cfg.model().n_layers();
  const double Hl = cfg.model().n_heads() / 2.0;
  const double Vl = std::ceil(cfg.model().vocab_size() / 128.0) * 64.0;  // padded, then halved
  const double C = cfg.model().d_model(), HD = C / 2, Fl = 4 * C / 2;
  EXPECT_EQ(cpu.activations - gpu_fp32.activations,
            4.0 * (L * B * Hl * (T * T - T) + threads * 2 * T * T));
  // Half of the logits, xf, attention's output gradient, the QKV gradient and the MLP hidden's
  // gradient (shared scratch), and per block n1, n2, the QKV projection's output, the normalised
  // q and k, attention's output and the MLP's pre-activation and hidden output; less the bf16 TP
  // wire's [BT, C] bf16 scratch (tp = 2 in BF16: Note [bf16 wire]).
  EXPECT_EQ(
      gpu_fp32.activations - gpu.activations,
      2.0 * B * T * (Vl + C + HD + 3 * HD + Fl + L * (2 * C + 3 * HD + 2 * HD + HD + 2 * Fl)) -
          2.0 * B * T * C);
  EXPECT_EQ(gpu.parameters, cpu.parameters);
  EXPECT_EQ(gpu.optimizer, cpu.optimizer);
}

// parallel.tp_comm_dtype: AUTO is BF16 under the BF16 precision only. The bf16 TP wire's [BT, C]
// bf16 scratch (Note [bf16 wire]) exists where the layers write those activations in bf16: on a
// device in BF16 with tp > 1.
TEST(MemoryEstimate, Bf16TpWireScratch) {
  using kernels::Precision;
  auto wire = [](const char* v, Precision p) {
    config::Parallel par;
    par.set_tp_comm_dtype(v);
    return tp_comm_bf16(par, p);
  };
  EXPECT_TRUE(wire("AUTO", Precision::kBf16));
  EXPECT_FALSE(wire("AUTO", Precision::kFp32));
  EXPECT_TRUE(wire("", Precision::kBf16));  // unset
  EXPECT_TRUE(wire("bf16", Precision::kFp32));
  EXPECT_FALSE(wire("FP32", Precision::kBf16));
  const config::KeelConfig bf16 = small_config({});  // AUTO: BF16 on a GPU
  const config::KeelConfig fp32_wire = small_config({"parallel.tp_comm_dtype=FP32"});
  const double BT = 4.0 * bf16.model().seq_len(), C = bf16.model().d_model();
  auto act = [](const config::KeelConfig& c, int tp, Device d) {
    return estimate_memory(c, tp, 1, 4, 1, d).activations;
  };
  EXPECT_EQ(act(bf16, 2, Device::kCuda) - act(fp32_wire, 2, Device::kCuda), 2 * BT * C);
  EXPECT_EQ(act(bf16, 1, Device::kCuda), act(fp32_wire, 1, Device::kCuda));
  EXPECT_EQ(act(bf16, 2, Device::kCpu), act(fp32_wire, 2, Device::kCpu));
}

// docs/gpu.md's figure ("Mixed precision"): GPT-2 124M's shapes (QK-norm on, learned positions,
// GELU) at 16 x 1024 tokens keep 6.7 GB less of activations under BF16 on a GPU than under FP32
// (Note [act-dtype]).
TEST(MemoryEstimate, Bf16ActivationsSaveSixPointSevenGBAtGpt2Small) {
  const std::vector<std::string> shapes = {
      "model.vocab_size=50304", "model.d_model=768", "model.n_layers=12",    "model.n_heads=12",
      "model.seq_len=1024",     "model.qk_norm=RMS", "train.global_batch=16"};
  std::vector<std::string> fp32 = shapes, bf16 = shapes;
  fp32.push_back("train.precision=FP32");
  bf16.push_back("train.precision=BF16");
  const double saved =
      estimate_memory(load_config("", fp32), 1, 1, 16, 1, Device::kCuda).activations -
      estimate_memory(load_config("", bf16), 1, 1, 16, 1, Device::kCuda).activations;
  EXPECT_NEAR(saved / 1e9, 6.7, 0.05);
}

// docs/model.md ("Activation recomputation"): GPT-2 small shapes on a GPU under BF16, 16 x 1024
// tokens per micro-batch: train.recompute_layers=12 keeps 3.19 GB of activations, 5.03 GB less than
// keeping every block's (8.22 GB), and 6 (half the blocks) 2.29 GB less.
TEST(MemoryEstimate, RecomputationAtGpt2Small) {
  const std::vector<std::string> shapes = {
      "model.vocab_size=50304", "model.d_model=768", "model.n_layers=12",    "model.n_heads=12",
      "model.seq_len=1024",     "model.qk_norm=RMS", "train.global_batch=16"};
  auto activations = [&](int n) {
    std::vector<std::string> sets = shapes;
    sets.push_back("train.recompute_layers=" + std::to_string(n));
    return estimate_memory(load_config("", sets), 1, 1, 16, 1, Device::kCuda).activations;
  };
  const double keep = activations(0), all = activations(12), half = activations(6);
  EXPECT_EQ(activations(1), keep);  // one block sharing with itself changes nothing
  EXPECT_NEAR(keep / 1e9, 8.22, 0.005);
  EXPECT_NEAR(all / 1e9, 3.19, 0.005);
  EXPECT_NEAR((keep - all) / 1e9, 5.03, 0.005);
  EXPECT_NEAR((keep - half) / 1e9, 2.29, 0.005);
}

// docs/distributed.md ("Sequence parallelism"): activations per GPU under BF16 of GPT-2 124M's
// shapes at TP4 (micro-batch 16 x 1024) and the 1.3B of "Sizing a GPU run" at TP8 (d_model 2048, 24
// layers, 16 heads, 8 x 2048), without and with sequence parallelism, and with it plus full
// recomputation.
TEST(MemoryEstimate, SequenceParallelAtTp4AndTp8) {
  struct Row {
    std::vector<std::string> sets;
    int64_t micro;
    int layers, tp;
    double off_gb, on_gb, on_recompute_gb;
  };
  const Row rows[] = {
      {{"model.vocab_size=50304", "model.d_model=768", "model.n_layers=12", "model.n_heads=12",
        "model.seq_len=1024", "model.qk_norm=RMS", "train.global_batch=256"},
       16,
       12,
       4,
       3.57,
       2.40,
       1.01},
      {{"model.vocab_size=50304", "model.d_model=2048", "model.n_layers=24", "model.n_heads=16",
        "model.seq_len=2048", "model.qk_norm=RMS", "train.global_batch=512"},
       8,
       24,
       8,
       13.35,
       5.34,
       1.47},
  };
  for (const Row& r : rows) {
    auto gb = [&](bool sp, int recompute) {
      std::vector<std::string> sets = r.sets;
      sets.push_back(std::string("parallel.sequence_parallel=") + (sp ? "true" : "false"));
      sets.push_back("parallel.tp=" + std::to_string(r.tp));
      sets.push_back("train.recompute_layers=" + std::to_string(recompute));
      return estimate_memory(load_config("", sets), r.tp, 128 / r.tp, r.micro, 1, Device::kCuda)
                 .activations /
             1e9;
    };
    const double off = gb(false, 0), on = gb(true, 0), on_recompute = gb(true, r.layers);
    std::printf("%s, tp %d: %.2f GB, SP %.2f GB, SP + recompute %.2f GB\n", r.sets[1].c_str(), r.tp,
                off, on, on_recompute);
    EXPECT_NEAR(off, r.off_gb, 0.005);
    EXPECT_NEAR(on, r.on_gb, 0.005);
    EXPECT_NEAR(on_recompute, r.on_recompute_gb, 0.005);
  }
}

}  // namespace
}  // namespace keel
