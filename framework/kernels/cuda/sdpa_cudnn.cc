// cuDNN fused attention through the cuDNN frontend's graph API (see sdpa_cudnn.h). Host code only:
// the per-head scale fold it needs is in sdpa_fold.cu. Built without the frontend
// (KEEL_HAVE_CUDNN_FRONTEND unset: its headers were not found at configure time) the functions
// report "built without the cuDNN frontend" and the caller uses keel's own attention kernel.
//
// cuDNN sees keel's [B, T, H, D] rows as (B, H, S, D) tensors with strides (T * ld, D, ld, 1), so
// fused-qkv rows and separate arrays both go in without a copy; the softmax stats (lse) are
// (B, H, T, 1) with strides (H * T, T, 1, 1). Grouped-query attention: K, V, dK and dV are
// (B, Hkv, S, D) with Hkv = s.kv_heads(), as in the frontend's samples/cpp/sdpa/fp16_fwd.cpp and
// fp16_bwd.cpp (h_k, h_v below h_q); cuDNN shares k/v head h / (H / Hkv) among query heads, and its
// backward sums dK, dV over each group (the frontend requires h_q % h_k == 0; shape_problem
// checks it first).
#include "framework/kernels/cuda/sdpa_cudnn.h"

#include <string>

#include "framework/error.h"

#if KEEL_HAVE_CUDNN_FRONTEND
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nvrtc.h>
// The frontend (1.20 and later) compiles in an RMSNorm+SiLU engine that builds its kernel with
// NVRTC, called directly; only graphs of that pattern reach it, never the SDPA graphs here. Weak
// references keep libnvrtc off the link line (an unresolved weak symbol is null), so the binaries
// start without NVRTC. cuDNN itself may still load libnvrtc at run time for its runtime-compiled
// engines; where it cannot, plan building fails, sdpa_available says why, and keel's own kernel
// runs (keel-gpu-train-bench's "attention:" line names the path and the reason).
#pragma weak nvrtcCreateProgram
#pragma weak nvrtcCompileProgram
#pragma weak nvrtcGetProgramLogSize
#pragma weak nvrtcGetProgramLog
#pragma weak nvrtcDestroyProgram
#pragma weak nvrtcGetCUBINSize
#pragma weak nvrtcGetCUBIN
#include <cudnn_frontend.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "framework/kernels/cuda/check.h"
#endif

namespace keel::kernels::cuda::cudnn {

namespace {

// Also the key of a shape's cached plans: every field a graph is built from.
std::string shape_string(const AttentionShape& s) {
  return keel::detail::concat("B=", s.B, " T=", s.T, " H=", s.H, " Hkv=", s.kv_heads(), " D=", s.D,
                              " ldq=", s.ldq, " ldk=", s.ldk, " ldv=", s.ldv, " ldo=", s.ldo);
}

}  // namespace

#if !KEEL_HAVE_CUDNN_FRONTEND

namespace {
constexpr const char* kNoFrontend = "built without the cuDNN frontend";
}  // namespace

bool sdpa_available(Context&, const AttentionShape&, std::string* why) {
  if (why != nullptr) *why = kNoFrontend;
  return false;
}

void sdpa_forward(Context&, const AttentionShape& s, Bf16*, float*, const Bf16*, const Bf16*,
                  const Bf16*, const float*) {
  KEEL_FAIL(kInternal, "cudnn sdpa_forward [", shape_string(s), "]: ", kNoFrontend);
}

void sdpa_backward(Context&, const AttentionShape& s, Bf16*, Bf16*, Bf16*, float*, const Bf16*,
                   const Bf16*, const float*, const Bf16*, const Bf16*, const Bf16*, const float*) {
  KEEL_FAIL(kInternal, "cudnn sdpa_backward [", shape_string(s), "]: ", kNoFrontend);
}

bool have_frontend() { return false; }
std::string library_version() { return kNoFrontend; }

#else  // KEEL_HAVE_CUDNN_FRONTEND

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

// "<call> failed: CUDNN_STATUS_... (<cuDNN's last error>) [<where>]".
[[noreturn]] void throw_cudnn_error(cudnnStatus_t status, const char* call,
                                    const std::string& where, const char* file, int line) {
  char last[512] = {};
  cudnnGetLastErrorString(last, sizeof(last));
  throw Error(ErrorKind::kInternal,
              keel::detail::concat(call, " failed: ", cudnnGetErrorString(status),
                                   last[0] != '\0' ? " (" : "", last, last[0] != '\0' ? ")" : "",
                                   " [", where, "]"),
              file, line);
}

#define KEEL_CUDNN_CHECK(call, where)                                          \
  do {                                                                         \
    const cudnnStatus_t keel_cudnn_status_ = (call);                           \
    if (keel_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                          \
      throw_cudnn_error(keel_cudnn_status_, #call, where, __FILE__, __LINE__); \
    }                                                                          \
  } while (0)

// A frontend call's error_t as a keel::Error naming the call and the shape.
void fe_check(fe::error_t status, const char* call, const std::string& where) {
  if (status.is_good()) return;
  std::ostringstream code;
  code << status.get_code();
  throw Error(ErrorKind::kInternal,
              keel::detail::concat("cudnn_frontend ", call, " failed: ", code.str(), " ",
                                   status.get_message(), " [", where, "]"),
              __FILE__, __LINE__);
}

// One shape's graph with its built plan; `error` (when not empty) says why cuDNN cannot run it,
// so an unsupported shape is tried once, not on every call.
struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string error;
};

// The cuDNN state of one Context: its handle and the plans built with it.
struct State {
  cudnnHandle_t handle = nullptr;
  std::map<std::string, Plan> plans;  // "fwd <shape>" / "bwd deterministic|fast <shape>"
  int64_t workspace_limit = 0;        // bytes a plan's workspace may take (workspace_limit())
};

// The most workspace one attention call may take: an eighth of the device's memory, or
// KEEL_CUDNN_WORKSPACE_LIMIT_MB. The deterministic backward's workspace grows as B * H * T^2 * 2
// bytes (402 MB for 124M at 16 x 1024 tokens, 34 GB at B 8, H 32, T 8192); a shape above the
// limit takes keel's own kernel, with the reason, rather than failing its allocation mid-step.
int64_t workspace_limit(int device) {
  if (const char* env = std::getenv("KEEL_CUDNN_WORKSPACE_LIMIT_MB")) {
    char* end = nullptr;
    const long long mb = std::strtoll(env, &end, 10);
    KEEL_CHECK(end != env && *end == '\0' && mb >= 0, kUsage, "KEEL_CUDNN_WORKSPACE_LIMIT_MB=", env,
               ": not a number of MiB");
    return static_cast<int64_t>(mb) << 20;
  }
  size_t free_bytes = 0, total_bytes = 0;
  KEEL_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes),
                  keel::detail::concat("device ", device));
  return static_cast<int64_t>(total_bytes / 8);
}

// States by (Context address, device). Context (device.h) has no slot for backend extensions, so
// the handle lives here; it is never destroyed: it holds no memory of the Context, and the stream
// it was last bound to is replaced on every use (state_locked), so a later Context at the same
// address reuses it safely; destroying handles at exit would race the CUDA runtime's teardown.
// The map itself is leaked for the same reason.
std::mutex states_mu;
std::map<std::pair<const Context*, int>, std::unique_ptr<State> >& states() {
  static auto* map = new std::map<std::pair<const Context*, int>, std::unique_ptr<State> >();
  return *map;
}

State& state_locked(Context& ctx) {
  auto& slot = states()[{&ctx, ctx.device()}];
  if (slot == nullptr) {
    auto st = std::make_unique<State>();
    const std::string where = keel::detail::concat("device ", ctx.device());
    KEEL_CUDA_CHECK(cudaSetDevice(ctx.device()), where);
    KEEL_CUDNN_CHECK(cudnnCreate(&st->handle), where);
    st->workspace_limit = workspace_limit(ctx.device());
    slot = std::move(st);
  }
  // Bound to this Context's stream before anything (plan building included) uses the handle: a
  // destroyed Context's stream may still be set in it.
  KEEL_CUDNN_CHECK(cudnnSetStream(slot->handle, ctx.stream()),
                   keel::detail::concat("device ", ctx.device()));
  return *slot;
}

// (B, heads, S, D) view of keel rows with row stride ld (heads: H for q, out and their gradients,
// Hkv for k, v and theirs), and the (B, H, T, 1) lse.
std::vector<int64_t> rows_dim(const AttentionShape& s, int64_t heads) {
  return {s.B, heads, s.T, s.D};
}
std::vector<int64_t> rows_stride(const AttentionShape& s, int64_t ld) {
  return {s.T * ld, s.D, ld, 1};
}
std::vector<int64_t> stats_dim(const AttentionShape& s) { return {s.B, s.H, s.T, 1}; }
std::vector<int64_t> stats_stride(const AttentionShape& s) { return {s.H * s.T, s.T, 1, 1}; }

fe::graph::Tensor_attributes rows_tensor(const AttentionShape& s, const char* name, Uid uid,
                                         int64_t heads, int64_t ld) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim(rows_dim(s, heads))
      .set_stride(rows_stride(s, ld));
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The forward graph: q' (dense rows of H * D, Note [cudnn-sdpa-scale]), k, v -> out, lse.
std::shared_ptr<fe::graph::Graph> forward_graph(const AttentionShape& s) {
  auto g = new_graph();
  const int64_t Hkv = s.kv_heads();
  auto q = g->tensor(rows_tensor(s, "q_scaled", kQ, s.H, s.H * s.D));
  auto k = g->tensor(rows_tensor(s, "k", kK, Hkv, s.ldk));
  auto v = g->tensor(rows_tensor(s, "v", kV, Hkv, s.ldv));
  auto options = fe::graph::SDPA_attributes()
                     .set_name("sdpa_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(1.0f)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);  // causal: key j <= query t
  auto [o, stats] = g->sdpa(q, k, v, options);
  o->set_output(true).set_uid(kO).set_dim(rows_dim(s, s.H)).set_stride(rows_stride(s, s.ldo));
  stats->set_output(true)
      .set_uid(kStats)
      .set_dim(stats_dim(s))
      .set_stride(stats_stride(s))
      .set_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The backward graph: q', k, v, out, dout, lse -> dq' (written into dq), dk, dv.
std::shared_ptr<fe::graph::Graph> backward_graph(const AttentionShape& s, SdpaBackward algo) {
  auto g = new_graph();
  const int64_t Hkv = s.kv_heads();
  auto q = g->tensor(rows_tensor(s, "q_scaled", kQ, s.H, s.H * s.D));
  auto k = g->tensor(rows_tensor(s, "k", kK, Hkv, s.ldk));
  auto v = g->tensor(rows_tensor(s, "v", kV, Hkv, s.ldv));
  auto o = g->tensor(rows_tensor(s, "out", kO, s.H, s.ldo));
  auto dout = g->tensor(rows_tensor(s, "dout", kDO, s.H, s.ldo));
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("lse")
                             .set_uid(kStats)
                             .set_dim(stats_dim(s))
                             .set_stride(stats_stride(s))
                             .set_data_type(fe::DataType_t::FLOAT));
  // Deterministic by default (train.deterministic): with cuDNN 9 the frontend otherwise
  // accumulates dq with atomics at every size, so gradients would not reproduce run to run. Asked
  // for determinism on Hopper it takes its dP-workspace algorithm (B * H * T^2 * 2 bytes of
  // workspace, tiles rounded up) and serialises dq's accumulation; keel allocates what the plan
  // asks for, up to workspace_limit(). SdpaBackward::kFast leaves cuDNN its default.
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("sdpa_backward")
                     .set_deterministic_algorithm(algo == SdpaBackward::kDeterministic)
                     .set_attn_scale(1.0f)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
  for (const auto& [t, uid, heads, ld] :
       {std::tuple{dq, kDQ, s.H, s.ldq}, std::tuple{dk, kDK, Hkv, s.ldk},
        std::tuple{dv, kDV, Hkv, s.ldv}}) {
    t->set_output(true).set_uid(uid).set_dim(rows_dim(s, heads)).set_stride(rows_stride(s, ld));
  }
  return g;
}

// Shape limits checked before cuDNN is asked, with messages that name the field: cuDNN needs
// 16-byte aligned rows (strides in multiples of 8 bf16) and head dims that are multiples of 8, and
// k/v heads that divide the query heads. Head dims up to 256: what cuDNN 9's bf16 SDPA takes
// forward and backward on Hopper (the support matrix of
// https://docs.nvidia.com/deeplearning/cudnn/frontend/latest/operations/Attention.html, Hopper
// Prefill and Bprop rows: d <= 256; and the backward node's validation in the pinned frontend
// 1.32, cudnn_frontend/node/scaled_dot_product_flash_attention.h: on sm_90 d_qk, d_v <= 256 and
// multiples of 8, elsewhere <= 128). On Ampere/Ada the frontend refuses D > 128 when the plan is
// built, and sdpa_available reports its words.
std::string shape_problem(const AttentionShape& s) {
  if (s.B <= 0 || s.T <= 0 || s.H <= 0 || s.D <= 0) return "empty shape";
  if (s.D % 8 != 0 || s.D > 256) return "head dim D must be a multiple of 8 and at most 256";
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

// The cached plan of one direction and shape, built on first use; its `error` says why not.
// The backward's key names its algorithm (train.deterministic): the two are different graphs.
Plan& plan_locked(State& st, const AttentionShape& s, bool backward, SdpaBackward algo) {
  const std::string shape = shape_string(s);
  const bool det = algo == SdpaBackward::kDeterministic;
  Plan& plan = st.plans[keel::detail::concat(
      backward ? (det ? "bwd deterministic " : "bwd fast ") : "fwd ", shape)];
  if (plan.graph != nullptr || !plan.error.empty()) return plan;
  plan.error = shape_problem(s);
  if (!plan.error.empty()) return plan;
  const std::string where =
      keel::detail::concat(backward ? "sdpa_backward " : "sdpa_forward ", shape);
  try {
    auto g = backward ? backward_graph(s, algo) : forward_graph(s);
    fe_check(g->validate(), "validate", where);
    fe_check(g->build_operation_graph(st.handle), "build_operation_graph", where);
    fe_check(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", where);
    fe_check(g->check_support(st.handle), "check_support", where);
    fe_check(g->build_plans(st.handle), "build_plans", where);
    int64_t ws = 0;
    fe_check(g->get_workspace_size(ws), "get_workspace_size", where);
    if (ws > st.workspace_limit) {
      plan.error = keel::detail::concat(
          "the ", backward ? (det ? "deterministic backward" : "backward") : "forward", " needs ",
          ws >> 20, " MiB of workspace, above the ", st.workspace_limit >> 20,
          " MiB limit (an eighth of the device's memory, or KEEL_CUDNN_WORKSPACE_LIMIT_MB) [",
          where, "]");
      return plan;
    }
    plan.graph = std::move(g);
    plan.workspace_bytes = ws;
  } catch (const std::exception& e) {  // keel::Error from fe_check, or a frontend exception
    plan.error = e.what();
  }
  return plan;
}

// The handle (bound to ctx's stream) and the built plan, or a keel::Error naming the shape.
std::pair<cudnnHandle_t, const Plan*> ready(Context& ctx, const AttentionShape& s, bool backward) {
  std::lock_guard<std::mutex> lock(states_mu);
  State& st = state_locked(ctx);
  const Plan& plan = plan_locked(st, s, backward, ctx.sdpa_backward());
  KEEL_CHECK(plan.graph != nullptr, kInternal, "cudnn ",
             backward ? "sdpa_backward" : "sdpa_forward", " unavailable [", shape_string(s),
             "]: ", plan.error);
  return {st.handle, &plan};  // bound to ctx's stream by state_locked
}

void check_aligned(const void* p, const char* name, const AttentionShape& s) {
  KEEL_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, kInternal, "cudnn sdpa: ", name,
             " is not 16-byte aligned [", shape_string(s), "]");
}

void execute(Context& ctx, cudnnHandle_t handle, const Plan& plan,
             std::unordered_map<int64_t, void*>& pack, const char* what, const AttentionShape& s) {
  DeviceBuffer workspace = ctx.alloc(static_cast<size_t>(plan.workspace_bytes));
  fe_check(plan.graph->execute(handle, pack, workspace.data()), "execute",
           keel::detail::concat(what, " ", shape_string(s)));
  // workspace goes back to the allocator's cache here; the kernels using it are already enqueued
  // on ctx's stream (Note [cuda-stream-order]).
}

}  // namespace

bool sdpa_available(Context& ctx, const AttentionShape& s, std::string* why) {
  std::lock_guard<std::mutex> lock(states_mu);
  State& st = state_locked(ctx);
  for (bool backward : {false, true}) {
    const Plan& plan = plan_locked(st, s, backward, ctx.sdpa_backward());
    if (plan.graph == nullptr) {
      if (why != nullptr) *why = plan.error;
      return false;
    }
  }
  if (why != nullptr) why->clear();
  return true;
}

void sdpa_forward(Context& ctx, const AttentionShape& s, Bf16* out, float* lse, const Bf16* q,
                  const Bf16* k, const Bf16* v, const float* scale) {
  auto [handle, plan] = ready(ctx, s, false);
  for (auto [p, name] : {std::pair<const void*, const char*>{out, "out"},
                         {lse, "lse"},
                         {q, "q"},
                         {k, "k"},
                         {v, "v"}}) {
    check_aligned(p, name, s);
  }
  DeviceBuffer qs = ctx.alloc(static_cast<size_t>(s.B * s.T * s.H * s.D) * sizeof(Bf16));
  fold_head_scale(ctx, s, qs.as<Bf16>(), q, scale);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, qs.data()}, {kK, const_cast<Bf16*>(k)}, {kV, const_cast<Bf16*>(v)}, {kO, out},
      {kStats, lse},
  };
  execute(ctx, handle, *plan, pack, "sdpa_forward", s);
}

void sdpa_backward(Context& ctx, const AttentionShape& s, Bf16* dq, Bf16* dk, Bf16* dv,
                   float* dscale, const Bf16* dout, const Bf16* out, const float* lse,
                   const Bf16* q, const Bf16* k, const Bf16* v, const float* scale) {
  auto [handle, plan] = ready(ctx, s, true);
  for (auto [p, name] : {std::pair<const void*, const char*>{dq, "dq"},
                         {dk, "dk"},
                         {dv, "dv"},
                         {dout, "dout"},
                         {out, "out"},
                         {lse, "lse"},
                         {q, "q"},
                         {k, "k"},
                         {v, "v"}}) {
    check_aligned(p, name, s);
  }
  DeviceBuffer qs = ctx.alloc(static_cast<size_t>(s.B * s.T * s.H * s.D) * sizeof(Bf16));
  fold_head_scale(ctx, s, qs.as<Bf16>(), q, scale);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, qs.data()},
      {kK, const_cast<Bf16*>(k)},
      {kV, const_cast<Bf16*>(v)},
      {kO, const_cast<Bf16*>(out)},
      {kDO, const_cast<Bf16*>(dout)},
      {kStats, const_cast<float*>(lse)},
      {kDQ, dq},
      {kDK, dk},
      {kDV, dv},
  };
  execute(ctx, handle, *plan, pack, "sdpa_backward", s);
  unfold_head_scale_grad(ctx, s, dq, dscale, q, scale);
}

bool have_frontend() { return true; }

std::string library_version() {
  const size_t v = cudnnGetVersion();  // 91900 for 9.19.0
  return keel::detail::concat("cuDNN ", v / 10000, ".", v % 10000 / 100, ".", v % 100,
                              " (frontend ", CUDNN_FRONTEND_MAJOR_VERSION, ".",
                              CUDNN_FRONTEND_MINOR_VERSION, ".", CUDNN_FRONTEND_PATCH_VERSION, ")");
}

#endif  // KEEL_HAVE_CUDNN_FRONTEND

}  // namespace keel::kernels::cuda::cudnn
