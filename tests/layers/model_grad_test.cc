// Whole-model gradient check: keel::GPT's backward against central finite differences of its
// float32 loss (ce + z_loss), for every QK-norm mode and scope, with learned positions and with
// RoPE, GELU and gated (SwiGLU, GEGLU) MLPs, with and without biases, pre- and post-sublayer norms
// (and OLMo-2- and Qwen3-like combinations), on a sample of elements of every parameter tensor;
// plus bit-for-bit determinism of forward and backward.
//
// Tolerance. The loss is computed in float32 (logits, lse and target logits are floats, summed in
// double), so one evaluation carries rounding noise of ~1e-7 of |loss| ~ 3.5, i.e. ~4e-7. The
// derivative is the Richardson extrapolation (4 fd(h) - fd(2h)) / 3 of central differences with
// h = 1e-2: it cancels the h^2 |L'''| / 6 truncation term, which alone reached 3% of the
// gradient for some elements (post-sublayer RMSNorm of a small attention output, as OLMo 2),
// leaving O(h^4) and a rounding noise of ~(4 * 4e-7 / 1e-2 + 4e-7 / 2e-2) / 3 ~ 6e-5. We accept
//     |fd - g| <= 2e-2 * max(|g|, |fd|) + 2e-4
// (observed worst relative error over elements above 10x the floor: ~8e-3, the worst error
// 7% of its bound).
// The model is initialised with init_std 0.3 (and randomised norm gains, biases and QK scales) so
// the gradients being checked are mostly O(1e-3 .. 1e-1), well above the 2e-4 floor; the test
// asserts that most sampled elements are, so the floor cannot silently make it vacuous. A wrong
// gradient (a dropped term, a wrong sign, a stride error) is an O(1) relative error on most
// elements; the test was verified to fail when the analytic gradient is negated or scaled by 1.2.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "framework/config/keel.pb.h"
#include "layers/gpt.h"

namespace keel {
namespace {

constexpr int64_t kB = 2;
constexpr float kStep = 1e-2f;
constexpr double kRelTol = 2e-2;
constexpr double kAbsTol = 2e-4;
constexpr int kSamplesPerParam = 6;

struct ModelCase {
  const char* name;
  config::QkNorm qk = config::NONE;
  config::QkNormScope scope = config::HEAD_SHARED;
  bool tied = true;
  config::NormKind norm = config::LAYERNORM;
  config::Position position = config::LEARNED;
  config::MlpKind mlp = config::GELU;
  bool bias = true;
  config::NormPlacement placement = config::PRE;
  // Grouped-query attention (tests/layers/gqa_test.cc): 0 is multi-head; the cases that set it
  // use 4 heads at d_model 32, so 1 and 2 k/v heads are MQA and GQA.
  int kv_heads = 0;
  // model.head_dim: 0 is d_model / n_heads; the cases that set it make q, k and v narrower or
  // wider than d_model (n_heads x head_dim != d_model), as Qwen3 and Gemma 3 do.
  int head_dim = 0;
};

// gtest prints a parameter by name rather than as bytes.
void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }

config::KeelConfig tiny_config(const ModelCase& c) {
  config::KeelConfig cfg;
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(32);
  m->set_seq_len(8);
  m->set_d_model(c.kv_heads > 0 ? 32 : 16);
  m->set_n_layers(2);
  m->set_n_heads(c.kv_heads > 0 ? 4 : 2);
  m->set_n_kv_heads(c.kv_heads);
  m->set_head_dim(c.head_dim);
  m->set_d_ff(32);
  m->set_qk_norm(c.qk);
  m->set_qk_norm_scope(c.scope);
  m->set_tie_embeddings(c.tied);
  m->set_norm(c.norm);
  m->set_max_positions(0);
  m->set_init_std(0.3f);
  m->set_position(c.position);
  // theta 100 instead of 10000: at seq_len 8 and head_dim 8 every pair then turns noticeably.
  m->set_rope_theta(100.0);
  m->set_mlp(c.mlp);
  m->set_bias(c.bias);
  m->set_norm_placement(c.placement);
  cfg.mutable_loss()->set_z_loss(1e-2);
  return cfg;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch random_batch(const ModelDims& d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.V - 1));
  Batch b;
  b.tokens.resize(kB * d.T);
  b.targets.resize(kB * d.T);
  for (auto& t : b.tokens) t = tok(rng);
  for (auto& t : b.targets) t = tok(rng);
  return b;
}

// Moves the constant-initialised parameters (norm gains = 1, biases = 0, L2 scale = g0) off their
// init values so that their gradients, and the gradients flowing through them, are generic.
void randomise_constants(ParamStore& ps) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  for (int id = 0; id < ps.size(); ++id) {
    const ParamSpec& s = ps.info(id).spec;
    if (s.init != ParamInit::kConstant) continue;
    float* p = ps.param(id);
    for (int64_t i = 0; i < ps.info(id).numel(); ++i) {
      // gains: 1 + u; biases: u; the L2 logit scale: g0 * (1 + u)
      p[i] = s.value == 0.0f ? u(rng) : s.value * (1.0f + u(rng));
    }
  }
}

// Runs OpenMP (and OpenBLAS) on one thread while alive.
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_;
};

double total_loss(GPT& model, const Batch& b) {
  const LossStats s = model.forward(b.tokens.data(), b.targets.data(), kB);
  return s.ce + s.z_loss;
}

class ModelGrad : public ::testing::TestWithParam<ModelCase> {
 protected:
  void SetUp() override {
    const ModelCase c = GetParam();
    topo_ = Topology::single(tp_holder_, dp_holder_);
    model_ = std::make_unique<GPT>(tiny_config(c), topo_, kB);
    model_->init(42);
    randomise_constants(model_->params());
    batch_ = random_batch(model_->dims(), 5);
  }
  std::unique_ptr<Communicator> tp_holder_, dp_holder_;
  Topology topo_;
  std::unique_ptr<GPT> model_;
  Batch batch_;
};

TEST_P(ModelGrad, EveryParameterMatchesFiniteDifferences) {
  GPT& model = *model_;
  ParamStore& ps = model.params();
  ps.zero_grads();
  const LossStats stats = model.forward(batch_.tokens.data(), batch_.targets.data(), kB);
  ASSERT_GT(stats.z_loss, 0.0);
  if (GetParam().kv_heads > 0) {
    ASSERT_TRUE(model.dims().gqa());
    ASSERT_GE(ps.find("blocks.0.attn.kv.weight"), 0);
  }
  model.backward(1.0f);
  // Copy: the FD forwards below do not touch grads, but keep the analytic values apart anyway.
  const std::vector<float> grads(ps.grads().f32(), ps.grads().f32() + ps.total_elems());

  // The ~400 tiny forwards run on one thread: on a shared machine two OpenMP threads spend most of
  // each call in fork/join. The analytic pass above used the caller's thread count.
  std::optional<OneThread> one_thread(std::in_place);
  std::mt19937 rng(17);
  int checked = 0, above_floor = 0, failures = 0;
  double worst_rel = 0.0;
  std::string worst_name;
  for (int id = 0; id < ps.size(); ++id) {
    const ParamInfo& info = ps.info(id);
    const int64_t n = info.numel();
    const float* g = grads.data() + info.offset;
    // Evenly spaced strata (so q, k and v rows of a QKV or KV weight are all visited), a random
    // element within each; small tensors are checked completely.
    std::vector<int64_t> idx;
    if (n <= kSamplesPerParam) {
      for (int64_t j = 0; j < n; ++j) idx.push_back(j);
    } else {
      for (int k = 0; k < kSamplesPerParam; ++k) {
        const int64_t lo = n * k / kSamplesPerParam, hi = n * (k + 1) / kSamplesPerParam;
        idx.push_back(std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng));
      }
    }
    double tensor_worst = 0.0;
    for (int64_t j : idx) {
      float* p = ps.param(id) + j;
      const float p0 = *p;
      auto central = [&](float h) {
        *p = p0 + h;
        const double lp = total_loss(model, batch_);
        *p = p0 - h;
        const double lm = total_loss(model, batch_);
        *p = p0;
        // The step actually taken in float (p0 +- h rounds).
        return (lp - lm) / (static_cast<double>(p0 + h) - static_cast<double>(p0 - h));
      };
      const double fd = (4.0 * central(kStep) - central(2.0f * kStep)) / 3.0;
      const double a = g[j];
      const double err = std::abs(fd - a);
      const double scale = std::max(std::abs(a), std::abs(fd));
      const double rel = err / std::max(scale, 1e-12);
      ++checked;
      if (scale > 10 * kAbsTol) {
        ++above_floor;
        tensor_worst = std::max(tensor_worst, rel);
      }
      if (err > kRelTol * scale + kAbsTol) {
        if (failures++ < 10) {
          ADD_FAILURE() << info.spec.name << "[" << j << "]: analytic " << a << " vs fd " << fd;
        }
      }
    }
    if (tensor_worst > worst_rel) {
      worst_rel = tensor_worst;
      worst_name = info.spec.name;
    }
  }
  one_thread.reset();
  std::printf(
      "[grad] %-24s %d elements of %d tensors, %d above 10x the floor, worst rel %.2e (%s)\n",
      GetParam().name, checked, ps.size(), above_floor, worst_rel, worst_name.c_str());
  // The absolute floor must not be what makes the test pass.
  EXPECT_GE(above_floor, checked * 3 / 4);
  // The FD forwards restored every parameter exactly: the loss is unchanged bit for bit.
  const LossStats again = model.forward(batch_.tokens.data(), batch_.targets.data(), kB);
  EXPECT_EQ(again.ce, stats.ce);
  EXPECT_EQ(again.z_loss, stats.z_loss);
}

TEST_P(ModelGrad, ForwardAndBackwardAreDeterministic) {
  GPT& model = *model_;
  ParamStore& ps = model.params();
  const LossStats a = model.forward(batch_.tokens.data(), batch_.targets.data(), kB);
  ps.zero_grads();
  model.backward(1.0f);
  const std::vector<float> ga(ps.grads().f32(), ps.grads().f32() + ps.total_elems());
  const LossStats b = model.forward(batch_.tokens.data(), batch_.targets.data(), kB);
  ps.zero_grads();
  model.backward(1.0f);
  EXPECT_EQ(std::memcmp(&a.ce, &b.ce, sizeof(double)), 0) << a.ce << " vs " << b.ce;
  EXPECT_EQ(std::memcmp(&a.z_loss, &b.z_loss, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a.max_attn_logit, &b.max_attn_logit, sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(ga.data(), ps.grads().f32(), ga.size() * sizeof(float)), 0);
  // backward accumulates (+=): a second backward without zeroing doubles the gradient.
  model.forward(batch_.tokens.data(), batch_.targets.data(), kB);
  model.backward(1.0f);
  const float* g2 = ps.grads().f32();
  for (size_t i = 0; i < ga.size(); ++i) {
    ASSERT_NEAR(g2[i], 2 * ga[i], 1e-6f * (1 + std::abs(ga[i]))) << i;
  }
}

std::string case_name(const ::testing::TestParamInfo<ModelCase>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(
    AllModes, ModelGrad,
    ::testing::Values(
        ModelCase{.name = "none"},
        ModelCase{.name = "none_untied_rms", .tied = false, .norm = config::RMSNORM},
        ModelCase{.name = "rms_head_shared", .qk = config::RMS},
        ModelCase{.name = "rms_head", .qk = config::RMS, .scope = config::HEAD},
        ModelCase{.name = "rms_projection",
                  .qk = config::RMS,
                  .scope = config::PROJECTION,
                  .norm = config::RMSNORM},
        ModelCase{.name = "layer_head_shared", .qk = config::LAYER},
        ModelCase{.name = "layer_head", .qk = config::LAYER, .scope = config::HEAD, .tied = false},
        ModelCase{.name = "layer_projection", .qk = config::LAYER, .scope = config::PROJECTION},
        ModelCase{.name = "l2_head_shared", .qk = config::L2},
        ModelCase{
            .name = "l2_head", .qk = config::L2, .scope = config::HEAD, .norm = config::RMSNORM},
        ModelCase{.name = "l2_projection", .qk = config::L2, .scope = config::PROJECTION}),
    case_name);

// RoPE after every QK-norm mode and scope: backward must rotate dq, dk back before the norm's
// (or, for NONE, the projection's) backward.
constexpr config::Position kRope = config::ROPE;
INSTANTIATE_TEST_SUITE_P(
    Rope, ModelGrad,
    ::testing::Values(
        ModelCase{.name = "rope_none", .position = kRope},
        ModelCase{.name = "rope_rms_head_shared", .qk = config::RMS, .position = kRope},
        ModelCase{.name = "rope_rms_head",
                  .qk = config::RMS,
                  .scope = config::HEAD,
                  .norm = config::RMSNORM,
                  .position = kRope},
        ModelCase{.name = "rope_rms_projection",
                  .qk = config::RMS,
                  .scope = config::PROJECTION,
                  .position = kRope},
        ModelCase{.name = "rope_layer_head_shared", .qk = config::LAYER, .position = kRope},
        ModelCase{.name = "rope_layer_head",
                  .qk = config::LAYER,
                  .scope = config::HEAD,
                  .tied = false,
                  .position = kRope},
        ModelCase{.name = "rope_layer_projection",
                  .qk = config::LAYER,
                  .scope = config::PROJECTION,
                  .position = kRope},
        ModelCase{.name = "rope_l2_head_shared", .qk = config::L2, .position = kRope},
        ModelCase{
            .name = "rope_l2_head", .qk = config::L2, .scope = config::HEAD, .position = kRope},
        ModelCase{.name = "rope_l2_projection",
                  .qk = config::L2,
                  .scope = config::PROJECTION,
                  .position = kRope}),
    case_name);

// Gated MLPs, bias-free layers (LayerNorm without bias, LAYER QK-norm without bias) and
// post-sublayer norms, alone and combined.
INSTANTIATE_TEST_SUITE_P(
    Blocks, ModelGrad,
    ::testing::Values(
        ModelCase{.name = "swiglu", .qk = config::RMS, .mlp = config::SWIGLU},
        ModelCase{.name = "geglu", .qk = config::RMS, .scope = config::HEAD, .mlp = config::GEGLU},
        ModelCase{.name = "swiglu_nobias", .mlp = config::SWIGLU, .bias = false},
        ModelCase{.name = "geglu_nobias_rms",
                  .qk = config::L2,
                  .norm = config::RMSNORM,
                  .mlp = config::GEGLU,
                  .bias = false},
        ModelCase{
            .name = "nobias_layer", .qk = config::LAYER, .scope = config::HEAD, .bias = false},
        ModelCase{.name = "nobias_layer_projection",
                  .qk = config::LAYER,
                  .scope = config::PROJECTION,
                  .tied = false,
                  .bias = false},
        ModelCase{.name = "post_sublayer", .qk = config::RMS, .placement = config::POST_SUBLAYER},
        ModelCase{.name = "post_sublayer_none_rms",
                  .tied = false,
                  .norm = config::RMSNORM,
                  .placement = config::POST_SUBLAYER},
        ModelCase{.name = "post_sublayer_geglu_l2",
                  .qk = config::L2,
                  .scope = config::HEAD,
                  .mlp = config::GEGLU,
                  .placement = config::POST_SUBLAYER},
        // OLMo 2: RMSNorm after each sublayer, RMS QK-norm over the whole projection, RoPE,
        // SwiGLU, no biases, untied head.
        ModelCase{.name = "olmo2",
                  .qk = config::RMS,
                  .scope = config::PROJECTION,
                  .tied = false,
                  .norm = config::RMSNORM,
                  .position = kRope,
                  .mlp = config::SWIGLU,
                  .bias = false,
                  .placement = config::POST_SUBLAYER},
        // Qwen3: pre-norm RMSNorm, per-head RMS QK-norm with one shared gain, RoPE, SwiGLU, no
        // biases.
        ModelCase{.name = "qwen3",
                  .qk = config::RMS,
                  .tied = false,
                  .norm = config::RMSNORM,
                  .position = kRope,
                  .mlp = config::SWIGLU,
                  .bias = false}),
    case_name);

// Grouped-query and multi-query attention (Note [gqa layouts] in layers/attention.h): 1 and 2
// k/v heads of 4, in every QK-norm mode, with learned positions and RoPE.
INSTANTIATE_TEST_SUITE_P(
    KvHeads, ModelGrad,
    ::testing::Values(ModelCase{.name = "mqa_none", .norm = config::RMSNORM, .kv_heads = 1},
                      ModelCase{.name = "gqa2_none_rope",
                                .norm = config::RMSNORM,
                                .position = kRope,
                                .kv_heads = 2},
                      ModelCase{.name = "mqa_rms_head_shared",
                                .qk = config::RMS,
                                .norm = config::RMSNORM,
                                .kv_heads = 1},
                      ModelCase{.name = "gqa2_rms_head",
                                .qk = config::RMS,
                                .scope = config::HEAD,
                                .norm = config::RMSNORM,
                                .kv_heads = 2},
                      ModelCase{.name = "mqa_rms_projection",
                                .qk = config::RMS,
                                .scope = config::PROJECTION,
                                .norm = config::RMSNORM,
                                .kv_heads = 1},
                      ModelCase{.name = "gqa2_rms_projection_rope_nobias",
                                .qk = config::RMS,
                                .scope = config::PROJECTION,
                                .norm = config::RMSNORM,
                                .position = kRope,
                                .bias = false,
                                .kv_heads = 2},
                      ModelCase{.name = "gqa2_layer_projection",
                                .qk = config::LAYER,
                                .scope = config::PROJECTION,
                                .norm = config::RMSNORM,
                                .kv_heads = 2},
                      ModelCase{.name = "mqa_l2_head_rope",
                                .qk = config::L2,
                                .scope = config::HEAD,
                                .norm = config::RMSNORM,
                                .position = kRope,
                                .kv_heads = 1}),
    case_name);

// model.head_dim apart from d_model / n_heads: wider heads (4 x 12 = 48 against d_model 32, as
// Qwen3-0.6B's 16 x 128 against 1024; multi-head: 2 x 12 = 24 against 16) and narrower (4 x 6 =
// 24 against 32), with GQA and MQA, per-head and whole-projection QK-norm, and RoPE (which needs
// an even head_dim).
INSTANTIATE_TEST_SUITE_P(HeadDim, ModelGrad,
                         ::testing::Values(ModelCase{.name = "wide_gqa2_rms_head_shared_rope",
                                                     .qk = config::RMS,
                                                     .norm = config::RMSNORM,
                                                     .position = kRope,
                                                     .mlp = config::SWIGLU,
                                                     .bias = false,
                                                     .kv_heads = 2,
                                                     .head_dim = 12},
                                           ModelCase{.name = "wide_mha_layer_projection",
                                                     .qk = config::LAYER,
                                                     .scope = config::PROJECTION,
                                                     .head_dim = 12},
                                           ModelCase{.name = "narrow_mqa_l2_head",
                                                     .qk = config::L2,
                                                     .scope = config::HEAD,
                                                     .norm = config::RMSNORM,
                                                     .kv_heads = 1,
                                                     .head_dim = 6},
                                           ModelCase{.name = "narrow_gqa2_rms_projection_post",
                                                     .qk = config::RMS,
                                                     .scope = config::PROJECTION,
                                                     .norm = config::RMSNORM,
                                                     .position = kRope,
                                                     .placement = config::POST_SUBLAYER,
                                                     .kv_heads = 2,
                                                     .head_dim = 6}),
                         case_name);

// Note [sandwich norms] (layers/gpt.h): a norm before and after each sublayer. A Gemma 3-style
// block (RMSNorm, per-head RMS QK-norm with a shared gain, RoPE, GeGLU, no biases, multi-query
// attention on wider heads) and a LayerNorm one with biases and L2 QK-norm.
INSTANTIATE_TEST_SUITE_P(Sandwich, ModelGrad,
                         ::testing::Values(ModelCase{.name = "gemma3",
                                                     .qk = config::RMS,
                                                     .norm = config::RMSNORM,
                                                     .position = kRope,
                                                     .mlp = config::GEGLU,
                                                     .bias = false,
                                                     .placement = config::SANDWICH,
                                                     .kv_heads = 1,
                                                     .head_dim = 12},
                                           ModelCase{.name = "layernorm_l2_bias",
                                                     .qk = config::L2,
                                                     .scope = config::HEAD,
                                                     .tied = false,
                                                     .placement = config::SANDWICH}),
                         case_name);

}  // namespace
}  // namespace keel
