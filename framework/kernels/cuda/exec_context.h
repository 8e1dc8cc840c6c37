// The CUDA execution context: every ExecContext method (framework/kernels/exec_context.h) on one
// GPU, by the CUDA backend's kernels (cuda/ops.h, gemm.h, attention.h, norm_split.h) on the
// stream of the cuda::Context it owns. Constructing one constructs that Context, which registers
// itself as the Device::kCuda memory backend: Tensor::zeros(..., Device::kCuda) then allocates
// from its caching allocator and its copies run on its stream, in order with the kernels (Note
// [cuda-stream-order]). Plain C++ header (no CUDA headers). Compiled only when KEEL_HAVE_CUDA.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/exec_context.h"

namespace keel::kernels::cuda {

class DeviceRopeTable;

class CudaExec final : public kernels::ExecContext {
 public:
  // Throws keel::Error naming the failed call when the device cannot be used.
  explicit CudaExec(int device_index = 0);
  ~CudaExec() override;
  CudaExec(const CudaExec&) = delete;
  CudaExec& operator=(const CudaExec&) = delete;

  // The CUDA context the kernels run on (its allocator, stream, fp32 GEMM mode).
  Context& context() { return ctx_; }

  Device device() const override { return Device::kCuda; }
  // FP32 or BF16 (Note [cuda-exec-bf16] in exec_context.cc).
  void set_precision(Precision p) override { precision_ = p; }
  // kFast lets cuDNN's SDPA backward take its default (atomic) algorithm; keel's own attention
  // kernel is deterministic either way.
  void set_determinism(Determinism d) override {
    determinism_ = d;
    ctx_.set_sdpa_backward(d == Determinism::kBitwise ? SdpaBackward::kDeterministic
                                                      : SdpaBackward::kFast);
  }
  // Note [act-dtype]: bf16 under BF16.
  keel::DType act_dtype() const override {
    return precision_ == Precision::kBf16 ? keel::DType::kBF16 : keel::DType::kF32;
  }
  // The attention kernel the BF16 precision picked for the last new shape: "cuDNN fused SDPA" or
  // "keel's fused attention (cuDNN: <why not>)"; empty before the first bf16 attention.
  std::string attention_path() const override { return attention_path_; }
  std::string describe() const override { return description_; }
  int threads() const override { return 1; }
  void synchronize() override;

  void linear_forward(ActOut out, ActIn inp, const float* weight, const float* bias, int64_t N,
                      int64_t IC, int64_t OC) override;
  void linear_backward(ActOut dinp, bool accumulate_dinp, float* dweight, float* dbias, ActIn dout,
                       ActIn inp, const float* weight, int64_t N, int64_t IC, int64_t OC) override;
  void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) override;

  void gelu_forward(ActOut out, ActIn inp, int64_t n) override;
  void gelu_backward(ActOut dinp, float* dbias, ActIn inp, ActIn dout, int64_t N,
                     int64_t C) override;
  void add(float* out, const float* a, ActIn b, int64_t n) override;
  void copy_to_f32(float* out, ActIn in, int64_t n) override;
  void add_inplace(float* y, const float* x, int64_t n) override;
  void glu_forward(GluAct act, ActOut out, const float* gate, const float* up, int64_t n) override;
  void glu_backward(GluAct act, ActOut dgate, ActOut dup, float* dgate_bias, float* dup_bias,
                    const float* dout, const float* gate, const float* up, int64_t N,
                    int64_t C) override;
  void sum_squares(const float* x, int64_t n, double* out, bool accumulate) override;
  // One multi-tensor sum in its own fixed order (Note [multi-tensor norm]); exec_optim.cc.
  void sum_squares_segments(const float* x, const NormSegment* segments, int64_t count,
                            double* out) override;

  void norm_forward(NormOp op, const NormShape& s, ActOut out, ActIn inp, const float* weight,
                    const float* bias, float* mean, float* rstd, float eps) override;
  void norm_backward(NormOp op, const NormShape& s, ActOut dinp, bool accumulate, float* dweight,
                     float* dbias, ActIn dout, ActIn inp, const float* weight, const float* mean,
                     const float* rstd) override;
  void norm_partial_stats(const NormShape& s, ActIn inp, float* stats) override;
  void norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total, const float* stats,
                               ActOut out, ActIn inp, const float* weight, const float* bias,
                               float* mean, float* rstd, float eps) override;
  void norm_backward_partials(const NormShape& s, ActIn dout, ActIn inp, const float* weight,
                              const float* mean, const float* rstd, float* part) override;
  void norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total,
                                   const float* part, ActOut dinp, bool accumulate, float* dweight,
                                   float* dbias, ActIn dout, ActIn inp, const float* weight,
                                   const float* mean, const float* rstd) override;

  int64_t attention_saved_elems(const AttentionShape& s) const override;
  int64_t attention_workspace_elems(const AttentionShape& s) const override;
  void attention_forward(const AttentionShape& s, ActOut out, float* saved, ActIn q, ActIn k,
                         ActIn v, const float* scale, float* max_abs_logit) override;
  void attention_backward(const AttentionShape& s, ActOut dq, ActOut dk, ActOut dv, float* dscale,
                          ActIn dout, ActIn out, const float* saved, ActIn q, ActIn k, ActIn v,
                          const float* scale, float* workspace) override;
  void attention_scales(float* out, const float* gain, int64_t H, bool shared_gain,
                        float default_scale) override;
  void scale_grad_accumulate(float* grad, const float* dscale, int64_t H,
                             bool shared_gain) override;

  void rope_forward(const RopeTable& table, ActOut y, ActIn x, int64_t B, int64_t T, int64_t H,
                    int64_t D, int64_t row_stride) override;
  void rope_backward(const RopeTable& table, ActOut dx, ActIn dy, int64_t B, int64_t T, int64_t H,
                     int64_t D, int64_t row_stride) override;

  void embedding_forward(float* out, const int32_t* tokens, int64_t N, const float* wte,
                         int64_t v_begin, int64_t V_local, int64_t C) override;
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                          int64_t v_begin, int64_t V_local, int64_t C) override;
  void position_forward(float* out, const float* wpe, int64_t B, int64_t T, int64_t C) override;
  void position_backward(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) override;

  void xent_row_max(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                    float* row_max) override;
  void xent_row_sumexp(ActIn logits, const float* row_max, int64_t N, int64_t V_local,
                       int64_t v_valid_local, float* sumexp) override;
  void xent_row_max_sumexp(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                           float* row_max, float* sumexp) override;
  void xent_fused(ActOut dlogits, ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                  int64_t v_valid_local, int64_t v_begin, float grad_scale, float z_coef,
                  float* row_max, float* sumexp) override;
  void xent_target_logit(ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                         int64_t v_begin, float* target_logit) override;
  void xent_finish(const float* row_max, const float* sumexp, const float* target_logit, int64_t N,
                   float* lse, double* sums) override;
  void xent_backward(ActOut dlogits, ActIn logits, const float* lse, const int32_t* targets,
                     int64_t N, int64_t V_local, int64_t v_valid_local, int64_t v_begin,
                     float grad_scale, float z_coef) override;

  void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                    const AdamWStep& step) override;
  // cuda::adamw_update_segments: one launch per 128 segments; exec_optim.cc.
  void adamw_update_segments(float* param, const float* grad, float* m, float* v,
                             const AdamWSegment* segments, int64_t count,
                             const AdamWStep& step) override;

 private:
  // The device copy of a host RopeTable, uploaded on its first use (a synchronous copy: the
  // first step only) and kept while the host table is the same object with the same contents.
  struct RopeEntry {
    const float* host_cos = nullptr;  // the host vectors' buffers when uploaded: a different
    const float* host_sin = nullptr;  // table at a reused address has (almost surely) others
    int64_t max_positions = 0, half_dim = 0;
    std::unique_ptr<DeviceRopeTable> table;
  };
  const DeviceRopeTable& device_rope_table(const RopeTable& table);
  // BF16: a staging buffer of at least `elems` bf16 values (valid until the next call).
  Bf16* stage(int64_t elems);
  bool use_cudnn(const AttentionShape& dense);

  Context ctx_;
  std::string description_;
  std::unordered_map<const RopeTable*, RopeEntry> rope_tables_;
  // After ctx_: returned to its allocator before the Context goes.
  DeviceBuffer stage_;
  // (B, T, H, Hkv, D, ldk) -> whether cuDNN takes the shape (CudaExec::use_cudnn)
  std::map<std::array<int64_t, 8>, bool> cudnn_shapes_;
  std::string attention_path_;
};

// Registers the CUDA execution context's factory (kernels::set_exec_factory(Device::kCuda, ...))
// with cuda::device_count as its device counter, so make_exec(Device::kCuda, i) makes a CudaExec
// on GPU i and train.device=AUTO finds the GPUs. Safe to call more than once. Registering needs
// no GPU (the count is then 0); making a context does.
void register_cuda_exec_factory();

}  // namespace keel::kernels::cuda
