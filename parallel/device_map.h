// Which GPU a rank uses. keel runs one rank per GPU: the node-local rank (MpiEnv's node-local
// split, Note [fake nodes] in parallel/mpi_env.h) picks the device, so ranks 0..7 of an 8-GPU node
// take devices 0..7 whatever their world ranks are.
//
// Device indices are into the devices this process can see. When a scheduler (or the user) sets
// CUDA_VISIBLE_DEVICES, the CUDA runtime renumbers the listed devices 0, 1, ...: with
// CUDA_VISIBLE_DEVICES=4,5,6,7 and four ranks on the node, node-local rank 0 gets index 0, which is
// physical GPU 4. Nothing here reads physical GPU numbers.
//
// Per-task binding: a scheduler that gives every task its own single GPU (srun --gpus-per-task=1
// or --gpu-bind=single:1) leaves each rank one visible device, CUDA_VISIBLE_DEVICES naming one
// GPU; every rank then uses its index 0. (Two ranks that were handed the same GPU are refused by
// NCCL's communicator set-up, "Duplicate GPU detected".)
//
// More ranks on a node than GPUs visible to each is a layout error (exit 2) naming the node, its
// rank count and the GPU count, raised by every rank of that node (not only the surplus ones).
#pragma once

#include <string>

namespace keel {

class MpiEnv;

// Pure: the device index for node-local rank `local_rank` of `local_size` ranks on node `node`
// (a name, for the message) when each rank sees `device_count` devices and CUDA_VISIBLE_DEVICES
// is `cuda_visible_devices` (nullptr: unset). Throws kLayout when the node has more ranks than
// GPUs (and the ranks are not bound one GPU each, above).
int device_for_rank(int local_rank, int local_size, int device_count, const std::string& node,
                    const char* cuda_visible_devices);

// The device of this process: device_for_rank() with MpiEnv's node-local split and node name and
// this process's CUDA_VISIBLE_DEVICES. `device_count` is what the CUDA runtime reports
// (kernels::cuda::device_count(); select_device() in parallel/nccl_mpi.h asks it), passed in so
// this stays free of CUDA.
int device_for_rank(const MpiEnv& mpi, int device_count);

}  // namespace keel
