// ExecContext: where a model's kernels run (a device, its stream on CUDA, the CPU's thread count)
// and the one dispatch point through which layers, the loss and the optimizer reach every kernel.
// Layers hold an ExecContext& and never ask which device they run on: the CPU context calls the
// kernels of framework/kernels/*.h (the reference implementation), the CUDA context
// (kernels/cuda/exec_context.h) their CUDA twins on its stream. Every pointer a method takes is
// memory of device() (Tensor::zeros(shape, dtype, ctx.device())) unless its name says host_.
//
// The semantics of each method are those of the free function of the same name in
// framework/kernels/*.h (fp32 forms); only the differences are written here. Device methods are
// asynchronous: results reach the host through Tensor::copy_to_host (which waits) or
// synchronize(). A method allocates nothing in steady state (a device context may grow a staging
// buffer on the first call of a larger shape).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "framework/device_backend.h"
#include "framework/kernels/adamw.h"
#include "framework/kernels/attention.h"
#include "framework/kernels/glu.h"
#include "framework/kernels/norm.h"
#include "framework/kernels/rope.h"
#include "framework/tensor.h"

namespace keel::kernels {

// The arithmetic of the matrix products (linear layers and attention). kBf16 is mixed
// precision as in Megatron-LM and llm.c: their inputs are rounded to bf16 and they accumulate and
// write in fp32; master weights, gradients, AdamW state, norms, softmax and the loss stay fp32.
enum class Precision { kFp32, kBf16 };
const char* precision_name(Precision p);  // "FP32", "BF16"

// ---- Note [act-dtype]: activations stored in bf16 ----
// Under BF16 on a device, the activations that only matrix products, attention and the loss read
// are stored in bf16 (act_dtype()):
// - the inputs of the projections and of attention: the block norms' outputs (pre-sublayer
//   placement), the final norm's output, the QK-normalised (and rotated) q and k, attention's
//   output (which attention's backward also reads) and the MLP's activated hidden. Their
//   producers compute in fp32 and write the bf16 rounding that the GEMMs and attention made in a
//   staging copy before, so storing them in bf16 changes no result;
// - the LM head's logits, as autocast leaves a matrix product's output: the head's GEMM writes them
//   from fp32 accumulators, the loss phases widen each element and compute in fp32, and the loss
//   backward writes the bf16 logit gradient in place, which the head's backward GEMMs read as it
//   is (they rounded it to bf16 anyway);
// - the MLP's hidden gradients (d of the up and gate projections' outputs), which only those
//   projections' backward GEMMs read: gelu_backward and glu_backward compute them in fp32, add
//   their column sums to the projections' bias gradients in fp32 (so the bias gradients do not see
//   the rounding), and write the bf16 the GEMMs staged before. The up projection's goes where the
//   activated hidden was, which nothing reads after the down projection's backward (the gate's
//   scratch is bf16 too): no memory is added;
// - the gradient of attention's output, which only attention's backward reads: the output
//   projection's backward GEMM writes it in bf16 from fp32 accumulators, the rounding attention's
//   backward staged before;
// - the QKV projection's output (raw q, k, v), which only QK-norm (or, without it, RoPE in place)
//   and attention read: the GEMM writes it in bf16 from fp32 accumulators (its bias added in bf16
//   in the epilogue), QK-norm widens q, k as it reads them (statistics in fp32), and attention
//   reads q, k, v where they lie in the packed rows, so v is no longer rounded into staging in
//   attention's forward and again in its backward. This changes results by the output's rounding
//   (autocast's); per layer at 124M x 16k tokens, by a byte count, ~0.4 GB of traffic less;
// - the QKV projection's output gradient (dqkv), which only that projection's backward GEMMs and
//   its bias sum read: attention's backward writes dv (and dq, dk without QK-norm) in bf16 where
//   they lie in dqkv, the rounding its kernels make anyway, and QK-norm's backward writes dq, dk
//   from fp32 arithmetic, rounded once, the rounding the GEMM staged before. With QK-norm and no
//   RoPE, attention writes dq, dk in bf16 too and the norm's backward widens them as it reads (with
//   RoPE they stay fp32, rotated in place, so the norm sees no extra rounding). What changes is the
//   QKV bias gradient's q and k columns, now summed from the bf16 values the GEMMs read (as
//   autocast's is); per layer at 124M x 16k tokens, by a byte count, ~0.6 GB of traffic less (the
//   widening of dq, dk, dv, the GEMM's staging of dqkv, and half of the norm's and the bias sum's
//   reads);
// - GELU's pre-activation (the up projection's output) and the activated hidden's gradient (the
//   down projection's input gradient), which only GELU's forward and backward read: the GEMMs
//   write them in bf16 from fp32 accumulators (the up projection's bias added in bf16 in its
//   epilogue), as autocast leaves a matrix product's output, and GELU widens each element and
//   computes in fp32, its bias gradient summed in fp32 as before. This changes results by those
//   roundings (autocast's); per layer at 124M x 16k tokens, by a byte count, 0.5 GB of traffic
//   less (five passes over a [BT, 4C] tensor at 2 bytes instead of 4). The gated units' up and
//   gate projections' outputs stay fp32;
// - under TP with bf16 on the TP wire (Note [bf16 wire] in parallel/communicator.h), the
//   row-parallel outputs (attention's and the MLP's output projections, which the residual adds
//   read through add()) and the QKV, MLP-up and LM-head input gradients (widened by
//   copy_to_f32() after their all-reduce), in one [BT, C] bf16 scratch: this one does change
//   results, by the rounding the wire's sum makes anyway.
// For 124M at 16 x 1024 tokens that is, by a byte count (not a measurement), ~42 GB less memory
// traffic per step (20.7 GB of staging copies, 13.2 GB around the logits, 7.2 GB in the MLP's
// backward: per layer the hidden gradient's fp32 write, its two fp32 re-reads (staging, bias sum)
// and the staging's bf16 write, 704 MB, become one bf16 write of 101 MB; 1.2 GB for attention's
// output gradient) before the QKV gradient's share above, and 6.7 GB less activation memory
// (memory_estimate_test). The residual stream, the gated units' inputs and the other gradients
// stay fp32.
//
// A method that takes ActIn/ActOut accepts a float* (kF32) anywhere and kBF16 memory only where
// act_dtype() is kBF16; another dtype throws keel::Error (kInternal) naming the method and the
// argument. A layer allocates such a tensor with act_dtype() and passes act(tensor).
struct ActOut {
  void* data = nullptr;
  DType dtype = DType::kF32;
  ActOut(float* p) : data(p) {}  // NOLINT(google-explicit-constructor): fp32 is the default
  ActOut(void* p, DType t) : data(p), dtype(t) {}
  // The memory `elems` elements further on.
  ActOut at(int64_t elems) const {
    return ActOut(static_cast<char*>(data) + elems * static_cast<int64_t>(dtype_size(dtype)),
                  dtype);
  }
};
struct ActIn {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  ActIn(const float* p) : data(p) {}  // NOLINT(google-explicit-constructor)
  ActIn(const void* p, DType t) : data(p), dtype(t) {}
  ActIn(ActOut a) : data(a.data), dtype(a.dtype) {}  // NOLINT(google-explicit-constructor)
  // The memory `elems` elements further on.
  ActIn at(int64_t elems) const {
    return ActIn(static_cast<const char*>(data) + elems * static_cast<int64_t>(dtype_size(dtype)),
                 dtype);
  }
};
inline ActOut act(const Tensor& t) { return ActOut(t.raw(), t.dtype()); }
// a.data as fp32; throws keel::Error (kInternal) "<method>: <arg> is bf16 ..." for another dtype.
const float* act_f32(ActIn a, const char* method, const char* arg);
float* act_f32(ActOut a, const char* method, const char* arg);

// train.deterministic: kBitwise (the default) keeps every step bitwise repeatable, which the
// spike guard's replay needs (Note [replay] in launch/train/forensics.h); kFast lets a device
// take a library's faster non-deterministic algorithm where it has one (a GPU: cuDNN's SDPA
// backward, dQ accumulated with atomics). The CPU's kernels and the CUDA backend's own kernels are
// deterministic either way, so the CPU context ignores it.
enum class Determinism { kBitwise, kFast };

class ExecContext {
 public:
  virtual ~ExecContext() = default;

  Precision precision() const { return precision_; }
  // Throws keel::Error (kConfig) naming train.precision for a precision this context has no
  // path for (the CPU computes in fp32 only).
  virtual void set_precision(Precision p);
  Determinism determinism() const { return determinism_; }
  virtual void set_determinism(Determinism d) { determinism_ = d; }

  // Note [act-dtype]: kBF16 under BF16 on a device, else kF32.
  virtual DType act_dtype() const { return DType::kF32; }

  virtual Device device() const = 0;
  // One line for the run's banner: "CPU, 2 threads (OpenBLAS 0.3.21)", "CUDA 0: NVIDIA H200".
  virtual std::string describe() const = 0;
  // Threads the CPU kernels use (1 on a device: the host only enqueues).
  virtual int threads() const = 0;
  // Waits for every kernel enqueued so far (a no-op on the CPU).
  virtual void synchronize() = 0;
  // For the run's log: which attention implementation the newest attention shape took, where a
  // context has more than one ("cuDNN fused SDPA", or keel's kernel and why cuDNN's was not
  // taken); empty where there is one choice, or before the first attention.
  virtual std::string attention_path() const { return {}; }

  // ---- gemm.h ----
  // out and inp, dinp, dout and inp: Note [act-dtype] (a bf16 dinp only with accumulate_dinp
  // false).
  virtual void linear_forward(ActOut out, ActIn inp, const float* weight, const float* bias,
                              int64_t N, int64_t IC, int64_t OC) = 0;
  virtual void linear_backward(ActOut dinp, bool accumulate_dinp, float* dweight, float* dbias,
                               ActIn dout, ActIn inp, const float* weight, int64_t N, int64_t IC,
                               int64_t OC) = 0;
  // dst[n] (=) = host_src[n]; returns once host_src may be reused.
  virtual void load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) = 0;

  // ---- elementwise.h, glu.h ----
  // out of gelu_forward and glu_forward: Note [act-dtype] (glu_forward's may alias its inputs
  // only in fp32); gelu_forward's inp too (a bf16 inp only with a bf16 out).
  virtual void gelu_forward(ActOut out, ActIn inp, int64_t n) = 0;
  // dinp[N, C] = dout * gelu'(inp), stored in dinp's dtype (Note [act-dtype]); inp and dout of
  // one dtype, bf16 only with a bf16 dinp, widened exactly; dinp may alias dout only in fp32.
  // dbias (may be null) += the column sums of dinp in fp32, before rounding: the bias gradient of
  // the linear layer whose output inp is, which that layer's backward then skips.
  virtual void gelu_backward(ActOut dinp, float* dbias, ActIn inp, ActIn dout, int64_t N,
                             int64_t C) = 0;
  // out = a + b; b may be bf16 memory (Note [act-dtype]: a row-parallel output on the bf16 TP
  // wire), widened exactly before the fp32 add.
  virtual void add(float* out, const float* a, ActIn b, int64_t n) = 0;
  virtual void add_inplace(float* y, const float* x, int64_t n) = 0;
  // out = in, bf16 memory widened exactly (fp32 copied; out may equal in).
  virtual void copy_to_f32(float* out, ActIn in, int64_t n) = 0;
  virtual void glu_forward(GluAct act, ActOut out, const float* gate, const float* up,
                           int64_t n) = 0;
  // glu.h's glu_backward over [N, C], dgate and dup stored in their dtypes (Note [act-dtype]; dup
  // may alias dout only in fp32); dgate_bias and dup_bias (may be null) += the column sums of dgate
  // and dup in fp32, as gelu_backward's dbias.
  virtual void glu_backward(GluAct act, ActOut dgate, ActOut dup, float* dgate_bias,
                            float* dup_bias, const float* dout, const float* gate, const float* up,
                            int64_t N, int64_t C) = 0;
  // *out (= or += per accumulate; device double) the sum of squares of x[n] in double, with a
  // fixed partition of x (bitwise reproducible run to run; the CPU's is the free function's).
  virtual void sum_squares(const float* x, int64_t n, double* out, bool accumulate) = 0;
  // *out (=, device double) the sum of squares of x over segments[0..count) (x[offset, offset +
  // n) each; adamw.h), for the global gradient norm in one call a step. This default is
  // sum_squares per non-empty segment, accumulated in segment order (the CPU's result, bit for
  // bit); with none, 0. A device context may sum in one fixed order of its own over all segments
  // (CudaExec: Note [multi-tensor norm] in cuda/elementwise.cu, 2 launches instead of 2 per
  // segment), equal to this to double rounding.
  virtual void sum_squares_segments(const float* x, const NormSegment* segments, int64_t count,
                                    double* out) {
    bool any = false;
    for (int64_t k = 0; k < count; ++k) {
      if (segments[k].n == 0) continue;
      sum_squares(x + segments[k].offset, segments[k].n, out, /*accumulate=*/any);
      any = true;
    }
    if (!any) sum_squares(x, 0, out, /*accumulate=*/false);
  }

  // ---- norm.h (the split forms serve a row sharded over TP ranks) ----
  // out and inp: Note [act-dtype] (a bf16 inp is widened exactly; the statistics are fp32).
  virtual void norm_forward(NormOp op, const NormShape& s, ActOut out, ActIn inp,
                            const float* weight, const float* bias, float* mean, float* rstd,
                            float eps) = 0;
  // dinp, dout and inp of the backward forms: Note [act-dtype] (a bf16 dinp only with accumulate
  // false); the gain and bias gradients and the partials are fp32 sums either way.
  virtual void norm_backward(NormOp op, const NormShape& s, ActOut dinp, bool accumulate,
                             float* dweight, float* dbias, ActIn dout, ActIn inp,
                             const float* weight, const float* mean, const float* rstd) = 0;
  virtual void norm_partial_stats(const NormShape& s, ActIn inp, float* stats) = 0;
  // out and inp: Note [act-dtype].
  virtual void norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total,
                                       const float* stats, ActOut out, ActIn inp,
                                       const float* weight, const float* bias, float* mean,
                                       float* rstd, float eps) = 0;
  virtual void norm_backward_partials(const NormShape& s, ActIn dout, ActIn inp,
                                      const float* weight, const float* mean, const float* rstd,
                                      float* part) = 0;
  virtual void norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total,
                                           const float* part, ActOut dinp, bool accumulate,
                                           float* dweight, float* dbias, ActIn dout, ActIn inp,
                                           const float* weight, const float* mean,
                                           const float* rstd) = 0;

  // ---- attention.h ----
  // What the forward saves for the backward differs by backend: the CPU keeps the probabilities
  // [B, H, T, T], a fused GPU kernel only the log-sum-exp [B, H, T]. The caller allocates
  // attention_saved_elems(s) floats for it and attention_workspace_elems(s) for the backward
  // (s.threads: the CPU threads the backward will use; 0 means threads()).
  virtual int64_t attention_saved_elems(const AttentionShape& s) const = 0;
  virtual int64_t attention_workspace_elems(const AttentionShape& s) const = 0;
  // out (=); saved (=); *max_abs_logit (=, device float) the largest |scale q.k| unmasked.
  // q, k, v and out (and the backward's q, k, v, out and dout): Note [act-dtype]; a bf16 out
  // (and dout) only dense (a row stride of s.H * s.D; dout has out's), bf16 q, k, v at their own
  // row strides.
  virtual void attention_forward(const AttentionShape& s, ActOut out, float* saved, ActIn q,
                                 ActIn k, ActIn v, const float* scale, float* max_abs_logit) = 0;
  // dq, dk, dv (=; Note [act-dtype], at the row strides of q, k and v); dscale (+=, nullable).
  // out and saved as the forward left them; dq, dk, dv must not alias q, k, v, out or dout.
  virtual void attention_backward(const AttentionShape& s, ActOut dq, ActOut dk, ActOut dv,
                                  float* dscale, ActIn dout, ActIn out, const float* saved, ActIn q,
                                  ActIn k, ActIn v, const float* scale, float* workspace) = 0;
  virtual void attention_scales(float* out, const float* gain, int64_t H, bool shared_gain,
                                float default_scale) = 0;
  virtual void scale_grad_accumulate(float* grad, const float* dscale, int64_t H,
                                     bool shared_gain) = 0;

  // ---- rope.h (the table is the host table; a device context keeps its own copy of it) ----
  // y and x: Note [act-dtype] (a bf16 x only with a bf16 y; y may equal x, in place).
  virtual void rope_forward(const RopeTable& table, ActOut y, ActIn x, int64_t B, int64_t T,
                            int64_t H, int64_t D, int64_t row_stride) = 0;
  // dx and dy: Note [act-dtype], of one dtype (bf16: the fp32 rotation of the widened dy rounded
  // once); dx may equal dy (in place).
  virtual void rope_backward(const RopeTable& table, ActOut dx, ActIn dy, int64_t B, int64_t T,
                             int64_t H, int64_t D, int64_t row_stride) = 0;

  // ---- embedding.h ----
  virtual void embedding_forward(float* out, const int32_t* tokens, int64_t N, const float* wte,
                                 int64_t v_begin, int64_t V_local, int64_t C) = 0;
  virtual void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                                  int64_t v_begin, int64_t V_local, int64_t C) = 0;
  virtual void position_forward(float* out, const float* wpe, int64_t B, int64_t T, int64_t C) = 0;
  virtual void position_backward(float* dwpe, const float* dout, int64_t B, int64_t T,
                                 int64_t C) = 0;

  // ---- cross_entropy.h (logits and dlogits: Note [act-dtype]; the statistics are fp32) ----
  virtual void xent_row_max(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                            float* row_max) = 0;
  virtual void xent_row_sumexp(ActIn logits, const float* row_max, int64_t N, int64_t V_local,
                               int64_t v_valid_local, float* sumexp) = 0;
  // xent_row_max then xent_row_sumexp on its row_max, with the same results; for logits that are
  // not vocab-parallel (the sum-exp needs the max of all ranks' shards first). On a GPU one block
  // takes both passes over a row, so the second is meant to find the row in L2 (a 124M row is 100
  // KB; the rows in flight hold ~26 MB of an H200's 60 MB, cuda/loss.cu): one read of the logits
  // from memory instead of two (not yet measured on a GPU).
  virtual void xent_row_max_sumexp(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                                   float* row_max, float* sumexp) = 0;
  // The loss and its gradient in one pass, for logits that are not vocab-parallel and a loss
  // weight known at the forward: xent_row_max_sumexp, then xent_backward with the log-sum-exp
  // xent_finish will give each row (xent_row_lse of these statistics), with the same results as
  // those calls. dlogits has logits' dtype and may alias it (then read target logits first). On a
  // GPU the gradient pass, like the sum-exp, is meant to find the row in L2: the logits are read
  // from memory once instead of three times.
  virtual void xent_fused(ActOut dlogits, ActIn logits, const int32_t* targets, int64_t N,
                          int64_t V_local, int64_t v_valid_local, int64_t v_begin, float grad_scale,
                          float z_coef, float* row_max, float* sumexp) = 0;
  virtual void xent_target_logit(ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                                 int64_t v_begin, float* target_logit) = 0;
  // sums[3] (=): device doubles, as the free function's host ones.
  virtual void xent_finish(const float* row_max, const float* sumexp, const float* target_logit,
                           int64_t N, float* lse, double* sums) = 0;
  // dlogits has logits' dtype and may alias it.
  virtual void xent_backward(ActOut dlogits, ActIn logits, const float* lse, const int32_t* targets,
                             int64_t N, int64_t V_local, int64_t v_valid_local, int64_t v_begin,
                             float grad_scale, float z_coef) = 0;

  // ---- adamw.h ----
  virtual void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                            const AdamWStep& step) = 0;
  // adamw_update over each segment of the arenas param, grad, m and v (adamw.h's AdamWSegment),
  // with step.weight_decay where the segment decays and 0 elsewhere: the optimizer's one call a
  // step. This default calls adamw_update per segment in order (the CPU's path, unchanged); a
  // device context may update many segments a launch with the same arithmetic per element
  // (CudaExec: cuda::adamw_update_segments, bitwise equal). Segments must not overlap.
  virtual void adamw_update_segments(float* param, const float* grad, float* m, float* v,
                                     const AdamWSegment* segments, int64_t count,
                                     const AdamWStep& step) {
    AdamWStep s = step;
    for (int64_t k = 0; k < count; ++k) {
      const AdamWSegment& seg = segments[k];
      s.weight_decay = seg.decay ? step.weight_decay : 0.0f;
      adamw_update(param + seg.offset, grad + seg.offset, m + seg.offset, v + seg.offset, seg.n, s);
    }
  }

 protected:
  Precision precision_ = Precision::kFp32;
  Determinism determinism_ = Determinism::kBitwise;
};

// The CPU context: the kernels of framework/kernels/*.h on host memory with the process's
// OpenMP/BLAS threads. One per process, never destroyed.
ExecContext& cpu_exec();

// The context for `device`: the CPU's, or a device context made by the factory registered for
// it. A CUDA build registers its factory when keel-train starts (kernels/cuda/exec_context.h);
// tests register fakes. Throws keel::Error (kConfig) naming the device when none is registered:
// "train.device=CUDA but this keel was built without CUDA".
// device_count (nullable: one device) says how many devices of the kind are usable now (0 on
// a machine without a GPU or driver).
using ExecFactory = std::unique_ptr<ExecContext> (*)(int device_index);
using DeviceCounter = int (*)();
void set_exec_factory(Device device, ExecFactory factory,
                      DeviceCounter device_count = nullptr);  // factory nullptr unregisters
bool has_exec_factory(Device device);
// Usable devices of the kind: 0 without a registered factory; the CPU counts as 1.
int exec_device_count(Device device);
std::unique_ptr<ExecContext> make_exec(Device device, int device_index = 0);

// train.device: "AUTO" (a GPU when one is usable, else the CPU), "CPU" or "CUDA"
// (case-insensitive). Throws keel::Error (kConfig) for another value, and for CUDA in a build
// without CUDA or on a machine where no GPU is usable, naming the field and the reason.
Device resolve_device(const std::string& setting);

// train.precision: "AUTO" or "" (BF16 on a GPU, FP32 on the CPU), "FP32" or "BF16"
// (case-insensitive), for a run on `device`. Throws keel::Error (kConfig) for another value.
Precision resolve_precision(const std::string& setting, Device device);

}  // namespace keel::kernels
