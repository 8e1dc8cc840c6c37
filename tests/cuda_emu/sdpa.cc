// The CUDA emulator's cuDNN attention (see README.md here), in place of sdpa_cudnn.cc, so the
// execution context's cuDNN path runs on the emulator too: its staging, the per-head scale fold
// of Note [cudnn-sdpa-scale] (fold_head_scale and unfold_head_scale_grad, the backend's own
// kernels), and the standalone max |logit| beside it. With KEEL_CUDA_EMU_CUDNN=1 sdpa_available
// takes the shapes cuDNN takes, grouped-query ones (Hkv < H k/v heads) included, but head dims
// only up to 128 (keel's fused kernel's limit, where real cuDNN on Hopper takes 256: see
// shape_problem in sdpa_cudnn.cc), and the attention itself is keel's fused kernel run as cuDNN
// is: on q' = scale * q with unit scales, the log-sum-exp as its softmax stats, dk and dv of the
// Hkv k/v heads summed over their groups. Without it, this build behaves as one without the cuDNN
// frontend.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "framework/error.h"
#include "framework/kernels/cuda/attention.h"
#include "framework/kernels/cuda/sdpa_cudnn.h"
#include "tests/cuda_emu/emu.h"
#include "tests/cuda_emu/roofline.h"

namespace keel::kernels::cuda::cudnn {

namespace {

bool enabled() {
  const char* env = std::getenv("KEEL_CUDA_EMU_CUDNN");
  return env != nullptr && std::string(env) == "1";
}

std::string shape_string(const AttentionShape& s) {
  return keel::detail::concat("B=", s.B, " T=", s.T, " H=", s.H, " Hkv=", s.kv_heads(), " D=", s.D,
                              " ldq=", s.ldq, " ldk=", s.ldk, " ldv=", s.ldv, " ldo=", s.ldo);
}

// sdpa_cudnn.cc's limits, with the fused kernel's D <= 128 that stands in for cuDNN here in place
// of cuDNN's 256.
std::string shape_problem(const AttentionShape& s) {
  if (!enabled()) return "built without the cuDNN frontend (emulator: KEEL_CUDA_EMU_CUDNN unset)";
  if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.D <= 0) return "empty shape";
  if (s.D % 8 != 0 || s.D > kAttentionMaxHeadDim) {
    return "head dim D must be a multiple of 8 and at most 128 (emulated cuDNN)";
  }
  const int64_t Hkv = s.kv_heads();
  if (Hkv <= 0 || s.H % Hkv != 0) return "k/v heads Hkv must divide the query heads H";
  const int64_t c = s.H * s.D, kc = Hkv * s.D;
  if (s.ldq < c || s.ldo < c) return "a q or out row stride is below H * D";
  if (s.ldk < kc || s.ldv < kc) return "a k or v row stride is below Hkv * D";
  if (s.ldq % 8 != 0 || s.ldk % 8 != 0 || s.ldv % 8 != 0 || s.ldo % 8 != 0) {
    return "row strides must be multiples of 8 elements (16-byte rows)";
  }
  return "";
}

void require(const AttentionShape& s, const char* what) {
  const std::string problem = shape_problem(s);
  KEEL_CHECK(problem.empty(), kInternal, "cudnn ", what, " unavailable [", shape_string(s),
             "]: ", problem);
}

// Unit scales for the folded q', in device memory (the emulator's is the host's).
DeviceBuffer unit_scales(Context& ctx, int64_t H) {
  DeviceBuffer ones = ctx.alloc(static_cast<size_t>(H) * sizeof(float));
  const std::vector<float> host(static_cast<size_t>(H), 1.0f);
  ctx.copy_to_device(ones.data(), host.data(), host.size() * sizeof(float));
  return ones;
}

// The shape of q' (dense rows of H * D) with the other operands' strides (and k/v heads).
AttentionShape folded(const AttentionShape& s) {
  AttentionShape f = s;
  f.ldq = s.H * s.D;
  return f;
}

}  // namespace

bool sdpa_available(Context&, const AttentionShape& s, std::string* why) {
  const std::string problem = shape_problem(s);
  if (why != nullptr) *why = problem;
  return problem.empty();
}

void sdpa_forward(Context& ctx, const AttentionShape& s, Bf16* out, float* lse, const Bf16* q,
                  const Bf16* k, const Bf16* v, const float* scale) {
  require(s, "sdpa_forward");
  DeviceBuffer qs = ctx.alloc(static_cast<size_t>(s.B * s.T * s.H * s.D) * sizeof(Bf16));
  fold_head_scale(ctx, s, qs.as<Bf16>(), q, scale);
  const DeviceBuffer ones = unit_scales(ctx, s.H);
  // Priced as cuDNN's kernel (roofline.h): QK^T and PV, causal, 2 B H T^2 D flops.
  const keel_emu::roofline::Label label("cuDNN SDPA forward", 0, 2.0 * s.B * s.H * s.T * s.T * s.D,
                                        keel_emu::roofline::Peak::kTensorBf16);
  attention_forward<Bf16>(ctx, folded(s), out, lse, qs.as<Bf16>(), k, v, ones.as<float>(), nullptr);
}

// The backwards run per algorithm asked for (train.deterministic reaches ctx), for tests; the
// emulation itself is the same deterministic kernel for both.
namespace {
std::atomic<uint64_t> backward_calls[2];
}  // namespace

void sdpa_backward(Context& ctx, const AttentionShape& s, Bf16* dq, Bf16* dk, Bf16* dv,
                   float* dscale, const Bf16* dout, const Bf16* out, const float* lse,
                   const Bf16* q, const Bf16* k, const Bf16* v, const float* scale) {
  require(s, "sdpa_backward");
  ++backward_calls[ctx.sdpa_backward() == SdpaBackward::kDeterministic ? 0 : 1];
  const int64_t HD = s.H * s.D, rows = s.B * s.T;
  DeviceBuffer qs = ctx.alloc(static_cast<size_t>(rows * HD) * sizeof(Bf16));
  DeviceBuffer dqs = ctx.alloc(static_cast<size_t>(rows * HD) * sizeof(Bf16));
  fold_head_scale(ctx, s, qs.as<Bf16>(), q, scale);
  const DeviceBuffer ones = unit_scales(ctx, s.H);
  {
    // Priced as cuDNN's backward (roofline.h): QK^T recomputed, dP, dV, dK and dQ, causal, 2.5x
    // the forward's flops (FlashAttention-2's count).
    const keel_emu::roofline::Label label("cuDNN SDPA backward", 0,
                                          5.0 * s.B * s.H * s.T * s.T * s.D,
                                          keel_emu::roofline::Peak::kTensorBf16);
    attention_backward<Bf16>(ctx, folded(s), dqs.as<Bf16>(), dk, dv, nullptr, dout, out, lse,
                             qs.as<Bf16>(), k, v, ones.as<float>());
  }
  // dq' into dq's rows (stride ldq), a task of the stream: emulated device memory is host memory.
  keel_emu::submit(ctx.stream(), [dq, src = dqs.as<Bf16>(), rows, HD, ldq = s.ldq] {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < HD; ++j) dq[r * ldq + j] = src[r * HD + j];
    }
  });
  unfold_head_scale_grad(ctx, s, dq, dscale, q, scale);
}

// Declared by the tests that read it (tests/cuda_emu/budget_test.cc): not part of cuDNN's API.
uint64_t emu_backward_calls(SdpaBackward algo) {
  return backward_calls[algo == SdpaBackward::kDeterministic ? 0 : 1].load();
}

bool have_frontend() { return enabled(); }

std::string library_version() {
  return enabled() ? "emulated cuDNN (keel's fused attention behind cuDNN's interface)"
                   : "built without the cuDNN frontend";
}

}  // namespace keel::kernels::cuda::cudnn
