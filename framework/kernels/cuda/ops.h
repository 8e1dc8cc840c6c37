// The CUDA backend's non-GEMM kernels. Each has the semantics of the CPU kernel of the same name
// in framework/kernels/*.h (the reference the tests compare against), takes the execution context
// first and device pointers after it, and runs on ctx's stream (asynchronous: results are visible
// to the host after ctx.copy_to_host or ctx.synchronize). Plain C++ header (no CUDA headers).
// Where a form takes Bf16 it reads and writes bf16 and computes in fp32.
#pragma once

#include <cstdint>

#include "framework/kernels/adamw.h"
#include "framework/kernels/cuda/bf16.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/glu.h"
#include "framework/kernels/norm.h"
#include "framework/kernels/rope.h"

namespace keel::kernels::cuda {

// ---- element-wise (framework/kernels/elementwise.h; GELU's math is shared: gelu_scalar) ----
void gelu_forward(Context& ctx, float* out, const float* inp, int64_t n);  // (=)
void gelu_forward(Context& ctx, Bf16* out, const Bf16* inp, int64_t n);
// fp32 in, bf16 out (Note [act-dtype]): the fp32 result rounded once.
void gelu_forward(Context& ctx, Bf16* out, const float* inp, int64_t n);
void gelu_backward(Context& ctx, float* dinp, const float* inp, const float* dout, int64_t n);
void gelu_backward(Context& ctx, Bf16* dinp, const Bf16* inp, const Bf16* dout, int64_t n);
// dinp[N, C] = dout * gelu'(inp) in fp32, stored as float or bf16 (Note [act-dtype]); dbias
// (may be null) += the fp32 values' column sums (Note [fused-bias-grad], cuda/internal.h). dinp may
// alias dout only as float.
void gelu_backward(Context& ctx, float* dinp, float* dbias, const float* inp, const float* dout,
                   int64_t N, int64_t C);
void gelu_backward(Context& ctx, Bf16* dinp, float* dbias, const float* inp, const float* dout,
                   int64_t N, int64_t C);
// bf16 inp and dout (the MLP's bf16 pre-activation and hidden gradient: Note [act-dtype]), each
// widened exactly; the same fp32 arithmetic, dinp rounded once, dbias from the fp32 values.
void gelu_backward(Context& ctx, Bf16* dinp, float* dbias, const Bf16* inp, const Bf16* dout,
                   int64_t N, int64_t C);
void add(Context& ctx, float* out, const float* a, const float* b, int64_t n);  // (=)
void add(Context& ctx, Bf16* out, const Bf16* a, const Bf16* b, int64_t n);
void add(Context& ctx, float* out, const float* a, const Bf16* b, int64_t n);  // b widened
void add_inplace(Context& ctx, float* y, const float* x, int64_t n);           // y += x
void add_inplace(Context& ctx, Bf16* y, const Bf16* x, int64_t n);

// ---- gated linear units (framework/kernels/glu.h; the per-element math is shared) ----
// out = act(gate) * up (=); out may be gate or up (in place).
void glu_forward(Context& ctx, GluAct act, float* out, const float* gate, const float* up,
                 int64_t n);
void glu_forward(Context& ctx, GluAct act, Bf16* out, const Bf16* gate, const Bf16* up, int64_t n);
// fp32 in, bf16 out (Note [act-dtype]): the fp32 result rounded once; out must not alias.
void glu_forward(Context& ctx, GluAct act, Bf16* out, const float* gate, const float* up,
                 int64_t n);
// dgate = dout * up * act'(gate), dup = dout * act(gate) (both =); dup may be dout (in place),
// dgate must not alias dout, gate or up.
void glu_backward(Context& ctx, GluAct act, float* dgate, float* dup, const float* dout,
                  const float* gate, const float* up, int64_t n);
void glu_backward(Context& ctx, GluAct act, Bf16* dgate, Bf16* dup, const Bf16* dout,
                  const Bf16* gate, const Bf16* up, int64_t n);
// The same over [N, C] from fp32 inputs, dgate and dup stored as float or bf16 (Note
// [act-dtype]); dgate_bias and dup_bias (may be null) += the fp32 values' column sums (Note
// [fused-bias-grad]). dup may alias dout only as float.
void glu_backward(Context& ctx, GluAct act, float* dgate, float* dup, float* dgate_bias,
                  float* dup_bias, const float* dout, const float* gate, const float* up, int64_t N,
                  int64_t C);
void glu_backward(Context& ctx, GluAct act, Bf16* dgate, Bf16* dup, float* dgate_bias,
                  float* dup_bias, const float* dout, const float* gate, const float* up, int64_t N,
                  int64_t C);

// Sum of squares of x[n] in double, into the device double *out (= or += per accumulate), with a
// fixed partition of x: bitwise reproducible run to run. Summing several tensors into one *out
// and taking the square root gives the global gradient norm without a host round trip.
void sum_squares(Context& ctx, const float* x, int64_t n, double* out, bool accumulate);
// Sum of squares of x over segments[0..count) (kernels::NormSegment, adamw.h), into the device
// double *out (=): the global gradient norm's square in ceil(count / 240) + 1 launches, where
// sum_squares per tensor takes two each. Its order is fixed by the segments' lengths alone (Note
// [multi-tensor norm] in elementwise.cu), so it is bitwise reproducible run to run, but it is not
// sum_squares' order: the two agree to double rounding, not bitwise. Segments may be empty (no
// segment, or only empty ones: *out = 0). Uses ctx's scratch.
void sum_squares_segments(Context& ctx, const float* x, const NormSegment* segments, int64_t count,
                          double* out);
// *scale = keel::clip_scale(sqrt(*sum_sq), max_norm) (framework/optim/optimizer.h), on the device.
void clip_scale_from_sum_squares(Context& ctx, const double* sum_sq, double max_norm, float* scale);

// AdamW (framework/kernels/adamw.h). The gradient is multiplied by step.grad_scale and, when
// device_grad_scale is not null, by *device_grad_scale (clipping computed on the device).
void adamw_update(Context& ctx, float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWStep& step, const float* device_grad_scale = nullptr);
// AdamW over segments of flat arenas (kernels::AdamWSegment, adamw.h: the optimizer's layout) in
// one launch per 128 segments instead of one per tensor. Each segment's elements get exactly
// adamw_update's arithmetic, with step.weight_decay where decay is set and 0 elsewhere. Segments
// must not overlap; empty ones are skipped.
void adamw_update_segments(Context& ctx, float* param, const float* grad, float* m, float* v,
                           const AdamWSegment* segments, int64_t count, const AdamWStep& step,
                           const float* device_grad_scale = nullptr);

// ---- norms (framework/kernels/norm.h): LayerNorm / RMSNorm / L2 over grouped, strided rows ----
// Each activation operand (out, inp; dinp, dout, inp) is float or Bf16, in any combination (all
// are instantiated in norm.cu): a bf16 operand is widened exactly on its load, and a bf16 output
// is the fp32 result rounded once (dinp += rounds the sum once). Gains and biases are fp32 (master
// weights); statistics and math are fp32, mean/rstd are saved in fp32 and dweight/dbias accumulate
// in fp32 exactly as the fp32 forms do (Note [act-dtype]).
template <typename TO, typename TI>
void norm_forward(Context& ctx, NormOp op, const NormShape& s, TO* out, const TI* inp,
                  const float* weight, const float* bias, float* mean, float* rstd, float eps);
template <typename TD, typename TG, typename TI>
void norm_backward(Context& ctx, NormOp op, const NormShape& s, TD* dinp, bool accumulate,
                   float* dweight, float* dbias, const TG* dout, const TI* inp, const float* weight,
                   const float* mean, const float* rstd);

// ---- cross-entropy with z-loss, vocab-parallel phases (framework/kernels/cross_entropy.h) ----
// T: float or Bf16 logits (Note [act-dtype]); the statistics are fp32 and computed in fp32.
template <typename T>
void xent_row_max(Context& ctx, const T* logits, int64_t N, int64_t V_local, int64_t v_valid_local,
                  float* row_max);
template <typename T>
void xent_row_sumexp(Context& ctx, const T* logits, const float* row_max, int64_t N,
                     int64_t V_local, int64_t v_valid_local, float* sumexp);
// Both of the above in one kernel, bitwise the same results: a block takes a row's maximum, then
// its sum-exp while the row is likely still in L2 (ExecContext::xent_row_max_sumexp).
template <typename T>
void xent_row_max_sumexp(Context& ctx, const T* logits, int64_t N, int64_t V_local,
                         int64_t v_valid_local, float* row_max, float* sumexp);
// xent_row_max_sumexp and then xent_backward with each row's log-sum-exp from xent_row_lse (what
// xent_finish will write), one block per row: bitwise the separate calls' row_max, sumexp and
// dlogits (dlogits may alias logits). ExecContext::xent_fused.
template <typename T>
void xent_fused(Context& ctx, T* dlogits, const T* logits, const int32_t* targets, int64_t N,
                int64_t V_local, int64_t v_valid_local, int64_t v_begin, float grad_scale,
                float z_coef, float* row_max, float* sumexp);
template <typename T>
void xent_target_logit(Context& ctx, const T* logits, const int32_t* targets, int64_t N,
                       int64_t V_local, int64_t v_begin, float* target_logit);
// The finish after the all-reduces (the CPU's xent_finish): per row, in double,
// l = row_max + log(sumexp); lse[n] = l (as float; lse may alias sumexp); sums[3] (=, device
// doubles): sums[0] = sum_n (l - target_logit[n]), sums[1] = sum_n l^2, sums[2] = sum_n l. One
// block, a fixed order: bitwise reproducible run to run; equal to the CPU's serial sums to double
// rounding (not bitwise: the order differs).
void xent_finish(Context& ctx, const float* row_max, const float* sumexp, const float* target_logit,
                 int64_t N, float* lse, double* sums);
// dst[n] (=, device) = host_src[n] (host): the batch's token ids or targets, a host-to-device copy
// on ctx's stream (framework/kernels/gemm.h's load_tokens). Returns once the copy is complete, so
// host_src may be reused at once (pageable memory is staged by the runtime anyway).
void load_tokens(Context& ctx, int32_t* dst, const int32_t* host_src, int64_t n);
// dlogits (=, T, may alias logits) computed in fp32 and rounded once to T.
template <typename T>
void xent_backward(Context& ctx, T* dlogits, const T* logits, const float* lse,
                   const int32_t* targets, int64_t N, int64_t V_local, int64_t v_valid_local,
                   int64_t v_begin, float grad_scale, float z_coef);

// ---- attention's logit scales (framework/kernels/attention.h; attention_scales.cu) ----
// out[h] (=) = gain ? gain[shared_gain ? 0 : h] : default_scale for h < H; gain is the device
// L2 QK-norm scale parameter or null.
void attention_scales(Context& ctx, float* out, const float* gain, int64_t H, bool shared_gain,
                      float default_scale);
// grad[shared_gain ? 0 : h] += dscale[h] for h = 0 .. H-1 in turn (a shared gain adds the heads
// in increasing h on one thread, the CPU's order: bitwise equal to the CPU).
void scale_grad_accumulate(Context& ctx, float* grad, const float* dscale, int64_t H,
                           bool shared_gain);

// ---- embeddings (framework/kernels/embedding.h); tokens are device int32 ----
void embedding_forward(Context& ctx, float* out, const int32_t* tokens, int64_t N, const float* wte,
                       int64_t v_begin, int64_t V_local, int64_t C);
void embedding_forward(Context& ctx, Bf16* out, const int32_t* tokens, int64_t N, const Bf16* wte,
                       int64_t v_begin, int64_t V_local, int64_t C);
// dwte[tokens[n] - v_begin] += dout[n]: tokens sorted stably by row, each row's run summed in a
// fixed order (Note [embedding-backward-segments] in embedding.cu), so the result is
// deterministic: runs of up to 8 rows in the CPU's order (increasing n), longer ones in segments
// (within the fp32 bound of depth R + run / R). dwte stays fp32 (master gradients) for bf16 dout.
void embedding_backward(Context& ctx, float* dwte, const float* dout, const int32_t* tokens,
                        int64_t N, int64_t v_begin, int64_t V_local, int64_t C);
void embedding_backward(Context& ctx, float* dwte, const Bf16* dout, const int32_t* tokens,
                        int64_t N, int64_t v_begin, int64_t V_local, int64_t C);
void position_forward(Context& ctx, float* out, const float* wpe, int64_t B, int64_t T, int64_t C);
void position_forward(Context& ctx, Bf16* out, const Bf16* wpe, int64_t B, int64_t T, int64_t C);
void position_backward(Context& ctx, float* dwpe, const float* dout, int64_t B, int64_t T,
                       int64_t C);
void position_backward(Context& ctx, float* dwpe, const Bf16* dout, int64_t B, int64_t T,
                       int64_t C);

// ---- RoPE (framework/kernels/rope.h) ----
// The cos/sin table on the device, copied once from the CPU's RopeTable.
class DeviceRopeTable {
 public:
  DeviceRopeTable(Context& ctx, const RopeTable& table);
  int64_t max_positions() const { return max_positions_; }
  int64_t half_dim() const { return half_dim_; }
  const float* cos() const { return cos_.as<const float>(); }
  const float* sin() const { return sin_.as<const float>(); }

 private:
  int64_t max_positions_ = 0, half_dim_ = 0;
  DeviceBuffer cos_, sin_;
};
void rope_forward(Context& ctx, const DeviceRopeTable& table, float* y, const float* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset = 0);
void rope_forward(Context& ctx, const DeviceRopeTable& table, Bf16* y, const Bf16* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset = 0);
// fp32 in, bf16 out (Note [act-dtype]): the fp32 rotation rounded once; y must not overlap x.
void rope_forward(Context& ctx, const DeviceRopeTable& table, Bf16* y, const float* x, int64_t B,
                  int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset = 0);
void rope_backward(Context& ctx, const DeviceRopeTable& table, float* dx, const float* dy,
                   int64_t B, int64_t T, int64_t H, int64_t D, int64_t row_stride,
                   int64_t pos_offset = 0);
void rope_backward(Context& ctx, const DeviceRopeTable& table, Bf16* dx, const Bf16* dy, int64_t B,
                   int64_t T, int64_t H, int64_t D, int64_t row_stride, int64_t pos_offset = 0);

// ---- precision casts (cast.cu) ----
// out[r * ld_out + c] (=) = bf16(in[r * ld_in + c]) (round to nearest even) for r < rows,
// c < cols; and back, exactly, into fp32 (= or += per accumulate).
void to_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const float* in, int64_t ld_in,
                  int64_t rows, int64_t cols);
void from_bf16_rows(Context& ctx, float* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols, bool accumulate);
// out[r * ld_out + c] (=) = in[r * ld_in + c]: bf16 rows copied between strides (a dense kernel
// output into strided bf16 rows, Note [act-dtype]).
void copy_bf16_rows(Context& ctx, Bf16* out, int64_t ld_out, const Bf16* in, int64_t ld_in,
                    int64_t rows, int64_t cols);
// The same over n contiguous elements (launched as rows of up to 8192, so the grid fills the GPU).
void to_bf16(Context& ctx, Bf16* out, const float* in, int64_t n);
void from_bf16(Context& ctx, float* out, const Bf16* in, int64_t n);

// ---- utilities ----
// x[i] = lo + (hi - lo) * philox_uniform(seed, stream=0, i) (framework/philox.h), on the device:
// benchmark inputs without a host round trip.
void fill_uniform(Context& ctx, float* x, int64_t n, float lo, float hi, uint64_t seed);
void fill_uniform(Context& ctx, Bf16* x, int64_t n, float lo, float hi, uint64_t seed);

}  // namespace keel::kernels::cuda
