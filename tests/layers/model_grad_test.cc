// Whole-model gradient check: keel::GPT's backward against central finite differences of its
// float32 loss (ce + z_loss), for every QK-norm mode and scope, on a sample of elements of every
// parameter tensor; plus bit-for-bit determinism of forward and backward.
//
// Tolerance. The loss is computed in float32 (logits, lse and target logits are floats, summed in
// double), so one evaluation carries rounding noise of ~1e-7 of |loss| ~ 3.5, i.e. ~4e-7. With
// h = 1e-2 the FD rounding noise is ~4e-7 / 1e-2 ~ 4e-5 and the truncation error h^2 |L'''| / 6 is
// of the same order for this init, so we accept
//     |fd - g| <= 2e-2 * max(|g|, |fd|) + 2e-4
// (observed worst relative error over elements above 10x the floor: ~4e-3).
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
  config::QkNorm qk;
  config::QkNormScope scope;
  bool tied;
  config::NormKind norm;
  const char* name;
};

// gtest prints a parameter by name rather than as bytes.
void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }

config::KeelConfig tiny_config(const ModelCase& c) {
  config::KeelConfig cfg;
  config::Model* m = cfg.mutable_model();
  m->set_vocab_size(32);
  m->set_seq_len(8);
  m->set_d_model(16);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_d_ff(32);
  m->set_qk_norm(c.qk);
  m->set_qk_norm_scope(c.scope);
  m->set_tie_embeddings(c.tied);
  m->set_norm(c.norm);
  m->set_max_positions(0);
  m->set_init_std(0.3f);
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
    // Evenly spaced strata (so q, k and v rows of a QKV weight are all visited), a random element
    // within each; small tensors are checked completely.
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
      *p = p0 + kStep;
      const double lp = total_loss(model, batch_);
      *p = p0 - kStep;
      const double lm = total_loss(model, batch_);
      *p = p0;
      // The step actually taken in float (p0 +- h rounds).
      const double h2 = static_cast<double>(p0 + kStep) - static_cast<double>(p0 - kStep);
      const double fd = (lp - lm) / h2;
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

INSTANTIATE_TEST_SUITE_P(
    AllModes, ModelGrad,
    ::testing::Values(
        ModelCase{config::NONE, config::HEAD_SHARED, true, config::LAYERNORM, "none"},
        ModelCase{config::NONE, config::HEAD_SHARED, false, config::RMSNORM, "none_untied_rms"},
        ModelCase{config::RMS, config::HEAD_SHARED, true, config::LAYERNORM, "rms_head_shared"},
        ModelCase{config::RMS, config::HEAD, true, config::LAYERNORM, "rms_head"},
        ModelCase{config::RMS, config::PROJECTION, true, config::RMSNORM, "rms_projection"},
        ModelCase{config::LAYER, config::HEAD_SHARED, true, config::LAYERNORM, "layer_head_shared"},
        ModelCase{config::LAYER, config::HEAD, false, config::LAYERNORM, "layer_head"},
        ModelCase{config::LAYER, config::PROJECTION, true, config::LAYERNORM, "layer_projection"},
        ModelCase{config::L2, config::HEAD_SHARED, true, config::LAYERNORM, "l2_head_shared"},
        ModelCase{config::L2, config::HEAD, true, config::RMSNORM, "l2_head"},
        ModelCase{config::L2, config::PROJECTION, true, config::LAYERNORM, "l2_projection"}),
    [](const ::testing::TestParamInfo<ModelCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace keel
