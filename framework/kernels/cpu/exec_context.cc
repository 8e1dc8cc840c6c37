// The CPU execution context (the reference every device context is tested against) and the
// registry of device context factories.
#include "framework/kernels/exec_context.h"

#include <cstring>
#include <mutex>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/cross_entropy.h"
#include "framework/kernels/elementwise.h"
#include "framework/kernels/embedding.h"
#include "framework/kernels/gemm.h"

namespace keel::kernels {

namespace {

class CpuExec final : public ExecContext {
 public:
  Device device() const override { return Device::kCpu; }
  std::string describe() const override {
    return "CPU, " + std::to_string(num_threads()) + " threads";
  }
  int threads() const override { return num_threads(); }
  void synchronize() override {}

  void linear_forward(ActOut out, ActIn inp, const float* weight, const float* bias, int64_t N,
                      int64_t IC, int64_t OC) override {
    kernels::linear_forward<float>(act_f32(out, "linear_forward", "out"),
                                   act_f32(inp, "linear_forward", "inp"), weight, bias, N, IC, OC);
  }
  void linear_backward(ActOut dinp, bool accumulate_dinp, float* dweight, float* dbias, ActIn dout,
                       ActIn inp, const float* weight, int64_t N, int64_t IC, int64_t OC) override {
    kernels::linear_backward<float>(act_f32(dinp, "linear_backward", "dinp"), accumulate_dinp,
                                    dweight, dbias, act_f32(dout, "linear_backward", "dout"),
                                    act_f32(inp, "linear_backward", "inp"), weight, N, IC, OC);
  }
  void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) override {
    kernels::load_tokens(dst, host_src, n);
  }

  void gelu_forward(ActOut out, ActIn inp, int64_t n) override {
    kernels::gelu_forward(act_f32(out, "gelu_forward", "out"), act_f32(inp, "gelu_forward", "inp"),
                          n);
  }
  void gelu_backward(ActOut dinp, float* dbias, ActIn inp, ActIn dout, int64_t N,
                     int64_t C) override {
    float* d = act_f32(dinp, "gelu_backward", "dinp");
    kernels::gelu_backward(d, act_f32(inp, "gelu_backward", "inp"),
                           act_f32(dout, "gelu_backward", "dout"), N * C);
    if (dbias != nullptr) kernels::column_sum_add<float>(dbias, d, N, C, C);
  }
  void add(float* out, const float* a, ActIn b, int64_t n) override {
    kernels::add(out, a, act_f32(b, "add", "b"), n);
  }
  void copy_to_f32(float* out, ActIn in, int64_t n) override {
    const float* src = act_f32(in, "copy_to_f32", "in");
    if (out != src && n > 0) std::memmove(out, src, static_cast<size_t>(n) * sizeof(float));
  }
  void add_inplace(float* y, const float* x, int64_t n) override { kernels::add_inplace(y, x, n); }
  void glu_forward(GluAct act, ActOut out, const float* gate, const float* up, int64_t n) override {
    kernels::glu_forward(act, act_f32(out, "glu_forward", "out"), gate, up, n);
  }
  void glu_backward(GluAct act, ActOut dgate, ActOut dup, float* dgate_bias, float* dup_bias,
                    const float* dout, const float* gate, const float* up, int64_t N,
                    int64_t C) override {
    float* dg = act_f32(dgate, "glu_backward", "dgate");
    float* du = act_f32(dup, "glu_backward", "dup");
    kernels::glu_backward(act, dg, du, dout, gate, up, N * C);
    if (dgate_bias != nullptr) kernels::column_sum_add<float>(dgate_bias, dg, N, C, C);
    if (dup_bias != nullptr) kernels::column_sum_add<float>(dup_bias, du, N, C, C);
  }
  void sum_squares(const float* x, int64_t n, double* out, bool accumulate) override {
    const double s = kernels::sum_squares(x, n);
    *out = accumulate ? *out + s : s;
  }

  void norm_forward(NormOp op, const NormShape& s, ActOut out, ActIn inp, const float* weight,
                    const float* bias, float* mean, float* rstd, float eps) override {
    kernels::norm_forward(op, s, act_f32(out, "norm_forward", "out"),
                          act_f32(inp, "norm_forward", "inp"), weight, bias, mean, rstd, eps);
  }
  void norm_backward(NormOp op, const NormShape& s, ActOut dinp, bool accumulate, float* dweight,
                     float* dbias, ActIn dout, ActIn inp, const float* weight, const float* mean,
                     const float* rstd) override {
    kernels::norm_backward(op, s, act_f32(dinp, "norm_backward", "dinp"), accumulate, dweight,
                           dbias, act_f32(dout, "norm_backward", "dout"),
                           act_f32(inp, "norm_backward", "inp"), weight, mean, rstd);
  }
  void norm_partial_stats(const NormShape& s, ActIn inp, float* stats) override {
    kernels::norm_partial_stats(s, act_f32(inp, "norm_partial_stats", "inp"), stats);
  }
  void norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total, const float* stats,
                               ActOut out, ActIn inp, const float* weight, const float* bias,
                               float* mean, float* rstd, float eps) override {
    kernels::norm_forward_from_stats(
        op, s, Cg_total, stats, act_f32(out, "norm_forward_from_stats", "out"),
        act_f32(inp, "norm_forward_from_stats", "inp"), weight, bias, mean, rstd, eps);
  }
  void norm_backward_partials(const NormShape& s, ActIn dout, ActIn inp, const float* weight,
                              const float* mean, const float* rstd, float* part) override {
    kernels::norm_backward_partials(s, act_f32(dout, "norm_backward_partials", "dout"),
                                    act_f32(inp, "norm_backward_partials", "inp"), weight, mean,
                                    rstd, part);
  }
  void norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total,
                                   const float* part, ActOut dinp, bool accumulate, float* dweight,
                                   float* dbias, ActIn dout, ActIn inp, const float* weight,
                                   const float* mean, const float* rstd) override {
    const char* m = "norm_backward_from_partials";
    kernels::norm_backward_from_partials(op, s, Cg_total, part, act_f32(dinp, m, "dinp"),
                                         accumulate, dweight, dbias, act_f32(dout, m, "dout"),
                                         act_f32(inp, m, "inp"), weight, mean, rstd);
  }

  // The CPU saves the probabilities; the backward's workspace is per OpenMP thread.
  int64_t attention_saved_elems(const AttentionShape& s) const override {
    return s.B * s.H * s.T * s.T;
  }
  int64_t attention_workspace_elems(const AttentionShape& s) const override {
    return kernels::attention_workspace_elems(s, s.threads > 0 ? s.threads : num_threads());
  }
  void attention_forward(const AttentionShape& s, ActOut out, float* saved, ActIn q, ActIn k,
                         ActIn v, const float* scale, float* max_abs_logit) override {
    kernels::attention_forward<float>(s, act_f32(out, "attention_forward", "out"), saved,
                                      act_f32(q, "attention_forward", "q"),
                                      act_f32(k, "attention_forward", "k"),
                                      act_f32(v, "attention_forward", "v"), scale, max_abs_logit);
  }
  void attention_backward(const AttentionShape& s, ActOut dq, ActOut dk, ActOut dv, float* dscale,
                          ActIn dout, ActIn out, const float* saved, ActIn q, ActIn k, ActIn v,
                          const float* scale, float* workspace) override {
    act_f32(out, "attention_backward", "out");  // the CPU's backward reads its saved probabilities
    kernels::attention_backward<float>(
        s, act_f32(dq, "attention_backward", "dq"), act_f32(dk, "attention_backward", "dk"),
        act_f32(dv, "attention_backward", "dv"), dscale,
        act_f32(dout, "attention_backward", "dout"), saved, act_f32(q, "attention_backward", "q"),
        act_f32(k, "attention_backward", "k"), act_f32(v, "attention_backward", "v"), scale,
        workspace);
  }
  void attention_scales(float* out, const float* gain, int64_t H, bool shared_gain,
                        float default_scale) override {
    kernels::attention_scales<float>(out, gain, H, shared_gain, default_scale);
  }
  void scale_grad_accumulate(float* grad, const float* dscale, int64_t H,
                             bool shared_gain) override {
    kernels::scale_grad_accumulate<float>(grad, dscale, H, shared_gain);
  }

  void rope_forward(const RopeTable& table, ActOut y, ActIn x, int64_t B, int64_t T, int64_t H,
                    int64_t D, int64_t row_stride) override {
    kernels::rope_forward<float>(table, act_f32(y, "rope_forward", "y"),
                                 act_f32(x, "rope_forward", "x"), B, T, H, D, row_stride);
  }
  void rope_backward(const RopeTable& table, ActOut dx, ActIn dy, int64_t B, int64_t T, int64_t H,
                     int64_t D, int64_t row_stride) override {
    kernels::rope_backward<float>(table, act_f32(dx, "rope_backward", "dx"),
                                  act_f32(dy, "rope_backward", "dy"), B, T, H, D, row_stride);
  }

  void embedding_forward(float* out, const int32_t* tokens, int64_t N, const float* wte,
                         int64_t v_begin, int64_t V_local, int64_t C) override {
    kernels::embedding_forward(out, tokens, N, wte, v_begin, V_local, C);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                          int64_t v_begin, int64_t V_local, int64_t C) override {
    kernels::embedding_backward(dwte, dout, tokens, N, v_begin, V_local, C);
  }
  void position_forward(float* out, const float* wpe, int64_t B, int64_t T, int64_t C) override {
    kernels::position_forward(out, wpe, B, T, C);
  }
  void position_backward(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) override {
    kernels::position_backward(dwpe, dout, B, T, C);
  }

  void xent_row_max(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                    float* row_max) override {
    kernels::xent_row_max(act_f32(logits, "xent_row_max", "logits"), N, V_local, v_valid_local,
                          row_max);
  }
  void xent_row_sumexp(ActIn logits, const float* row_max, int64_t N, int64_t V_local,
                       int64_t v_valid_local, float* sumexp) override {
    kernels::xent_row_sumexp(act_f32(logits, "xent_row_sumexp", "logits"), row_max, N, V_local,
                             v_valid_local, sumexp);
  }
  void xent_row_max_sumexp(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                           float* row_max, float* sumexp) override {
    const float* l = act_f32(logits, "xent_row_max_sumexp", "logits");
    kernels::xent_row_max(l, N, V_local, v_valid_local, row_max);
    kernels::xent_row_sumexp(l, row_max, N, V_local, v_valid_local, sumexp);
  }
  void xent_fused(ActOut dlogits, ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                  int64_t v_valid_local, int64_t v_begin, float grad_scale, float z_coef,
                  float* row_max, float* sumexp) override {
    const float* l = act_f32(logits, "xent_fused", "logits");
    kernels::xent_row_max(l, N, V_local, v_valid_local, row_max);
    kernels::xent_row_sumexp(l, row_max, N, V_local, v_valid_local, sumexp);
    // The process shares one CPU context: a buffer per calling thread, grown to the largest N.
    thread_local std::vector<float> lse;
    if (static_cast<int64_t>(lse.size()) < N) lse.resize(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      lse[n] = static_cast<float>(kernels::xent_row_lse(row_max[n], sumexp[n]));
    }
    kernels::xent_backward(act_f32(dlogits, "xent_fused", "dlogits"), l, lse.data(), targets, N,
                           V_local, v_valid_local, v_begin, grad_scale, z_coef);
  }
  void xent_target_logit(ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                         int64_t v_begin, float* target_logit) override {
    kernels::xent_target_logit(act_f32(logits, "xent_target_logit", "logits"), targets, N, V_local,
                               v_begin, target_logit);
  }
  void xent_finish(const float* row_max, const float* sumexp, const float* target_logit, int64_t N,
                   float* lse, double* sums) override {
    kernels::xent_finish(row_max, sumexp, target_logit, N, lse, sums);
  }
  void xent_backward(ActOut dlogits, ActIn logits, const float* lse, const int32_t* targets,
                     int64_t N, int64_t V_local, int64_t v_valid_local, int64_t v_begin,
                     float grad_scale, float z_coef) override {
    kernels::xent_backward(act_f32(dlogits, "xent_backward", "dlogits"),
                           act_f32(logits, "xent_backward", "logits"), lse, targets, N, V_local,
                           v_valid_local, v_begin, grad_scale, z_coef);
  }

  void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                    const AdamWStep& step) override {
    kernels::adamw_update(param, grad, m, v, n, step);
  }
};

struct Factories {
  std::mutex mu;
  ExecFactory cuda = nullptr;
  DeviceCounter cuda_count = nullptr;
};
Factories& factories() {
  static Factories* f = new Factories;  // never destroyed (used from other statics' destructors)
  return *f;
}

}  // namespace

const float* act_f32(ActIn a, const char* method, const char* arg) {
  KEEL_CHECK(a.dtype == DType::kF32, kInternal, method, ": ", arg, " is ", dtype_name(a.dtype),
             " memory where fp32 is expected (Note [act-dtype])");
  return static_cast<const float*>(a.data);
}

float* act_f32(ActOut a, const char* method, const char* arg) {
  KEEL_CHECK(a.dtype == DType::kF32, kInternal, method, ": ", arg, " is ", dtype_name(a.dtype),
             " memory where fp32 is expected (Note [act-dtype])");
  return static_cast<float*>(a.data);
}

const char* precision_name(Precision p) { return p == Precision::kBf16 ? "BF16" : "FP32"; }

void ExecContext::set_precision(Precision p) {
  KEEL_CHECK(p == Precision::kFp32, kConfig, "train.precision=", precision_name(p), ": the ",
             device_name(device()),
             " backend computes in FP32 only (BF16 needs train.device=CUDA)");
  precision_ = p;
}

ExecContext& cpu_exec() {
  static CpuExec* exec = new CpuExec;
  return *exec;
}

void set_exec_factory(Device device, ExecFactory factory, DeviceCounter device_count) {
  KEEL_CHECK(device != Device::kCpu, kInternal, "the CPU execution context is built in");
  std::lock_guard<std::mutex> lock(factories().mu);
  factories().cuda = factory;
  factories().cuda_count = factory ? device_count : nullptr;
}

bool has_exec_factory(Device device) {
  if (device == Device::kCpu) return true;
  std::lock_guard<std::mutex> lock(factories().mu);
  return factories().cuda != nullptr;
}

int exec_device_count(Device device) {
  if (device == Device::kCpu) return 1;
  DeviceCounter count;
  {
    std::lock_guard<std::mutex> lock(factories().mu);
    if (factories().cuda == nullptr) return 0;
    count = factories().cuda_count;
  }
  return count ? count() : 1;
}

std::unique_ptr<ExecContext> make_exec(Device device, int device_index) {
  if (device == Device::kCpu) return std::make_unique<CpuExec>();
  ExecFactory factory;
  {
    std::lock_guard<std::mutex> lock(factories().mu);
    factory = factories().cuda;
  }
  KEEL_CHECK(factory != nullptr, kConfig, "train.device=", device_name(device),
             ": this keel was built without ", device_name(device),
             " (configure with -DKEEL_CUDA=ON where the CUDA toolkit is installed)");
  return factory(device_index);
}

Precision resolve_precision(const std::string& setting, Device device) {
  const std::string v = upper_ascii(setting);
  if (v.empty() || v == "AUTO") return device == Device::kCpu ? Precision::kFp32 : Precision::kBf16;
  if (v == "FP32") return Precision::kFp32;
  KEEL_CHECK(v == "BF16", kConfig, "train.precision=", setting,
             ": invalid value (choose AUTO, FP32 or BF16)");
  return Precision::kBf16;
}

Device resolve_device(const std::string& setting) {
  const std::string v = upper_ascii(setting);
  if (v.empty() || v == "AUTO") {
    return exec_device_count(Device::kCuda) > 0 ? Device::kCuda : Device::kCpu;
  }
  if (v == "CPU") return Device::kCpu;
  KEEL_CHECK(v == "CUDA", kConfig, "train.device=", setting,
             ": invalid value (choose AUTO, CPU or CUDA)");
  KEEL_CHECK(has_exec_factory(Device::kCuda), kConfig,
             "train.device=CUDA: this keel was built without CUDA (configure with -DKEEL_CUDA=ON "
             "where the CUDA toolkit is installed)");
  KEEL_CHECK(exec_device_count(Device::kCuda) > 0, kConfig,
             "train.device=CUDA: no usable GPU on this machine (no device, or no driver)");
  return Device::kCuda;
}

}  // namespace keel::kernels
