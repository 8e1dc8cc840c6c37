// The CUDA execution context (exec_context.h): each method forwards to the CUDA kernel of the same
// name on the owned Context's stream.
//
// Note [cuda-exec-attention]: the fp32 attention runs the backend's own fused kernel
// (cuda/attention.h) for the forward and the backward. cuDNN's fused SDPA (sdpa_cudnn.h) takes
// bf16 q/k/v/out only, so it cannot serve these fp32 forms; the own kernel is fp32 throughout,
// reports max |logit| from the forward itself, and is deterministic. What the forward saves for
// the backward is its log-sum-exp [B, H, T] (not the CPU's [B, H, T, T] probabilities). The
// backward takes its temporaries (delta[B * H * T] and the dscale partials) from the Context's
// scratch, which grows only on the first call of a larger shape, so it needs no workspace from
// the caller.
#include "framework/kernels/cuda/exec_context.h"

#include <cuda_runtime.h>

#include "framework/error.h"
#include "framework/kernels/cuda/attention.h"
#include "framework/kernels/cuda/check.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/norm_split.h"
#include "framework/kernels/cuda/ops.h"
#include "framework/kernels/cuda/sdpa_cudnn.h"

namespace keel::kernels::cuda {

namespace {

std::string describe_device(int device_index) {
  cudaDeviceProp prop{};
  KEEL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_index), "CudaExec describe device ",
                  device_index);
  return "CUDA " + std::to_string(device_index) + ": " + prop.name;
}

std::unique_ptr<kernels::ExecContext> make_cuda_exec(int device_index) {
  const int count = device_count();
  KEEL_CHECK(device_index >= 0 && device_index < count, kConfig, "train.device=CUDA: GPU ",
             device_index, " is not usable (", count, " CUDA device(s) on this machine)");
  return std::make_unique<CudaExec>(device_index);
}

}  // namespace

CudaExec::CudaExec(int device_index)
    : ctx_(device_index), description_(describe_device(device_index)) {}

// Kernels still in flight may read the cached rope tables and write memory of this Context's
// allocator: wait for them before either goes. A failure here cannot be reported from a
// destructor, and the Context's own teardown releases what it can.
CudaExec::~CudaExec() { cudaStreamSynchronize(ctx_.stream()); }

void CudaExec::synchronize() { ctx_.synchronize(); }

// ---- gemm.h ----

// ---- Note [cuda-exec-bf16]: the BF16 precision ----
// Weights, gradients and the activations Note [act-dtype] (kernels/exec_context.h) does not list
// stay fp32 in memory; a matrix product rounds its fp32 inputs to bf16 in a staging buffer and
// runs on the bf16 tensor cores with fp32 accumulation, as autocast does. Operands a layer stores
// in bf16 are read where they are, and outputs it stores in bf16 (the logits, the QKV and up
// projections' outputs, some input gradients) are written in bf16 from the fp32 accumulators. The
// weights' conversion is a small share of the traffic (one read of each weight per GEMM, against
// the N-row activations). Attention reads bf16 q, k, v where they lie (at their row strides) and
// a bf16 out and dout as dense rows, rounds fp32 ones into dense bf16 rows, and runs cuDNN's fused
// SDPA where it takes the shape, else the own fused kernel in bf16; its output and gradients are
// written in bf16 in place, or copied or widened to fp32 exactly.

Bf16* CudaExec::stage(int64_t elems) {
  const size_t bytes = static_cast<size_t>(elems) * sizeof(Bf16);
  // Grows on the first step only (shapes repeat); the caching allocator hands memory back in
  // stream order, so replacing a buffer kernels still read is safe (Note [cuda-stream-order]).
  if (bytes > stage_.bytes()) stage_ = ctx_.alloc(bytes);
  return stage_.as<Bf16>();
}

// Element offsets into the staging buffer, rounded up to 64 elements (128 bytes) so every
// operand keeps cuBLASLt's and cuDNN's alignment.
static int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

namespace {

// Note [act-dtype]: true for bf16 memory (which the BF16 precision alone takes), false for fp32;
// throws keel::Error (kInternal) naming the method and the argument otherwise.
bool is_bf16(ActIn a, Precision p, const char* method, const char* arg) {
  if (a.dtype == keel::DType::kF32) return false;
  KEEL_CHECK(a.dtype == keel::DType::kBF16 && p == Precision::kBf16, kInternal,
             "CudaExec::", method, ": ", arg, " is ", keel::dtype_name(a.dtype), " memory under ",
             precision_name(p), " (Note [act-dtype])");
  return true;
}

const Bf16* bf16_of(ActIn a) { return static_cast<const Bf16*>(a.data); }

// Calls f with a's memory typed by its dtype (const Bf16* or const float*; is_bf16's checks).
template <typename F>
void with_typed(ActIn a, Precision p, const char* method, const char* arg, F&& f) {
  if (is_bf16(a, p, method, arg)) {
    f(bf16_of(a));
  } else {
    f(static_cast<const float*>(a.data));
  }
}
// The same for an output (Bf16* or float*).
template <typename F>
void with_typed(ActOut a, Precision p, const char* method, const char* arg, F&& f) {
  if (is_bf16(a, p, method, arg)) {
    f(static_cast<Bf16*>(a.data));
  } else {
    f(static_cast<float*>(a.data));
  }
}

}  // namespace

void CudaExec::linear_forward(ActOut out, ActIn inp, const float* weight, const float* bias,
                              int64_t N, int64_t IC, int64_t OC) {
  const bool out_bf16 = is_bf16(out, precision_, "linear_forward", "out");
  const bool inp_bf16 = is_bf16(inp, precision_, "linear_forward", "inp");
  if (precision_ == Precision::kFp32) {
    cuda::linear_forward(ctx_, static_cast<float*>(out.data), static_cast<const float*>(inp.data),
                         weight, bias, N, IC, OC);
    return;
  }
  // Note [cuda-exec-bf16]: the weight, an fp32 input and (for a bf16 output, whose epilogue adds
  // a bias of its own type) the bias are rounded into the staging buffer.
  const bool bias_bf16 = out_bf16 && bias != nullptr;
  Bf16* w = stage(align64(OC * IC) + (inp_bf16 ? 0 : align64(N * IC)) + (bias_bf16 ? OC : 0));
  Bf16* next = w + align64(OC * IC);
  to_bf16_rows(ctx_, w, IC, weight, IC, OC, IC);
  const Bf16* a = bf16_of(inp);
  if (!inp_bf16) {
    to_bf16_rows(ctx_, next, IC, static_cast<const float*>(inp.data), IC, N, IC);
    a = next;
    next += align64(N * IC);
  }
  if (out_bf16) {
    const Bf16* b = nullptr;
    if (bias_bf16) {
      to_bf16_rows(ctx_, next, OC, bias, OC, 1, OC);
      b = next;
    }
    cuda::linear_forward(ctx_, static_cast<Bf16*>(out.data), a, w, b, N, IC, OC);
  } else {
    cuda::linear_forward(ctx_, static_cast<float*>(out.data), a, w, bias, N, IC, OC);
  }
}

void CudaExec::linear_backward(ActOut dinp, bool accumulate_dinp, float* dweight, float* dbias,
                               ActIn dout, ActIn inp, const float* weight, int64_t N, int64_t IC,
                               int64_t OC) {
  const bool dinp_bf16 = is_bf16(dinp, precision_, "linear_backward", "dinp");
  const bool dout_bf16 = is_bf16(dout, precision_, "linear_backward", "dout");
  const bool inp_bf16 = is_bf16(inp, precision_, "linear_backward", "inp");
  KEEL_CHECK(!(dinp_bf16 && accumulate_dinp), kInternal,
             "CudaExec::linear_backward: a bf16 dinp cannot accumulate");
  if (precision_ == Precision::kFp32) {
    cuda::linear_backward(ctx_, static_cast<float*>(dinp.data), accumulate_dinp, dweight, dbias,
                          static_cast<const float*>(dout.data), static_cast<const float*>(inp.data),
                          weight, N, IC, OC);
    return;
  }
  // Note [cuda-exec-bf16]: bf16 operands, fp32 dweight (beta 1 accumulates in fp32) and dinp (or
  // a bf16 dinp rounded from the fp32 accumulators: Note [act-dtype]). Operands already in bf16
  // are read where they are.
  const bool stage_d = !dout_bf16, stage_x = dweight != nullptr && !inp_bf16;
  Bf16* next = stage((stage_d ? align64(N * OC) : 0) +
                     (dinp.data != nullptr ? align64(OC * IC) : 0) + (stage_x ? N * IC : 0));
  const Bf16* d = bf16_of(dout);
  if (stage_d) {
    to_bf16_rows(ctx_, next, OC, static_cast<const float*>(dout.data), OC, N, OC);
    d = next;
    next += align64(N * OC);
  }
  if (dinp.data != nullptr) {
    to_bf16_rows(ctx_, next, IC, weight, IC, OC, IC);
    gemm(ctx_, false, false, N, IC, OC, 1.0f, d, OC, next, IC, accumulate_dinp ? 1.0f : 0.0f,
         dinp.data, IC, DType::kBF16, dinp_bf16 ? DType::kBF16 : DType::kF32);
    next += align64(OC * IC);
  }
  if (dweight != nullptr) {
    const Bf16* x = bf16_of(inp);
    if (stage_x) {
      to_bf16_rows(ctx_, next, IC, static_cast<const float*>(inp.data), IC, N, IC);
      x = next;
    }
    gemm(ctx_, true, false, OC, IC, N, 1.0f, d, OC, x, IC, 1.0f, dweight, IC, DType::kBF16,
         DType::kF32);
  }
  // The bias gradient sums dout as it is stored: an fp32 dout has nothing to round.
  if (dbias != nullptr) {
    if (dout_bf16) {
      column_sum_add(ctx_, dbias, d, N, OC, OC);
    } else {
      column_sum_add(ctx_, dbias, static_cast<const float*>(dout.data), N, OC, OC);
    }
  }
}

// Note [pinned uploads] (device.h): the batch's ids go through pinned staging, enqueued without
// a host wait; host_src may be rewritten on return (the trainer refills it each micro-batch).
void CudaExec::load_tokens(int32_t* dst, const int32_t* host_src, int64_t n) {
  KEEL_CHECK(n >= 0, kUsage, "cuda load_tokens: negative n=", n);
  ctx_.upload_async(dst, host_src, static_cast<size_t>(n) * sizeof(int32_t));
}

// ---- elementwise.h, glu.h ----

void CudaExec::gelu_forward(ActOut out, ActIn inp, int64_t n) {
  if (is_bf16(inp, precision_, "gelu_forward", "inp")) {
    KEEL_CHECK(is_bf16(out, precision_, "gelu_forward", "out"), kInternal,
               "CudaExec::gelu_forward: a bf16 inp needs a bf16 out");
    cuda::gelu_forward(ctx_, static_cast<Bf16*>(out.data), bf16_of(inp), n);
    return;
  }
  const float* x = static_cast<const float*>(inp.data);
  with_typed(out, precision_, "gelu_forward", "out",
             [&](auto* o) { cuda::gelu_forward(ctx_, o, x, n); });
}

void CudaExec::gelu_backward(ActOut dinp, float* dbias, ActIn inp, ActIn dout, int64_t N,
                             int64_t C) {
  const bool bf16_in = is_bf16(inp, precision_, "gelu_backward", "inp");
  KEEL_CHECK(is_bf16(dout, precision_, "gelu_backward", "dout") == bf16_in, kInternal,
             "CudaExec::gelu_backward: inp and dout have different dtypes");
  if (bf16_in) {
    KEEL_CHECK(is_bf16(dinp, precision_, "gelu_backward", "dinp"), kInternal,
               "CudaExec::gelu_backward: a bf16 inp needs a bf16 dinp");
    cuda::gelu_backward(ctx_, static_cast<Bf16*>(dinp.data), dbias, bf16_of(inp), bf16_of(dout), N,
                        C);
    return;
  }
  const float *x = static_cast<const float*>(inp.data), *g = static_cast<const float*>(dout.data);
  with_typed(dinp, precision_, "gelu_backward", "dinp",
             [&](auto* d) { cuda::gelu_backward(ctx_, d, dbias, x, g, N, C); });
}

void CudaExec::add(float* out, const float* a, ActIn b, int64_t n) {
  with_typed(b, precision_, "add", "b", [&](auto* bp) { cuda::add(ctx_, out, a, bp, n); });
}

void CudaExec::copy_to_f32(float* out, ActIn in, int64_t n) {
  if (is_bf16(in, precision_, "copy_to_f32", "in")) {
    cuda::from_bf16(ctx_, out, bf16_of(in), n);
  } else if (out != in.data && n > 0) {
    KEEL_CUDA_CHECK(cudaMemcpyAsync(out, in.data, static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, ctx_.stream()),
                    "CudaExec::copy_to_f32 n=", n);
  }
}

void CudaExec::add_inplace(float* y, const float* x, int64_t n) {
  cuda::add_inplace(ctx_, y, x, n);
}

void CudaExec::glu_forward(GluAct act, ActOut out, const float* gate, const float* up, int64_t n) {
  with_typed(out, precision_, "glu_forward", "out",
             [&](auto* o) { cuda::glu_forward(ctx_, act, o, gate, up, n); });
}

void CudaExec::glu_backward(GluAct act, ActOut dgate, ActOut dup, float* dgate_bias,
                            float* dup_bias, const float* dout, const float* gate, const float* up,
                            int64_t N, int64_t C) {
  const bool bf16 = is_bf16(dgate, precision_, "glu_backward", "dgate");
  KEEL_CHECK(is_bf16(dup, precision_, "glu_backward", "dup") == bf16, kInternal,
             "glu_backward: dgate and dup have different dtypes");
  if (bf16) {
    cuda::glu_backward(ctx_, act, static_cast<Bf16*>(dgate.data), static_cast<Bf16*>(dup.data),
                       dgate_bias, dup_bias, dout, gate, up, N, C);
  } else {
    cuda::glu_backward(ctx_, act, static_cast<float*>(dgate.data), static_cast<float*>(dup.data),
                       dgate_bias, dup_bias, dout, gate, up, N, C);
  }
}

void CudaExec::sum_squares(const float* x, int64_t n, double* out, bool accumulate) {
  cuda::sum_squares(ctx_, x, n, out, accumulate);
}

// ---- norm.h ----

void CudaExec::norm_forward(NormOp op, const NormShape& s, ActOut out, ActIn inp,
                            const float* weight, const float* bias, float* mean, float* rstd,
                            float eps) {
  with_typed(out, precision_, "norm_forward", "out", [&](auto* o) {
    with_typed(inp, precision_, "norm_forward", "inp", [&](auto* x) {
      cuda::norm_forward(ctx_, op, s, o, x, weight, bias, mean, rstd, eps);
    });
  });
}

void CudaExec::norm_backward(NormOp op, const NormShape& s, ActOut dinp, bool accumulate,
                             float* dweight, float* dbias, ActIn dout, ActIn inp,
                             const float* weight, const float* mean, const float* rstd) {
  const char* m = "norm_backward";
  KEEL_CHECK(!(accumulate && is_bf16(dinp, precision_, m, "dinp")), kInternal, "CudaExec::", m,
             ": a bf16 dinp cannot accumulate");
  with_typed(dinp, precision_, m, "dinp", [&](auto* dx) {
    with_typed(dout, precision_, m, "dout", [&](auto* dy) {
      with_typed(inp, precision_, m, "inp", [&](auto* x) {
        cuda::norm_backward(ctx_, op, s, dx, accumulate, dweight, dbias, dy, x, weight, mean, rstd);
      });
    });
  });
}

void CudaExec::norm_partial_stats(const NormShape& s, ActIn inp, float* stats) {
  with_typed(inp, precision_, "norm_partial_stats", "inp",
             [&](auto* x) { cuda::norm_partial_stats(ctx_, s, x, stats); });
}

void CudaExec::norm_forward_from_stats(NormOp op, const NormShape& s, int64_t Cg_total,
                                       const float* stats, ActOut out, ActIn inp,
                                       const float* weight, const float* bias, float* mean,
                                       float* rstd, float eps) {
  const char* m = "norm_forward_from_stats";
  with_typed(out, precision_, m, "out", [&](auto* o) {
    with_typed(inp, precision_, m, "inp", [&](auto* x) {
      cuda::norm_forward_from_stats(ctx_, op, s, Cg_total, stats, o, x, weight, bias, mean, rstd,
                                    eps);
    });
  });
}

void CudaExec::norm_backward_partials(const NormShape& s, ActIn dout, ActIn inp,
                                      const float* weight, const float* mean, const float* rstd,
                                      float* part) {
  const char* m = "norm_backward_partials";
  with_typed(dout, precision_, m, "dout", [&](auto* dy) {
    with_typed(inp, precision_, m, "inp", [&](auto* x) {
      cuda::norm_backward_partials(ctx_, s, dy, x, weight, mean, rstd, part);
    });
  });
}

void CudaExec::norm_backward_from_partials(NormOp op, const NormShape& s, int64_t Cg_total,
                                           const float* part, ActOut dinp, bool accumulate,
                                           float* dweight, float* dbias, ActIn dout, ActIn inp,
                                           const float* weight, const float* mean,
                                           const float* rstd) {
  const char* m = "norm_backward_from_partials";
  KEEL_CHECK(!(accumulate && is_bf16(dinp, precision_, m, "dinp")), kInternal, "CudaExec::", m,
             ": a bf16 dinp cannot accumulate");
  with_typed(dinp, precision_, m, "dinp", [&](auto* dx) {
    with_typed(dout, precision_, m, "dout", [&](auto* dy) {
      with_typed(inp, precision_, m, "inp", [&](auto* x) {
        cuda::norm_backward_from_partials(ctx_, op, s, Cg_total, part, dx, accumulate, dweight,
                                          dbias, dy, x, weight, mean, rstd);
      });
    });
  });
}

// ---- attention.h (Note [cuda-exec-attention]) ----
//
// Grouped-query attention (Note [gqa layouts] in layers/attention.h) runs on both paths: k, v and
// their gradients hold s.kv_heads() heads (Hkv * D columns), q, out and theirs H. The head dim D
// is the shape's own (model.head_dim), never d_model / H. keel's fused kernel takes D up to
// kAttentionMaxHeadDim (128), cuDNN up to 256 (sdpa_cudnn.cc); what neither takes stops with a
// kConfig error naming model.head_dim.

// "model.head_dim=D: ..." when no attention path here takes D; `why` says why cuDNN does not.
static void require_head_dim(const AttentionShape& s, const std::string& why) {
  KEEL_CHECK(s.D <= kAttentionMaxHeadDim, kConfig, "model.head_dim=", s.D,
             ": keel's fused CUDA attention takes head dims up to ", kAttentionMaxHeadDim,
             ", and cuDNN's does not take this shape (", why,
             "); use a smaller head_dim or train.device=CPU");
}

int64_t CudaExec::attention_saved_elems(const AttentionShape& s) const {
  // In fp32 only keel's fused kernel runs (cuDNN's SDPA is bf16): refused here, when the model is
  // built. Under BF16 the first forward decides, once it knows whether cuDNN takes the shape.
  if (precision_ == Precision::kFp32) require_head_dim(s, "bf16 only, and train.precision=FP32");
  return s.B * s.H * s.T;
}

int64_t CudaExec::attention_workspace_elems(const AttentionShape& /*s*/) const { return 0; }

// Note [act-dtype]: whether an attention operand (q or out, row stride ld) is bf16 memory the
// kernels use as it is: dense rows of H * D, as they read and write them.
static bool dense_bf16(ActIn a, int64_t ld, const AttentionShape& s, Precision p,
                       const char* method, const char* arg) {
  if (!is_bf16(a, p, method, arg)) return false;
  KEEL_CHECK(ld == s.H * s.D, kInternal, "CudaExec::", method, ": a bf16 ", arg,
             " must be dense (row stride ", ld, " != H * D = ", s.H * s.D, ")");
  return true;
}

// Note [act-dtype]: whether q, k or v (`heads` heads of D, row stride ld) is bf16 memory the
// kernels read as it is, at its own row stride: dense rows, rows of the QKV projection's packed
// output, or, with k/v heads replicated under TP (Note [gqa layouts]), the k/v head this rank's
// query heads read inside rows of every k/v head. Both kernels and cuDNN take strided q, k, v.
static bool strided_bf16(ActIn a, int64_t ld, int64_t heads, const AttentionShape& s, Precision p,
                         const char* method, const char* arg) {
  if (!is_bf16(a, p, method, arg)) return false;
  KEEL_CHECK(ld >= heads * s.D, kInternal, "CudaExec::", method, ": a bf16 ", arg, "'s row stride ",
             ld, " is below ", heads, " heads of ", s.D);
  return true;
}

namespace {

// Consecutive slots in a staging buffer, handed out as needed; each starts 64-element aligned
// (align64), so the sizes given are already rounded.
class StageSlots {
 public:
  explicit StageSlots(Bf16* base) : next_(base) {}
  // The next slot of n elements, or null (and no slot used) when not needed.
  Bf16* take(int64_t n, bool needed = true) {
    if (!needed) return nullptr;
    Bf16* p = next_;
    next_ += n;
    return p;
  }

 private:
  Bf16* next_;
};

}  // namespace

// Note [cuda-exec-bf16]: the dense bf16 rows of an attention operand: a bf16 one itself, an fp32
// one rounded into `staged`.
static const Bf16* bf16_rows(Context& ctx, ActIn a, bool is_bf16_rows, int64_t ld, Bf16* staged,
                             int64_t rows, int64_t HD) {
  if (is_bf16_rows) return bf16_of(a);
  to_bf16_rows(ctx, staged, HD, static_cast<const float*>(a.data), ld, rows, HD);
  return staged;
}

// Every operand in dense rows: H * D for q, out and their gradients, Hkv * D for k, v and theirs.
static AttentionShape dense_rows(const AttentionShape& s) {
  AttentionShape c = s;
  c.ldq = c.ldo = s.H * s.D;
  c.ldk = c.ldv = s.kv_heads() * s.D;
  return c;
}

// The shape the bf16 kernels see: dense rows, except that bf16 q, k and v keep their own row
// strides (strided_bf16); the gradients dq, dk, dv are written at those of q, k and v.
static AttentionShape bf16_shape(const AttentionShape& s, bool q_bf16, bool k_bf16, bool v_bf16) {
  AttentionShape c = dense_rows(s);
  if (q_bf16) c.ldq = s.ldq;
  if (k_bf16) c.ldk = s.ldk;
  if (v_bf16) c.ldv = s.ldv;
  return c;
}

void CudaExec::attention_forward(const AttentionShape& s, ActOut out, float* saved, ActIn q,
                                 ActIn k, ActIn v, const float* scale, float* max_abs_logit) {
  const char* m = "attention_forward";
  const int64_t Hkv = s.kv_heads();
  const bool out_bf16 = dense_bf16(out, s.ldo, s, precision_, m, "out");
  const bool q_bf16 = strided_bf16(q, s.ldq, s.H, s, precision_, m, "q");
  const bool k_bf16 = strided_bf16(k, s.ldk, Hkv, s, precision_, m, "k");
  const bool v_bf16 = strided_bf16(v, s.ldv, Hkv, s, precision_, m, "v");
  if (precision_ == Precision::kFp32) {
    cuda::attention_forward<float>(
        ctx_, s, static_cast<float*>(out.data), saved, static_cast<const float*>(q.data),
        static_cast<const float*>(k.data), static_cast<const float*>(v.data), scale, max_abs_logit);
    return;
  }
  // Note [cuda-exec-bf16]: bf16 q, k, v are read in place at their row strides and a bf16 out
  // is written in place; staging holds whichever of them are fp32, as dense bf16 rows.
  const int64_t BT = s.B * s.T, HD = s.H * s.D, KD = Hkv * s.D;
  const int64_t n = align64(BT * HD), nk = align64(BT * KD);
  StageSlots slots(
      stage((q_bf16 ? 0 : n) + (k_bf16 ? 0 : nk) + (v_bf16 ? 0 : nk) + (out_bf16 ? 0 : n)));
  const Bf16* qb = bf16_rows(ctx_, q, q_bf16, s.ldq, slots.take(n, !q_bf16), BT, HD);
  const Bf16* kb = bf16_rows(ctx_, k, k_bf16, s.ldk, slots.take(nk, !k_bf16), BT, KD);
  const Bf16* vb = bf16_rows(ctx_, v, v_bf16, s.ldv, slots.take(nk, !v_bf16), BT, KD);
  Bf16* ob = out_bf16 ? static_cast<Bf16*>(out.data) : slots.take(n);
  const AttentionShape c = bf16_shape(s, q_bf16, k_bf16, v_bf16);
  if (use_cudnn(c)) {
    cudnn::sdpa_forward(ctx_, c, ob, saved, qb, kb, vb, scale);
    if (max_abs_logit != nullptr)
      attention_max_abs_logit<Bf16>(ctx_, c, qb, kb, scale, max_abs_logit);
  } else {
    cuda::attention_forward<Bf16>(ctx_, c, ob, saved, qb, kb, vb, scale, max_abs_logit);
  }
  if (!out_bf16) {
    from_bf16_rows(ctx_, static_cast<float*>(out.data), s.ldo, ob, HD, BT, HD,
                   /*accumulate=*/false);
  }
}

bool CudaExec::use_cudnn(const AttentionShape& c) {
  // Decided once per shape, so a forward and its backward always take the same path (their
  // saved log-sum-exp must come from the same kernel), keyed by all that changes what cuDNN is
  // asked: the k/v heads and the row strides of q, k and v (strided_bf16) too.
  const std::array<int64_t, 8> key{c.B, c.T, c.H, c.kv_heads(), c.D, c.ldq, c.ldk, c.ldv};
  auto it = cudnn_shapes_.find(key);
  if (it == cudnn_shapes_.end()) {
    std::string why;
    it = cudnn_shapes_.emplace(key, cudnn::sdpa_available(ctx_, c, &why)).first;
    attention_path_ =
        it->second ? "cuDNN fused SDPA" : "keel's fused attention (cuDNN: " + why + ")";
    // Neither path takes the shape: one line naming the field, not the kernel's own error.
    if (!it->second) require_head_dim(c, why);
  }
  return it->second;
}

// An attention gradient the bf16 kernels wrote in dense rows (src, row stride lds) to its own
// memory dst at row stride ld: copied as bf16, or widened exactly into fp32 (Note [act-dtype]).
static void store_rows(Context& ctx, ActOut dst, int64_t ld, const Bf16* src, int64_t lds,
                       int64_t rows, int64_t cols) {
  if (dst.dtype == keel::DType::kBF16) {
    copy_bf16_rows(ctx, static_cast<Bf16*>(dst.data), ld, src, lds, rows, cols);
  } else {
    from_bf16_rows(ctx, static_cast<float*>(dst.data), ld, src, lds, rows, cols,
                   /*accumulate=*/false);
  }
}

void CudaExec::attention_backward(const AttentionShape& s, ActOut dq, ActOut dk, ActOut dv,
                                  float* dscale, ActIn dout, ActIn out, const float* saved, ActIn q,
                                  ActIn k, ActIn v, const float* scale, float* /*workspace*/) {
  const char* m = "attention_backward";
  const int64_t Hkv = s.kv_heads();
  const bool dout_bf16 = dense_bf16(dout, s.ldo, s, precision_, m, "dout");
  const bool out_bf16 = dense_bf16(out, s.ldo, s, precision_, m, "out");
  const bool q_bf16 = strided_bf16(q, s.ldq, s.H, s, precision_, m, "q");
  const bool k_bf16 = strided_bf16(k, s.ldk, Hkv, s, precision_, m, "k");
  const bool v_bf16 = strided_bf16(v, s.ldv, Hkv, s, precision_, m, "v");
  const bool dq_bf16 = is_bf16(dq, precision_, m, "dq"), dk_bf16 = is_bf16(dk, precision_, m, "dk"),
             dv_bf16 = is_bf16(dv, precision_, m, "dv");
  if (precision_ == Precision::kFp32) {
    cuda::attention_backward<float>(
        ctx_, s, static_cast<float*>(dq.data), static_cast<float*>(dk.data),
        static_cast<float*>(dv.data), dscale, static_cast<const float*>(dout.data),
        static_cast<const float*>(out.data), saved, static_cast<const float*>(q.data),
        static_cast<const float*>(k.data), static_cast<const float*>(v.data), scale);
    return;
  }
  // Note [cuda-exec-bf16]: bf16 q, k and out are what the forward read and wrote; fp32 ones round
  // to the same values (an fp32 out was widened from the forward's bf16 output), so the backward
  // sees what the forward computed.
  // The kernels write dq, dk and dv as bf16 rows at the row strides of the q, k and v they read
  // (one stride for an operand and its gradient): dense, or a bf16 operand's own (bf16_shape). A
  // bf16 gradient at that stride is written where it is (Note [act-dtype]); any other is written
  // into staging, then copied (bf16) or widened (fp32) to its own row stride. Staging also holds
  // whichever of q, k, v, out, dout are fp32.
  const AttentionShape c = bf16_shape(s, q_bf16, k_bf16, v_bf16);
  const int64_t BT = s.B * s.T, HD = s.H * s.D, KD = Hkv * s.D;
  const int64_t n = align64(BT * HD), nk = align64(BT * KD);
  const int64_t ndq = align64(BT * c.ldq), ndk = align64(BT * c.ldk), ndv = align64(BT * c.ldv);
  const bool dq_here = dq_bf16 && s.ldq == c.ldq, dk_here = dk_bf16 && s.ldk == c.ldk,
             dv_here = dv_bf16 && s.ldv == c.ldv;
  StageSlots slots(stage((dq_here ? 0 : ndq) + (dk_here ? 0 : ndk) + (dv_here ? 0 : ndv) +
                         (q_bf16 ? 0 : n) + (k_bf16 ? 0 : nk) + (v_bf16 ? 0 : nk) +
                         (out_bf16 ? 0 : n) + (dout_bf16 ? 0 : n)));
  Bf16* dqb = dq_here ? static_cast<Bf16*>(dq.data) : slots.take(ndq);
  Bf16* dkb = dk_here ? static_cast<Bf16*>(dk.data) : slots.take(ndk);
  Bf16* dvb = dv_here ? static_cast<Bf16*>(dv.data) : slots.take(ndv);
  const Bf16* qb = bf16_rows(ctx_, q, q_bf16, s.ldq, slots.take(n, !q_bf16), BT, HD);
  const Bf16* kb = bf16_rows(ctx_, k, k_bf16, s.ldk, slots.take(nk, !k_bf16), BT, KD);
  const Bf16* vb = bf16_rows(ctx_, v, v_bf16, s.ldv, slots.take(nk, !v_bf16), BT, KD);
  const Bf16* ob = bf16_rows(ctx_, out, out_bf16, s.ldo, slots.take(n, !out_bf16), BT, HD);
  const Bf16* gb = bf16_rows(ctx_, dout, dout_bf16, s.ldo, slots.take(n, !dout_bf16), BT, HD);
  if (use_cudnn(c)) {
    cudnn::sdpa_backward(ctx_, c, dqb, dkb, dvb, dscale, gb, ob, saved, qb, kb, vb, scale);
  } else {
    cuda::attention_backward<Bf16>(ctx_, c, dqb, dkb, dvb, dscale, gb, ob, saved, qb, kb, vb,
                                   scale);
  }
  if (!dq_here) store_rows(ctx_, dq, s.ldq, dqb, c.ldq, BT, HD);
  if (!dk_here) store_rows(ctx_, dk, s.ldk, dkb, c.ldk, BT, KD);
  if (!dv_here) store_rows(ctx_, dv, s.ldv, dvb, c.ldv, BT, KD);
}

void CudaExec::attention_scales(float* out, const float* gain, int64_t H, bool shared_gain,
                                float default_scale) {
  cuda::attention_scales(ctx_, out, gain, H, shared_gain, default_scale);
}

void CudaExec::scale_grad_accumulate(float* grad, const float* dscale, int64_t H,
                                     bool shared_gain) {
  cuda::scale_grad_accumulate(ctx_, grad, dscale, H, shared_gain);
}

// ---- rope.h ----

const DeviceRopeTable& CudaExec::device_rope_table(const RopeTable& table) {
  RopeEntry& e = rope_tables_[&table];
  if (e.table == nullptr || e.host_cos != table.cos.data() || e.host_sin != table.sin.data() ||
      e.max_positions != table.max_positions || e.half_dim != table.half_dim) {
    // A new table, or another one at the address of one that is gone. The old device copy may
    // still be read by enqueued kernels; its memory returns to the stream-ordered cache, so
    // later users of the block come after them (Note [cuda-stream-order]).
    e.table = std::make_unique<DeviceRopeTable>(ctx_, table);
    e.host_cos = table.cos.data();
    e.host_sin = table.sin.data();
    e.max_positions = table.max_positions;
    e.half_dim = table.half_dim;
  }
  return *e.table;
}

void CudaExec::rope_forward(const RopeTable& table, ActOut y, ActIn x, int64_t B, int64_t T,
                            int64_t H, int64_t D, int64_t row_stride) {
  if (is_bf16(x, precision_, "rope_forward", "x")) {
    KEEL_CHECK(is_bf16(y, precision_, "rope_forward", "y"), kInternal,
               "CudaExec::rope_forward: a bf16 x needs a bf16 y");
    cuda::rope_forward(ctx_, device_rope_table(table), static_cast<Bf16*>(y.data), bf16_of(x), B, T,
                       H, D, row_stride);
    return;
  }
  const float* xf = static_cast<const float*>(x.data);
  with_typed(y, precision_, "rope_forward", "y", [&](auto* out) {
    cuda::rope_forward(ctx_, device_rope_table(table), out, xf, B, T, H, D, row_stride);
  });
}

void CudaExec::rope_backward(const RopeTable& table, ActOut dx, ActIn dy, int64_t B, int64_t T,
                             int64_t H, int64_t D, int64_t row_stride) {
  const bool bf16 = is_bf16(dx, precision_, "rope_backward", "dx");
  KEEL_CHECK(is_bf16(dy, precision_, "rope_backward", "dy") == bf16, kInternal,
             "CudaExec::rope_backward: dx and dy have different dtypes");
  if (bf16) {
    cuda::rope_backward(ctx_, device_rope_table(table), static_cast<Bf16*>(dx.data), bf16_of(dy), B,
                        T, H, D, row_stride);
  } else {
    cuda::rope_backward(ctx_, device_rope_table(table), static_cast<float*>(dx.data),
                        static_cast<const float*>(dy.data), B, T, H, D, row_stride);
  }
}

// ---- embedding.h ----

void CudaExec::embedding_forward(float* out, const int32_t* tokens, int64_t N, const float* wte,
                                 int64_t v_begin, int64_t V_local, int64_t C) {
  cuda::embedding_forward(ctx_, out, tokens, N, wte, v_begin, V_local, C);
}

void CudaExec::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                                  int64_t v_begin, int64_t V_local, int64_t C) {
  cuda::embedding_backward(ctx_, dwte, dout, tokens, N, v_begin, V_local, C);
}

void CudaExec::position_forward(float* out, const float* wpe, int64_t B, int64_t T, int64_t C) {
  cuda::position_forward(ctx_, out, wpe, B, T, C);
}

void CudaExec::position_backward(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) {
  cuda::position_backward(ctx_, dwpe, dout, B, T, C);
}

// ---- cross_entropy.h ----

void CudaExec::xent_row_max(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                            float* row_max) {
  with_typed(logits, precision_, "xent_row_max", "logits",
             [&](auto* l) { cuda::xent_row_max(ctx_, l, N, V_local, v_valid_local, row_max); });
}

void CudaExec::xent_row_sumexp(ActIn logits, const float* row_max, int64_t N, int64_t V_local,
                               int64_t v_valid_local, float* sumexp) {
  with_typed(logits, precision_, "xent_row_sumexp", "logits", [&](auto* l) {
    cuda::xent_row_sumexp(ctx_, l, row_max, N, V_local, v_valid_local, sumexp);
  });
}

void CudaExec::xent_row_max_sumexp(ActIn logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                                   float* row_max, float* sumexp) {
  with_typed(logits, precision_, "xent_row_max_sumexp", "logits", [&](auto* l) {
    cuda::xent_row_max_sumexp(ctx_, l, N, V_local, v_valid_local, row_max, sumexp);
  });
}

void CudaExec::xent_fused(ActOut dlogits, ActIn logits, const int32_t* targets, int64_t N,
                          int64_t V_local, int64_t v_valid_local, int64_t v_begin, float grad_scale,
                          float z_coef, float* row_max, float* sumexp) {
  const bool bf16 = is_bf16(logits, precision_, "xent_fused", "logits");
  KEEL_CHECK(is_bf16(dlogits, precision_, "xent_fused", "dlogits") == bf16, kInternal,
             "CudaExec::xent_fused: dlogits and logits differ in dtype");
  if (bf16) {
    cuda::xent_fused(ctx_, static_cast<Bf16*>(dlogits.data), bf16_of(logits), targets, N, V_local,
                     v_valid_local, v_begin, grad_scale, z_coef, row_max, sumexp);
  } else {
    cuda::xent_fused(ctx_, static_cast<float*>(dlogits.data),
                     static_cast<const float*>(logits.data), targets, N, V_local, v_valid_local,
                     v_begin, grad_scale, z_coef, row_max, sumexp);
  }
}

void CudaExec::xent_target_logit(ActIn logits, const int32_t* targets, int64_t N, int64_t V_local,
                                 int64_t v_begin, float* target_logit) {
  with_typed(logits, precision_, "xent_target_logit", "logits", [&](auto* l) {
    cuda::xent_target_logit(ctx_, l, targets, N, V_local, v_begin, target_logit);
  });
}

void CudaExec::xent_finish(const float* row_max, const float* sumexp, const float* target_logit,
                           int64_t N, float* lse, double* sums) {
  cuda::xent_finish(ctx_, row_max, sumexp, target_logit, N, lse, sums);
}

void CudaExec::xent_backward(ActOut dlogits, ActIn logits, const float* lse, const int32_t* targets,
                             int64_t N, int64_t V_local, int64_t v_valid_local, int64_t v_begin,
                             float grad_scale, float z_coef) {
  const bool bf16 = is_bf16(logits, precision_, "xent_backward", "logits");
  KEEL_CHECK(is_bf16(dlogits, precision_, "xent_backward", "dlogits") == bf16, kInternal,
             "CudaExec::xent_backward: dlogits and logits differ in dtype");
  if (bf16) {
    cuda::xent_backward(ctx_, static_cast<Bf16*>(dlogits.data), bf16_of(logits), lse, targets, N,
                        V_local, v_valid_local, v_begin, grad_scale, z_coef);
  } else {
    cuda::xent_backward(ctx_, static_cast<float*>(dlogits.data),
                        static_cast<const float*>(logits.data), lse, targets, N, V_local,
                        v_valid_local, v_begin, grad_scale, z_coef);
  }
}

// ---- adamw.h ----

void CudaExec::adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                            const AdamWStep& step) {
  cuda::adamw_update(ctx_, param, grad, m, v, n, step);
}

void register_cuda_exec_factory() {
  kernels::set_exec_factory(Device::kCuda, &make_cuda_exec, &device_count);
}

}  // namespace keel::kernels::cuda
