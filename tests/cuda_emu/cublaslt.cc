// The CUDA emulator's cuBLASLt (see README.md here): the handle, descriptors, heuristic and matmul
// that framework/kernels/cuda/gemm.cc calls, with cuBLASLt's column-major semantics, so the
// backend's own row-major mapping, transposes, leading dimensions, bias epilogue and dtypes are
// what the emulated GEMM tests check. The product accumulates in fp32 (fused multiply-adds in
// increasing k), as the tensor cores do in another order, so the tests' bounds meet rounding of
// the GPU's size; TF32 compute rounds the inputs to TF32 first (to nearest; the tensor cores'
// conversion is not documented and may truncate: the tests' TF32 bounds allow for either).
// Arguments cuBLASLt rejects (a leading dimension shorter than a column, operand shapes that do
// not chain, mixed input types, an unknown attribute) are rejected here too, with a message on
// stderr. An algorithm from the heuristic carries the heuristic's assumptions (AlgoInfo): a matmul
// whose operands or bias are less aligned than it was chosen for, or that passes less workspace
// than it asked for, is rejected, where a GPU would fault or compute garbage.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "framework/kernels/cuda/bf16.h"
#include "tests/cuda_emu/counters.h"
#include "tests/cuda_emu/emu.h"
#include "tests/cuda_emu/host_guard.h"
#include "tests/cuda_emu/roofline.h"

namespace {

struct Desc {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
};
// Unset alignments are cuBLASLt's default assumption, 256 bytes.
struct Pref {
  size_t max_workspace = 0;
  uint32_t min_align[4] = {256, 256, 256, 256};  // A, B, C, D
  uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;
};

// What an emulated algorithm was chosen for, kept in cublasLtMatmulAlgo_t's opaque words: a real
// algorithm assumes its operands (and the bias, by the BIAS_POINTER the heuristic saw: "routines
// that don't dereference this pointer, like cublasLtMatmulAlgoGetHeuristic(), depend on its value
// to determine expected pointer alignment", cublasLt.h) are at least that aligned.
struct AlgoInfo {
  uint32_t align[5];  // A, B, C, D, bias (0: no bias epilogue)
  uint32_t reduction_mask;
  uint64_t workspace;
};
static_assert(sizeof(AlgoInfo) <= sizeof(cublasLtMatmulAlgo_t), "fits the opaque algorithm");

// The largest power of two (<= 256) dividing the address; a null pointer counts as 256.
uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

// The workspace an emulated algorithm asks for (within the preference's limit), so that callers'
// workspace plumbing is exercised as a real split-K algorithm's would be.
constexpr size_t kEmulatedWorkspace = size_t{1} << 20;

Desc* desc(cublasLtMatmulDesc_t d) { return reinterpret_cast<Desc*>(d); }
Layout* layout(cublasLtMatrixLayout_t l) { return reinterpret_cast<Layout*>(l); }

cublasStatus_t reject(cublasStatus_t status, const std::string& why) {
  std::fprintf(stderr, "keel cuda emulator: cuBLASLt: %s\n", why.c_str());
  return status;
}

float load(const void* p, cudaDataType_t t, int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  return keel::from_bf16(static_cast<const keel::Bf16*>(p)[i]);
}

// TF32: 10 explicit mantissa bits, rounded to nearest (ties away).
float to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, sizeof(u));
  return x;
}

// Element (r, c) of op(X) for a column-major X.
float at(const void* p, const Layout& l, bool trans, int64_t r, int64_t c) {
  return trans ? load(p, l.type, c + r * l.ld) : load(p, l.type, r + c * l.ld);
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = reinterpret_cast<cublasLtHandle_t>(new char[1]);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete[] reinterpret_cast<char*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion(void) { return CUBLAS_VERSION; }
const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_(emulated)";
  }
}
const char* cublasLtGetStatusString(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? "success" : "emulated cuBLASLt error";
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32) {
    return reject(CUBLAS_STATUS_NOT_SUPPORTED, "compute type other than 32F / 32F_FAST_TF32");
  }
  if (scale != CUDA_R_32F) return reject(CUBLAS_STATUS_NOT_SUPPORTED, "scale type other than 32F");
  auto* x = new Desc;
  x->compute = compute;
  x->scale = scale;
  *d = reinterpret_cast<cublasLtMatmulDesc_t>(x);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete desc(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t size) {
  Desc& x = *desc(d);
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
      if (size != sizeof(int32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "TRANS size");
      int32_t op;
      std::memcpy(&op, buf, sizeof(op));
      if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) {
        return reject(CUBLAS_STATUS_NOT_SUPPORTED, "TRANS other than N or T");
      }
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? x.trans_a : x.trans_b) =
          static_cast<cublasOperation_t>(op);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE: {
      if (size != sizeof(uint32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "EPILOGUE size");
      uint32_t e;
      std::memcpy(&e, buf, sizeof(e));
      if (e != CUBLASLT_EPILOGUE_DEFAULT && e != CUBLASLT_EPILOGUE_BIAS) {
        return reject(CUBLAS_STATUS_NOT_SUPPORTED, "epilogue other than DEFAULT or BIAS");
      }
      x.epilogue = static_cast<cublasLtEpilogue_t>(e);
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      if (size != sizeof(void*)) return reject(CUBLAS_STATUS_INVALID_VALUE, "BIAS_POINTER size");
      std::memcpy(&x.bias, buf, sizeof(void*));
      return CUBLAS_STATUS_SUCCESS;
    default:
      return reject(CUBLAS_STATUS_NOT_SUPPORTED,
                    "matmul descriptor attribute " + std::to_string(attr) + " not emulated");
  }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (type != CUDA_R_32F && type != CUDA_R_16BF) {
    return reject(CUBLAS_STATUS_NOT_SUPPORTED, "matrix type other than 32F or 16BF");
  }
  if (ld < static_cast<int64_t>(rows) || ld <= 0) {
    return reject(CUBLAS_STATUS_INVALID_VALUE, "layout ld=" + std::to_string(ld) +
                                                   " < rows=" + std::to_string(rows) +
                                                   " (column-major: ld must cover a column)");
  }
  *l = reinterpret_cast<cublasLtMatrixLayout_t>(new Layout{type, rows, cols, ld});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete layout(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = reinterpret_cast<cublasLtMatmulPreference_t>(new Pref);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete reinterpret_cast<Pref*>(p);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "workspace size");
      std::memcpy(&reinterpret_cast<Pref*>(p)->max_workspace, buf, sizeof(uint64_t));
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
      if (size != sizeof(uint32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "alignment size");
      const int i = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
                    : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
                    : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                                                                         : 3;
      std::memcpy(&reinterpret_cast<Pref*>(p)->min_align[i], buf, sizeof(uint32_t));
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      if (size != sizeof(uint32_t)) return reject(CUBLAS_STATUS_INVALID_VALUE, "mask size");
      std::memcpy(&reinterpret_cast<Pref*>(p)->reduction_mask, buf, sizeof(uint32_t));
      return CUBLAS_STATUS_SUCCESS;
    default:
      return reject(CUBLAS_STATUS_NOT_SUPPORTED,
                    "preference attribute " + std::to_string(attr) + " not emulated");
  }
}

}  // extern "C"

namespace {

// The checks cuBLASLt makes of one matmul: op(A) is m x k, op(B) k x n, C and D m x n.
cublasStatus_t check_shapes(const Desc& d, const Layout& a, const Layout& b, const Layout& c,
                            const Layout& dd) {
  const bool ta = d.trans_a == CUBLAS_OP_T, tb = d.trans_b == CUBLAS_OP_T;
  const uint64_t m = ta ? a.cols : a.rows, k = ta ? a.rows : a.cols;
  const uint64_t kb = tb ? b.cols : b.rows, n = tb ? b.rows : b.cols;
  if (k != kb || c.rows != m || c.cols != n || dd.rows != m || dd.cols != n) {
    return reject(CUBLAS_STATUS_INVALID_VALUE,
                  "operand shapes do not chain: op(A) " + std::to_string(m) + "x" +
                      std::to_string(k) + ", op(B) " + std::to_string(kb) + "x" +
                      std::to_string(n) + ", C " + std::to_string(c.rows) + "x" +
                      std::to_string(c.cols));
  }
  if (a.type != b.type) return reject(CUBLAS_STATUS_NOT_SUPPORTED, "A and B of different types");
  if (a.type == CUDA_R_32F && c.type != CUDA_R_32F) {
    return reject(CUBLAS_STATUS_NOT_SUPPORTED, "fp32 inputs with a bf16 output");
  }
  if (c.type != dd.type || c.ld != dd.ld) {
    return reject(CUBLAS_STATUS_NOT_SUPPORTED, "C and D layouts differ");
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t /*handle*/, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* found) {
  *found = 0;
  if (requested < 1) return reject(CUBLAS_STATUS_INVALID_VALUE, "requested < 1");
  const cublasStatus_t s = check_shapes(*desc(d), *layout(a), *layout(b), *layout(c), *layout(dd));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const Desc& x = *desc(d);
  // KEEL_CUDA_EMU_CUBLASLT_NO_BIAS=1: no algorithm has the bias epilogue, as for some shapes on
  // a GPU, so the caller's fallback runs (tests/gpu/gemm_test.cc).
  const char* no_bias = std::getenv("KEEL_CUDA_EMU_CUBLASLT_NO_BIAS");
  if (x.epilogue == CUBLASLT_EPILOGUE_BIAS && no_bias != nullptr &&
      std::strcmp(no_bias, "1") == 0) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const Pref& pref = p != nullptr ? *reinterpret_cast<const Pref*>(p) : Pref{};
  AlgoInfo info{};
  for (int i = 0; i < 4; ++i) info.align[i] = pref.min_align[i];
  info.align[4] = x.epilogue == CUBLASLT_EPILOGUE_BIAS ? alignment_of(x.bias) : 0;
  info.reduction_mask = pref.reduction_mask;
  info.workspace = std::min(pref.max_workspace, kEmulatedWorkspace);
  results[0] = cublasLtMatmulHeuristicResult_t{};
  std::memcpy(&results[0].algo, &info, sizeof(info));
  results[0].workspaceSize = info.workspace;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t /*handle*/, cublasLtMatmulDesc_t dsc,
                              const void* alpha, const void* A, cublasLtMatrixLayout_t al,
                              const void* B, cublasLtMatrixLayout_t bl, const void* beta,
                              const void* C, cublasLtMatrixLayout_t cl, void* D,
                              cublasLtMatrixLayout_t dl, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Desc& d = *desc(dsc);
  const Layout &a = *layout(al), &b = *layout(bl), &c = *layout(cl), &dd = *layout(dl);
  const cublasStatus_t s = check_shapes(d, a, b, c, dd);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (d.epilogue == CUBLASLT_EPILOGUE_BIAS && d.bias == nullptr) {
    return reject(CUBLAS_STATUS_INVALID_VALUE, "BIAS epilogue without a bias pointer");
  }
  // The algorithm's assumptions (AlgoInfo): operands at least as aligned as it was chosen for, the
  // epilogue it was chosen with, and the workspace it asked for.
  if (algo != nullptr) {
    AlgoInfo info;
    std::memcpy(&info, algo, sizeof(info));
    const void* ptrs[5] = {A, B, C, D, d.bias};
    const char* names[5] = {"A", "B", "C", "D", "the bias"};
    if ((info.align[4] != 0) != (d.epilogue == CUBLASLT_EPILOGUE_BIAS)) {
      return reject(CUBLAS_STATUS_INVALID_VALUE,
                    "the algorithm was chosen for another epilogue than the descriptor's");
    }
    for (int i = 0; i < 5; ++i) {
      if (i == 4 && info.align[4] == 0) continue;
      if (alignment_of(ptrs[i]) < info.align[i]) {
        return reject(CUBLAS_STATUS_INVALID_VALUE,
                      std::string(names[i]) + " is " + std::to_string(alignment_of(ptrs[i])) +
                          "-byte aligned, below the " + std::to_string(info.align[i]) +
                          " bytes the algorithm was chosen for (a GPU faults: misaligned address)");
      }
    }
    if (info.workspace > 0 && (workspace == nullptr || workspace_bytes < info.workspace)) {
      return reject(CUBLAS_STATUS_INVALID_VALUE,
                    "workspace of " + std::to_string(workspace_bytes) + " bytes, below the " +
                        std::to_string(info.workspace) + " the algorithm needs");
    }
  }
  const bool ta = d.trans_a == CUBLAS_OP_T, tb = d.trans_b == CUBLAS_OP_T;
  const bool tf32 = d.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  const int64_t m = static_cast<int64_t>(dd.rows), n = static_cast<int64_t>(dd.cols);
  const int64_t k = static_cast<int64_t>(ta ? a.rows : a.cols);
  // Host scalars are read at the call, as cuBLASLt's are; the product is a task of the stream
  // (Note [cuda-emu-deferred]), with copies of the descriptor and layouts.
  const float al_ = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  keel_emu::counters::record_launch("cublasLtMatmul", 0, 0, m * n * k);
  // The roofline (roofline.h): 2 m n k flops, on the tensor cores for bf16 inputs and TF32
  // compute, on the CUDA cores for plain fp32; named by the inputs' type.
  namespace roofline = keel_emu::roofline;
  const bool bf16_in = a.type == CUDA_R_16BF;
  const char* what = bf16_in ? "cublasLtMatmul bf16"
                     : tf32  ? "cublasLtMatmul tf32"
                             : "cublasLtMatmul fp32";
  const roofline::Peak peak = bf16_in ? roofline::Peak::kTensorBf16
                              : tf32  ? roofline::Peak::kTensorTf32
                                      : roofline::Peak::kCudaCores;
  auto rec = roofline::start(what, 2.0 * static_cast<double>(m) * n * k, peak);
  keel_emu::submit(stream, [=] {
    roofline::run_measured(rec.get(), [&] {
#pragma omp parallel
      {
        // Each OpenMP thread does device work (host_guard.h).
        const keel_emu::host_guard::DeviceScope device;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t i = 0; i < m; ++i) {
            float acc = 0.0f;
            for (int64_t p = 0; p < k; ++p) {
              float x = at(A, a, ta, i, p), y = at(B, b, tb, p, j);
              if (tf32) {
                x = to_tf32(x);
                y = to_tf32(y);
              }
              acc = std::fma(x, y, acc);
            }
            float r = al_ * acc;
            // beta == 0 must not read C (it may hold NaN), as in BLAS.
            if (be != 0.0f) r += be * load(C, c.type, i + j * c.ld);
            if (d.epilogue == CUBLASLT_EPILOGUE_BIAS) r += load(d.bias, dd.type, i);
            const int64_t o = i + j * dd.ld;
            if (dd.type == CUDA_R_32F) {
              static_cast<float*>(D)[o] = r;
            } else {
              static_cast<keel::Bf16*>(D)[o] = keel::to_bf16(r);
            }
          }
        }
      }
    });
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
