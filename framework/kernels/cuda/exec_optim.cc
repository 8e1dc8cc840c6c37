// CudaExec's multi-tensor optimizer methods (exec_context.h): the global gradient norm and AdamW
// over the optimizer's segment table, each in a launch per many segments where the per-tensor
// methods of exec_context.cc take one or two per parameter. Kept apart from exec_context.cc, which
// holds the per-tensor methods. Compiled only when KEEL_HAVE_CUDA.
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/cuda/ops.h"

namespace keel::kernels::cuda {

void CudaExec::sum_squares_segments(const float* x, const NormSegment* segments, int64_t count,
                                    double* out) {
  cuda::sum_squares_segments(ctx_, x, segments, count, out);
}

void CudaExec::adamw_update_segments(float* param, const float* grad, float* m, float* v,
                                     const AdamWSegment* segments, int64_t count,
                                     const AdamWStep& step) {
  cuda::adamw_update_segments(ctx_, param, grad, m, v, segments, count, step);
}

}  // namespace keel::kernels::cuda
