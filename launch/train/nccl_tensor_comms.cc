// NCCL tensor communicators for the Trainer (nccl_tensor_comms.h): groups of one. No MPI here, so
// binaries that use only these (the GPU check's, on a machine without MPI) link none; the
// MPI-bootstrapped ones are in nccl_tensor_comms_mpi.cc.
#include "launch/train/nccl_tensor_comms.h"

#if KEEL_HAVE_NCCL
#include "framework/error.h"
#include "framework/kernels/cuda/exec_context.h"
#include "parallel/nccl_communicator.h"

namespace keel {

kernels::cuda::Context& nccl_cuda_context(kernels::ExecContext& exec) {
  auto* cuda = dynamic_cast<kernels::cuda::CudaExec*>(&exec);
  KEEL_CHECK(cuda != nullptr, kInternal, "NCCL tensor communicators need the CUDA context, not ",
             exec.describe());
  return cuda->context();
}

TensorComms one_rank_nccl_comms(kernels::ExecContext& exec) {
  kernels::cuda::Context& ctx = nccl_cuda_context(exec);
  TensorComms comms;
  comms.tp = std::make_unique<NcclCommunicator>(NcclCommunicator::make_unique_id(), 0, 1,
                                                "tensor-parallel", ctx, nullptr);
  comms.dp = std::make_unique<NcclCommunicator>(NcclCommunicator::make_unique_id(), 0, 1,
                                                "data-parallel", ctx, nullptr);
  return comms;
}

}  // namespace keel
#endif
