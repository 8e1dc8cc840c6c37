// The fake device of tests/fake_device.h, which other tests use to prove that code reaches
// Device::kCuda memory only through the backend's copies and an ExecContext: a host access of
// fake-device memory dies with SIGSEGV (and works while the memory is unlocked, so the death is
// the protection's); Tensor's copies, zero fill, slices and to() work on it; every ExecContext
// method run by FakeDeviceExec on fake-device tensors matches cpu_exec() on host tensors bit for
// bit (which checks the forwarding: each argument reaches the kernel in its place); device
// pointer arguments that are not live fake memory are refused; and the registration comes and
// goes with ScopedFakeDevice, leaving make_exec(kCuda) to say the build has no CUDA.
#include "tests/fake_device.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/rope.h"
#include "framework/tensor.h"
#include "tests/test_util.h"

namespace keel {
namespace {

using keel::testing::error_of;
using keel::testing::FakeDeviceBackend;
using keel::testing::FakeDeviceMemory;
using keel::testing::ScopedFakeDevice;
using kernels::AdamWStep;
using kernels::AttentionShape;
using kernels::ExecContext;
using kernels::GluAct;
using kernels::NormOp;
using kernels::NormShape;

// Death tests re-run this binary rather than fork a process that may hold OpenMP threads.
class ThreadsafeDeathTests : public ::testing::Environment {
 public:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new ThreadsafeDeathTests);

// In a death test's child: no core file for the expected SIGSEGV.
void no_core_dump() {
  const rlimit none{0, 0};
  setrlimit(RLIMIT_CORE, &none);
}

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kF32;
  if constexpr (std::is_same_v<T, double>) return DType::kF64;
  return DType::kI32;
}

// The same values twice: on the host for cpu_exec() and on the fake device for FakeDeviceExec.
// p(on_device) picks the side, so one lambda states a call for both.
template <typename T>
struct Twin {
  Tensor host, dev;
  T* p(bool on_device) const { return static_cast<T*>((on_device ? dev : host).raw()); }
  int64_t size() const { return host.numel(); }
};

template <typename T>
Twin<T> twin_of(const std::vector<T>& values) {
  const auto n = static_cast<int64_t>(values.size());
  Twin<T> t{Tensor::zeros({n}, dtype_of<T>(), Device::kCpu),
            Tensor::zeros({n}, dtype_of<T>(), Device::kCuda)};
  t.host.copy_from_host(0, n, values.data());
  t.dev.copy_from_host(0, n, values.data());
  return t;
}

// The device side's elements, read back through the backend.
template <typename T>
std::vector<T> device_values(const Tensor& t) {
  std::vector<T> v(t.numel());
  t.copy_to_host(0, t.numel(), v.data());
  return v;
}

// Both sides bitwise equal; names the first element that differs.
template <typename T>
void expect_same(const Twin<T>& t, const std::string& what) {
  const std::vector<T> d = device_values<T>(t.dev);
  const T* h = static_cast<const T*>(t.host.raw());
  for (int64_t i = 0; i < t.size(); ++i) {
    if (std::memcmp(&h[i], &d[i], sizeof(T)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " of " << t.size() << ": cpu " << h[i]
                    << ", fake device " << d[i];
      return;
    }
  }
}

class FakeDeviceExecTest : public ::testing::Test {
 protected:
  // Random floats in [lo, hi) from one seeded engine: the same values every run.
  std::vector<float> rand(int64_t n, float lo = -1.f, float hi = 1.f) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng_);
    return v;
  }
  Twin<float> rand_twin(int64_t n, float lo = -1.f, float hi = 1.f) {
    return twin_of(rand(n, lo, hi));
  }
  Twin<int32_t> tokens_twin(int64_t n, int32_t below) {
    std::uniform_int_distribution<int32_t> u(0, below - 1);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = u(rng_);
    return twin_of(v);
  }
  // Runs fn(exec, on_device) with the CPU context on host memory, then the fake on its own.
  template <typename Fn>
  void run_both(Fn&& fn) {
    fn(kernels::cpu_exec(), false);
    fn(*dev_, true);
  }

  ScopedFakeDevice fake_;
  std::unique_ptr<ExecContext> dev_ = kernels::make_exec(Device::kCuda);
  std::mt19937 rng_{20240611};
};

TEST_F(FakeDeviceExecTest, IsTheFakeCudaContext) {
  EXPECT_EQ(dev_->device(), Device::kCuda);
  EXPECT_NE(dev_->describe().find("fake"), std::string::npos) << dev_->describe();
  EXPECT_EQ(dev_->threads(), kernels::cpu_exec().threads());
  EXPECT_FALSE(fake_.memory().unlocked());
}

// Small, and large enough that BLAS and OpenMP split the work over threads (which must see the
// memory unlocked too).
class FakeDeviceLinearTest : public FakeDeviceExecTest,
                             public ::testing::WithParamInterface<std::array<int64_t, 3>> {};

TEST_P(FakeDeviceLinearTest, Linear) {
  const int64_t N = GetParam()[0], IC = GetParam()[1], OC = GetParam()[2];
  Twin<float> inp = rand_twin(N * IC), w = rand_twin(OC * IC), b = rand_twin(OC);
  Twin<float> out = rand_twin(N * OC), dout = rand_twin(N * OC);
  Twin<float> dinp = rand_twin(N * IC), dw = rand_twin(OC * IC), db = rand_twin(OC);
  for (bool with_bias : {true, false}) {
    run_both([&](ExecContext& e, bool d) {
      e.linear_forward(out.p(d), inp.p(d), w.p(d), with_bias ? b.p(d) : nullptr, N, IC, OC);
    });
    expect_same(out, with_bias ? "linear_forward" : "linear_forward without bias");
  }
  for (bool accumulate : {false, true}) {
    run_both([&](ExecContext& e, bool d) {
      e.linear_backward(dinp.p(d), accumulate, dw.p(d), db.p(d), dout.p(d), inp.p(d), w.p(d), N, IC,
                        OC);
    });
    expect_same(dinp, "linear_backward dinp");
    expect_same(dw, "linear_backward dweight");
    expect_same(db, "linear_backward dbias");
  }
  run_both([&](ExecContext& e, bool d) {
    e.linear_backward(nullptr, false, dw.p(d), nullptr, dout.p(d), inp.p(d), w.p(d), N, IC, OC);
  });
  expect_same(dw, "linear_backward dweight only");
}

INSTANTIATE_TEST_SUITE_P(Shapes, FakeDeviceLinearTest,
                         ::testing::Values(std::array<int64_t, 3>{7, 13, 11},
                                           std::array<int64_t, 3>{256, 384, 320}));

TEST_F(FakeDeviceExecTest, LoadTokens) {
  std::vector<int32_t> host_tokens = {3, 1, 4, 1, 5, 9, 2, 6, 5};
  Twin<int32_t> dst = twin_of(std::vector<int32_t>(host_tokens.size(), -1));
  run_both([&](ExecContext& e, bool d) {
    e.load_tokens(dst.p(d), host_tokens.data(), static_cast<int64_t>(host_tokens.size()));
  });
  expect_same(dst, "load_tokens");
  EXPECT_EQ(device_values<int32_t>(dst.dev), host_tokens);
}

TEST_F(FakeDeviceExecTest, Elementwise) {
  const int64_t N = 17, C = 59, n = N * C;
  Twin<float> x = rand_twin(n, -4.f, 4.f), y = rand_twin(n), dout = rand_twin(n);
  Twin<float> out = rand_twin(n), dinp = rand_twin(n), dbias = rand_twin(C);
  run_both([&](ExecContext& e, bool d) { e.gelu_forward(out.p(d), x.p(d), n); });
  expect_same(out, "gelu_forward");
  run_both([&](ExecContext& e, bool d) {
    e.gelu_backward(dinp.p(d), nullptr, x.p(d), dout.p(d), N, C);
  });
  expect_same(dinp, "gelu_backward");
  run_both([&](ExecContext& e, bool d) {
    e.gelu_backward(dinp.p(d), dbias.p(d), x.p(d), dout.p(d), N, C);
  });
  expect_same(dinp, "gelu_backward with dbias");
  expect_same(dbias, "gelu_backward dbias");
  run_both([&](ExecContext& e, bool d) { e.add(out.p(d), x.p(d), y.p(d), n); });
  expect_same(out, "add");
  run_both([&](ExecContext& e, bool d) { e.add_inplace(y.p(d), x.p(d), n); });
  expect_same(y, "add_inplace");

  Twin<double> ss = twin_of(std::vector<double>{0.5});
  for (bool accumulate : {false, true}) {
    run_both([&](ExecContext& e, bool d) { e.sum_squares(x.p(d), n, ss.p(d), accumulate); });
    expect_same(ss, accumulate ? "sum_squares accumulate" : "sum_squares");
  }
  EXPECT_GT(device_values<double>(ss.dev)[0], 0.0);
}

TEST_F(FakeDeviceExecTest, Glu) {
  const int64_t N = 11, C = 47, n = N * C;
  for (GluAct act : {GluAct::kSilu, GluAct::kGelu}) {
    const std::string name = act == GluAct::kSilu ? "silu" : "gelu";
    Twin<float> gate = rand_twin(n, -3.f, 3.f), up = rand_twin(n), out = rand_twin(n);
    Twin<float> dout = rand_twin(n), dgate = rand_twin(n), dup = rand_twin(n);
    Twin<float> dgate_bias = rand_twin(C), dup_bias = rand_twin(C);
    run_both([&](ExecContext& e, bool d) { e.glu_forward(act, out.p(d), gate.p(d), up.p(d), n); });
    expect_same(out, "glu_forward " + name);
    run_both([&](ExecContext& e, bool d) {
      e.glu_backward(act, dgate.p(d), dup.p(d), dgate_bias.p(d), dup_bias.p(d), dout.p(d),
                     gate.p(d), up.p(d), N, C);
    });
    expect_same(dgate, "glu_backward dgate " + name);
    expect_same(dup, "glu_backward dup " + name);
    expect_same(dgate_bias, "glu_backward dgate_bias " + name);
    expect_same(dup_bias, "glu_backward dup_bias " + name);
    // In place: dup = dout, and out = up.
    run_both([&](ExecContext& e, bool d) {
      e.glu_backward(act, dgate.p(d), dout.p(d), nullptr, nullptr, dout.p(d), gate.p(d), up.p(d), N,
                     C);
    });
    expect_same(dout, "glu_backward in place " + name);
    run_both([&](ExecContext& e, bool d) { e.glu_forward(act, up.p(d), gate.p(d), up.p(d), n); });
    expect_same(up, "glu_forward in place " + name);
  }
}

TEST_F(FakeDeviceExecTest, Norms) {
  const int64_t N = 5, G = 3, Cg = 8;
  for (NormOp op : {NormOp::kLayer, NormOp::kRms, NormOp::kL2}) {
    for (int64_t w_stride : {int64_t{0}, Cg}) {
      const std::string name = std::string(op == NormOp::kLayer ? "layer"
                                           : op == NormOp::kRms ? "rms"
                                                                : "l2") +
                               (w_stride ? " per-group gain" : " shared gain");
      const NormShape s{N, G, Cg, G * Cg + 4, G * Cg + 2, w_stride};
      const int64_t nw = w_stride ? G * Cg : Cg;
      const bool has_gain = op != NormOp::kL2, has_bias = op == NormOp::kLayer;
      Twin<float> inp = rand_twin(N * s.ld_in), w = rand_twin(nw, 0.5f, 1.5f), b = rand_twin(nw);
      Twin<float> out = rand_twin(N * s.ld_out), mean = rand_twin(N * G), rstd = rand_twin(N * G);
      Twin<float> dout = rand_twin(N * s.ld_out), dinp = rand_twin(N * s.ld_in);
      Twin<float> dw = rand_twin(nw), db = rand_twin(nw);
      auto gain = [&](bool d) { return has_gain ? w.p(d) : nullptr; };
      auto bias = [&](bool d) { return has_bias ? b.p(d) : nullptr; };
      auto dgain = [&](bool d) { return has_gain ? dw.p(d) : nullptr; };
      auto dbias = [&](bool d) { return has_bias ? db.p(d) : nullptr; };

      run_both([&](ExecContext& e, bool d) {
        e.norm_forward(op, s, out.p(d), inp.p(d), gain(d), bias(d), mean.p(d), rstd.p(d), 1e-5f);
      });
      expect_same(out, "norm_forward out " + name);
      expect_same(mean, "norm_forward mean " + name);
      expect_same(rstd, "norm_forward rstd " + name);
      for (bool accumulate : {false, true}) {
        run_both([&](ExecContext& e, bool d) {
          e.norm_backward(op, s, dinp.p(d), accumulate, dgain(d), dbias(d), dout.p(d), inp.p(d),
                          gain(d), mean.p(d), rstd.p(d));
        });
        expect_same(dinp, "norm_backward dinp " + name);
        expect_same(dw, "norm_backward dweight " + name);
        expect_same(db, "norm_backward dbias " + name);
      }

      // The split forms, as one rank holding the whole row (Cg_total = Cg).
      Twin<float> stats = rand_twin(2 * N * G), part = rand_twin(2 * N * G);
      run_both([&](ExecContext& e, bool d) { e.norm_partial_stats(s, inp.p(d), stats.p(d)); });
      expect_same(stats, "norm_partial_stats " + name);
      run_both([&](ExecContext& e, bool d) {
        e.norm_forward_from_stats(op, s, Cg, stats.p(d), out.p(d), inp.p(d), gain(d), bias(d),
                                  mean.p(d), rstd.p(d), 1e-5f);
      });
      expect_same(out, "norm_forward_from_stats out " + name);
      expect_same(rstd, "norm_forward_from_stats rstd " + name);
      run_both([&](ExecContext& e, bool d) {
        e.norm_backward_partials(s, dout.p(d), inp.p(d), gain(d), mean.p(d), rstd.p(d), part.p(d));
      });
      expect_same(part, "norm_backward_partials " + name);
      for (bool accumulate : {false, true}) {
        run_both([&](ExecContext& e, bool d) {
          e.norm_backward_from_partials(op, s, Cg, part.p(d), dinp.p(d), accumulate, dgain(d),
                                        dbias(d), dout.p(d), inp.p(d), gain(d), mean.p(d),
                                        rstd.p(d));
        });
        expect_same(dinp, "norm_backward_from_partials dinp " + name);
        expect_same(dw, "norm_backward_from_partials dweight " + name);
        expect_same(db, "norm_backward_from_partials dbias " + name);
      }
    }
  }
}

TEST_F(FakeDeviceExecTest, Attention) {
  // q, k, v packed in one qkv row as the attention layer keeps them; out has its own stride.
  const int64_t B = 2, T = 6, H = 3, D = 4, C = H * D;
  const AttentionShape s{B, T, H, D, 3 * C, 3 * C, 3 * C, C};
  ExecContext& cpu = kernels::cpu_exec();
  // What the forward saves and the backward's workspace are each context's own size.
  const int64_t saved_cpu = cpu.attention_saved_elems(s),
                saved_dev = dev_->attention_saved_elems(s);
  const int64_t ws_cpu = cpu.attention_workspace_elems(s);
  const int64_t ws_dev = dev_->attention_workspace_elems(s);
  Tensor saved[2] = {Tensor::zeros({saved_cpu}),
                     Tensor::zeros({saved_dev}, DType::kF32, Device::kCuda)};
  Tensor workspace[2] = {Tensor::zeros({ws_cpu}),
                         Tensor::zeros({ws_dev}, DType::kF32, Device::kCuda)};
  auto saved_p = [&](bool d) { return saved[d].f32(); };
  auto ws_p = [&](bool d) { return workspace[d].f32(); };

  Twin<float> qkv = rand_twin(B * T * 3 * C, -2.f, 2.f), gain = rand_twin(H, 0.5f, 2.f);
  Twin<float> scale = rand_twin(H), out = rand_twin(B * T * C), max_logit = rand_twin(1);
  Twin<float> dout = rand_twin(B * T * C), dqkv = rand_twin(B * T * 3 * C);
  Twin<float> dscale = rand_twin(H), dgain = rand_twin(H);
  for (bool shared : {false, true}) {
    const std::string name = shared ? " shared gain" : " per-head gain";
    run_both([&](ExecContext& e, bool d) {
      e.attention_scales(scale.p(d), gain.p(d), H, shared, 0.5f);
    });
    expect_same(scale, "attention_scales" + name);
    run_both([&](ExecContext& e, bool d) {
      const float* qkv_p = qkv.p(d);
      e.attention_forward(s, out.p(d), saved_p(d), qkv_p, qkv_p + C, qkv_p + 2 * C, scale.p(d),
                          max_logit.p(d));
    });
    expect_same(out, "attention_forward out" + name);
    expect_same(max_logit, "attention_forward max_abs_logit" + name);
    for (bool with_dscale : {true, false}) {
      run_both([&](ExecContext& e, bool d) {
        const float* qkv_p = qkv.p(d);
        float* dqkv_p = dqkv.p(d);
        e.attention_backward(s, dqkv_p, dqkv_p + C, dqkv_p + 2 * C,
                             with_dscale ? dscale.p(d) : nullptr, dout.p(d), out.p(d), saved_p(d),
                             qkv_p, qkv_p + C, qkv_p + 2 * C, scale.p(d), ws_p(d));
      });
      expect_same(dqkv, "attention_backward dq dk dv" + name);
      expect_same(dscale, "attention_backward dscale" + name);
    }
    run_both([&](ExecContext& e, bool d) {
      e.scale_grad_accumulate(dgain.p(d), dscale.p(d), H, shared);
    });
    expect_same(dgain, "scale_grad_accumulate" + name);
  }
  // The default scale (no learned gain).
  run_both(
      [&](ExecContext& e, bool d) { e.attention_scales(scale.p(d), nullptr, H, false, 0.5f); });
  expect_same(scale, "attention_scales default");
  EXPECT_EQ(device_values<float>(scale.dev), std::vector<float>(H, 0.5f));
}

TEST_F(FakeDeviceExecTest, Rope) {
  const int64_t B = 2, T = 5, H = 3, D = 8, stride = 3 * H * D;
  const kernels::RopeTable table = kernels::make_rope_table(T, D, 10000.0);
  Twin<float> x = rand_twin(B * T * stride), y = rand_twin(B * T * stride);
  // Out of place at an offset (k inside a packed qkv row), then in place.
  run_both([&](ExecContext& e, bool d) {
    e.rope_forward(table, y.p(d) + H * D, x.p(d) + H * D, B, T, H, D, stride);
  });
  expect_same(y, "rope_forward");
  run_both(
      [&](ExecContext& e, bool d) { e.rope_forward(table, x.p(d), x.p(d), B, T, H, D, stride); });
  expect_same(x, "rope_forward in place");
  run_both([&](ExecContext& e, bool d) {
    e.rope_backward(table, x.p(d) + H * D, y.p(d) + H * D, B, T, H, D, stride);
  });
  expect_same(x, "rope_backward");
  run_both(
      [&](ExecContext& e, bool d) { e.rope_backward(table, y.p(d), y.p(d), B, T, H, D, stride); });
  expect_same(y, "rope_backward in place");
}

TEST_F(FakeDeviceExecTest, Embedding) {
  // A vocab shard [5, 22) of 30: some tokens fall outside it.
  const int64_t N = 9, C = 6, v_begin = 5, V_local = 17, B = 3, T = 3;
  Twin<int32_t> tokens = tokens_twin(N, 30);
  Twin<float> wte = rand_twin(V_local * C), out = rand_twin(N * C), dout = rand_twin(N * C);
  Twin<float> dwte = rand_twin(V_local * C), wpe = rand_twin(T * C), dwpe = rand_twin(T * C);
  run_both([&](ExecContext& e, bool d) {
    e.embedding_forward(out.p(d), tokens.p(d), N, wte.p(d), v_begin, V_local, C);
  });
  expect_same(out, "embedding_forward");
  run_both([&](ExecContext& e, bool d) {
    e.embedding_backward(dwte.p(d), dout.p(d), tokens.p(d), N, v_begin, V_local, C);
  });
  expect_same(dwte, "embedding_backward");
  run_both([&](ExecContext& e, bool d) { e.position_forward(out.p(d), wpe.p(d), B, T, C); });
  expect_same(out, "position_forward");
  run_both([&](ExecContext& e, bool d) { e.position_backward(dwpe.p(d), dout.p(d), B, T, C); });
  expect_same(dwpe, "position_backward");
}

TEST_F(FakeDeviceExecTest, CrossEntropy) {
  // A vocab shard [10, 30) with 3 padding columns; targets in [0, 35) fall in and out of it.
  const int64_t N = 6, V_local = 20, v_valid = 17, v_begin = 10;
  Twin<float> logits = rand_twin(N * V_local, -5.f, 5.f);
  Twin<int32_t> targets = tokens_twin(N, 35);
  Twin<float> row_max = rand_twin(N), sumexp = rand_twin(N), target = rand_twin(N);
  Twin<float> lse = rand_twin(N), dlogits = rand_twin(N * V_local);
  Twin<double> sums = twin_of(std::vector<double>{1.0, 2.0, 3.0});
  run_both([&](ExecContext& e, bool d) {
    e.xent_row_max(logits.p(d), N, V_local, v_valid, row_max.p(d));
  });
  expect_same(row_max, "xent_row_max");
  run_both([&](ExecContext& e, bool d) {
    e.xent_row_sumexp(logits.p(d), row_max.p(d), N, V_local, v_valid, sumexp.p(d));
  });
  expect_same(sumexp, "xent_row_sumexp");
  Twin<float> row_max2 = rand_twin(N), sumexp2 = rand_twin(N);
  run_both([&](ExecContext& e, bool d) {
    e.xent_row_max_sumexp(logits.p(d), N, V_local, v_valid, row_max2.p(d), sumexp2.p(d));
  });
  expect_same(row_max2, "xent_row_max_sumexp max");
  expect_same(sumexp2, "xent_row_max_sumexp sum-exp");
  EXPECT_EQ(device_values<float>(row_max2.dev), device_values<float>(row_max.dev));
  EXPECT_EQ(device_values<float>(sumexp2.dev), device_values<float>(sumexp.dev));
  Twin<float> fused = twin_of(device_values<float>(logits.dev)), row_max3 = rand_twin(N);
  Twin<float> sumexp3 = rand_twin(N);
  run_both([&](ExecContext& e, bool d) {
    e.xent_fused(fused.p(d), fused.p(d), targets.p(d), N, V_local, v_valid, v_begin, 0.25f, 1e-3f,
                 row_max3.p(d), sumexp3.p(d));
  });
  expect_same(fused, "xent_fused dlogits");
  expect_same(row_max3, "xent_fused max");
  expect_same(sumexp3, "xent_fused sum-exp");
  run_both([&](ExecContext& e, bool d) {
    e.xent_target_logit(logits.p(d), targets.p(d), N, V_local, v_begin, target.p(d));
  });
  expect_same(target, "xent_target_logit");
  run_both([&](ExecContext& e, bool d) {
    e.xent_finish(row_max.p(d), sumexp.p(d), target.p(d), N, lse.p(d), sums.p(d));
  });
  expect_same(lse, "xent_finish lse");
  expect_same(sums, "xent_finish sums");
  run_both([&](ExecContext& e, bool d) {
    e.xent_backward(dlogits.p(d), logits.p(d), lse.p(d), targets.p(d), N, V_local, v_valid, v_begin,
                    0.25f, 1e-4f);
  });
  expect_same(dlogits, "xent_backward");
  // lse aliasing sumexp, and dlogits aliasing logits, as the header allows.
  run_both([&](ExecContext& e, bool d) {
    e.xent_finish(row_max.p(d), sumexp.p(d), target.p(d), N, sumexp.p(d), sums.p(d));
  });
  expect_same(sumexp, "xent_finish in place");
  run_both([&](ExecContext& e, bool d) {
    e.xent_backward(logits.p(d), logits.p(d), sumexp.p(d), targets.p(d), N, V_local, v_valid,
                    v_begin, 0.25f, 1e-4f);
  });
  expect_same(logits, "xent_backward in place");
}

TEST_F(FakeDeviceExecTest, AdamW) {
  const int64_t n = 4099;
  Twin<float> param = rand_twin(n), grad = rand_twin(n), m = rand_twin(n);
  Twin<float> v = rand_twin(n, 0.f, 0.1f);
  for (int64_t t = 1; t <= 3; ++t) {
    const AdamWStep step{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t};
    run_both([&](ExecContext& e, bool d) {
      e.adamw_update(param.p(d), grad.p(d), m.p(d), v.p(d), n, step);
    });
  }
  expect_same(param, "adamw_update param");
  expect_same(m, "adamw_update m");
  expect_same(v, "adamw_update v");
}

// What the fake refuses: device arguments that are host memory or freed fake memory, and host
// buffers of the backend's copies that are fake memory. Each refusal leaves the memory locked.
TEST_F(FakeDeviceExecTest, RefusesPointersThatAreNotLiveDeviceMemory) {
  Tensor a = Tensor::zeros({64}, DType::kF32, Device::kCuda);
  std::vector<float> host(64, 1.f);
  std::string message =
      error_of(ErrorKind::kInternal, [&] { dev_->add(a.f32(), a.f32(), host.data(), 64); });
  EXPECT_NE(message.find("FakeDeviceExec::add: device pointer argument 2"), std::string::npos)
      << message;
  EXPECT_FALSE(fake_.memory().unlocked());

  float* freed = nullptr;
  {
    Tensor gone = Tensor::zeros({64}, DType::kF32, Device::kCuda);
    freed = gone.f32();
  }
  message = error_of(ErrorKind::kInternal, [&] { dev_->gelu_forward(a.f32(), freed, 64); });
  EXPECT_NE(message.find("not inside a live fake-device allocation"), std::string::npos) << message;

  const std::vector<int32_t> tokens(4, 1);
  std::vector<int32_t> host_dst(4);
  Tensor t = Tensor::zeros({4}, DType::kI32, Device::kCuda);
  error_of(ErrorKind::kInternal, [&] { dev_->load_tokens(host_dst.data(), tokens.data(), 4); });
  error_of(ErrorKind::kInternal, [&] { dev_->load_tokens(t.i32(), t.i32(), 4); });

  std::shared_ptr<DeviceBackend> backend = device_backend(Device::kCuda, "test");
  Tensor b = Tensor::zeros({64}, DType::kF32, Device::kCuda);
  message = error_of(ErrorKind::kInternal, [&] { backend->copy_to_host(b.raw(), a.raw(), 256); });
  EXPECT_NE(message.find("host buffer dst"), std::string::npos) << message;
  message =
      error_of(ErrorKind::kInternal, [&] { backend->copy_from_host(a.raw(), host.data(), 257); });
  EXPECT_NE(message.find("copy_from_host: dst"), std::string::npos) << message;
  error_of(ErrorKind::kInternal, [&] { backend->zero(host.data(), 4); });
  EXPECT_FALSE(fake_.memory().unlocked());
}

// ---- the memory and its protection ----

// A fake-device tensor holding 0, 1, .., n-1, written through the backend.
Tensor iota_on_device(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  Tensor t = Tensor::zeros({n}, DType::kF32, Device::kCuda);
  t.copy_from_host(0, n, v.data());
  return t;
}

float read_float(const float* p) { return *static_cast<const volatile float*>(p); }
void write_float(float* p, float x) { *static_cast<volatile float*>(p) = x; }

TEST(FakeDeviceDeathTest, HostReadOfDeviceMemoryDies) {
  ScopedFakeDevice fake;
  Tensor t = iota_on_device(1000);
  EXPECT_EXIT(
      {
        no_core_dump();
        std::printf("%f\n", read_float(t.f32() + 3));
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  // A slice's pointer, and the last element of a block, are protected the same way.
  EXPECT_EXIT(
      {
        no_core_dump();
        std::printf("%f\n", read_float(t.slice(999, {1}).f32()));
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

TEST(FakeDeviceDeathTest, HostWriteOfDeviceMemoryDies) {
  ScopedFakeDevice fake;
  Tensor t = iota_on_device(16);
  EXPECT_EXIT(
      {
        no_core_dump();
        write_float(t.f32(), 1.f);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

// The positive control: the same reads succeed while unlocked, so the deaths above are the
// protection's and not a bad pointer's; unlocks nest; and every kernel call locks again.
TEST(FakeDeviceDeathTest, UnlockedReadsWorkAndKernelCallsRelock) {
  ScopedFakeDevice fake;
  Tensor t = iota_on_device(1000);
  {
    FakeDeviceMemory::Unlocked outer(fake.memory());
    {
      FakeDeviceMemory::Unlocked inner(fake.memory());
      EXPECT_EQ(read_float(t.f32() + 3), 3.f);
    }
    EXPECT_TRUE(fake.memory().unlocked());  // the inner scope's end did not lock
    EXPECT_EQ(read_float(t.f32() + 999), 999.f);
    // Memory allocated while unlocked past the used part is open at once.
    Tensor big = Tensor::zeros({int64_t{1} << 22}, DType::kF32, Device::kCuda);
    write_float(big.f32() + (int64_t{1} << 22) - 1, 7.f);
    EXPECT_EQ(read_float(big.f32() + (int64_t{1} << 22) - 1), 7.f);
  }
  EXPECT_FALSE(fake.memory().unlocked());
  EXPECT_EXIT(
      {
        no_core_dump();
        std::printf("%f\n", read_float(t.f32() + 3));
      },
      ::testing::KilledBySignal(SIGSEGV), "");

  std::unique_ptr<ExecContext> exec = kernels::make_exec(Device::kCuda);
  Tensor out = Tensor::zeros({1000}, DType::kF32, Device::kCuda);
  exec->add(out.f32(), t.f32(), t.f32(), 1000);
  EXPECT_EQ(device_values<float>(out)[999], 1998.f);
  EXPECT_FALSE(fake.memory().unlocked());
  EXPECT_EXIT(
      {
        no_core_dump();
        std::printf("%f\n", read_float(out.f32() + 999));
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

TEST(FakeDeviceTensorTest, CopiesZeroSlicesAndTo) {
  ScopedFakeDevice fake;
  const FakeDeviceMemory::Stats before = fake.memory().stats();
  Tensor t = iota_on_device(37);
  EXPECT_EQ(t.device(), Device::kCuda);
  EXPECT_TRUE(fake.memory().in_region(t.raw()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);

  std::vector<float> part(5);
  t.copy_to_host(30, 5, part.data());
  EXPECT_EQ(part, (std::vector<float>{30, 31, 32, 33, 34}));
  const std::vector<float> neg = {-1, -2, -3};
  t.copy_from_host(10, 3, neg.data());
  t.slice(20, {4}).zero_();
  std::vector<float> all = device_values<float>(t);
  for (int64_t i = 0; i < 37; ++i) {
    const float want = i >= 10 && i < 13   ? -static_cast<float>(i - 9)
                       : i >= 20 && i < 24 ? 0.f
                                           : static_cast<float>(i);
    EXPECT_EQ(all[i], want) << "element " << i;
  }

  // Device -> host, host -> device, device -> device: same elements each way.
  Tensor on_host = t.to(Device::kCpu);
  EXPECT_EQ(on_host.device(), Device::kCpu);
  EXPECT_EQ(std::vector<float>(on_host.f32(), on_host.f32() + 37), all);
  Tensor back = on_host.to(Device::kCuda);
  Tensor copy = back.to(Device::kCuda);
  EXPECT_NE(copy.raw(), back.raw());
  EXPECT_EQ(device_values<float>(back), all);
  EXPECT_EQ(device_values<float>(copy), all);

  // Other dtypes, and zeros() really zero-fills (allocate() itself fills with 0xFF).
  Tensor d = Tensor::zeros({3}, DType::kF64, Device::kCuda);
  EXPECT_EQ(device_values<double>(d), std::vector<double>(3, 0.0));
  Tensor i = Tensor::zeros({5}, DType::kI32, Device::kCuda);
  const std::vector<int32_t> ints = {7, -8, 9, 10, -11};
  i.copy_from_host(0, 5, ints.data());
  EXPECT_EQ(device_values<int32_t>(i.to(Device::kCpu).to(Device::kCuda)), ints);

  const FakeDeviceMemory::Stats during = fake.memory().stats();
  EXPECT_EQ(during.live_blocks - before.live_blocks, 5);  // t, back, copy, d, i
  EXPECT_FALSE(fake.memory().unlocked());
}

TEST(FakeDeviceTensorTest, FreedBlocksAreReusedAndLiveCountsReturn) {
  ScopedFakeDevice fake;
  FakeDeviceMemory& memory = fake.memory();
  const FakeDeviceMemory::Stats before = memory.stats();
  void* first = nullptr;
  {
    Tensor big = Tensor::zeros({int64_t{3} << 20}, DType::kF32, Device::kCuda);  // 12 MiB
    first = big.raw();
    big.copy_from_host(0, 1, std::vector<float>{5.f}.data());
    EXPECT_EQ(memory.stats().live_blocks, before.live_blocks + 1);
  }
  EXPECT_EQ(memory.stats().live_blocks, before.live_blocks);
  EXPECT_EQ(memory.stats().live_bytes, before.live_bytes);
  const size_t used = memory.stats().used_bytes;
  Tensor again = Tensor::zeros({int64_t{3} << 20}, DType::kF32, Device::kCuda);
  EXPECT_EQ(again.raw(), first);  // the block came back from its size class's free list
  EXPECT_EQ(memory.stats().used_bytes, used);
  std::vector<float> head(1);
  again.copy_to_host(0, 1, head.data());
  EXPECT_EQ(head[0], 0.f);
}

TEST(FakeDeviceTensorTest, AllocateDoesNotZeroFill) {
  ScopedFakeDevice fake;
  std::shared_ptr<DeviceBackend> backend = device_backend(Device::kCuda, "test");
  void* p = backend->allocate(100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  unsigned char bytes[100];
  backend->copy_to_host(bytes, p, 100);
  for (unsigned char b : bytes) ASSERT_EQ(b, 0xFF);
  backend->deallocate(p);
}

// ---- registration ----

TEST(FakeDeviceRegistrationTest, WithoutTheFakeThereIsNoCudaContext) {
  if (kernels::has_exec_factory(Device::kCuda)) {
    GTEST_SKIP() << "a CUDA execution context factory is registered in this binary";
  }
  const std::string message =
      error_of(ErrorKind::kConfig, [] { kernels::make_exec(Device::kCuda); });
  EXPECT_NE(message.find("built without CUDA"), std::string::npos) << message;
}

TEST(FakeDeviceRegistrationTest, ScopesNestAndRestoreWhatWasThere) {
  if (kernels::has_exec_factory(Device::kCuda)) {
    GTEST_SKIP() << "a CUDA execution context factory is registered in this binary";
  }
  // A backend registered before the fake comes back after it.
  auto before = std::make_shared<FakeDeviceBackend>();
  std::shared_ptr<DeviceBackend> original = set_device_backend(Device::kCuda, before);
  {
    ScopedFakeDevice outer;
    EXPECT_NE(device_backend(Device::kCuda, "test").get(), before.get());
    {
      ScopedFakeDevice inner;
      EXPECT_EQ(kernels::make_exec(Device::kCuda)->device(), Device::kCuda);
    }
    EXPECT_TRUE(kernels::has_exec_factory(Device::kCuda));  // the outer scope still holds it
    EXPECT_EQ(kernels::make_exec(Device::kCuda, 1)->describe().find("fake CUDA 1"), 0u);
  }
  EXPECT_FALSE(kernels::has_exec_factory(Device::kCuda));
  EXPECT_EQ(device_backend(Device::kCuda, "test").get(), before.get());
  set_device_backend(Device::kCuda, original);
  EXPECT_EQ(has_device_backend(Device::kCuda), original != nullptr);
}

TEST(FakeDeviceRegistrationTest, TensorsOutliveTheScope) {
  Tensor t;
  {
    ScopedFakeDevice fake;
    t = iota_on_device(8);
  }
  // The tensor keeps its backend: its copies still work after the registration is gone.
  EXPECT_EQ(device_values<float>(t)[7], 7.f);
}

}  // namespace
}  // namespace keel
