// Node-local rank -> GPU index (see device_map.h).
#include "parallel/device_map.h"

#include <cstdlib>
#include <string>

#include "framework/error.h"
#include "parallel/mpi_env.h"

namespace keel {

namespace {
// Entries of a CUDA_VISIBLE_DEVICES list ("0,1", "GPU-8f2c...,GPU-11ab...", "" for none).
int count_listed(const std::string& list) {
  if (list.empty()) return 0;
  int n = 1;
  for (char c : list) n += c == ',' ? 1 : 0;
  return n;
}
}  // namespace

int device_for_rank(int local_rank, int local_size, int device_count, const std::string& node,
                    const char* cuda_visible_devices) {
  KEEL_ASSERT(local_rank >= 0 && local_rank < local_size);
  // Every rank of the node decides alike (local_size, not local_rank, against the GPUs), so a node
  // with too many ranks fails on all of them at once.
  if (local_size <= device_count) return local_rank;
  // Per-task binding (device_map.h): the scheduler gave this rank one GPU of its own.
  const bool bound_one_each = device_count == 1 && cuda_visible_devices != nullptr &&
                              count_listed(cuda_visible_devices) == 1;
  if (bound_one_each) return 0;
  const std::string visible = cuda_visible_devices == nullptr
                                  ? std::string("all of the node's GPUs visible")
                                  : "CUDA_VISIBLE_DEVICES=" + clip_echo(cuda_visible_devices);
  KEEL_CHECK(device_count > 0, kLayout, "node ", node, " runs ", local_size,
             local_size == 1 ? " rank" : " ranks", " but each rank sees 0 GPUs (", visible,
             "; no GPU or no driver): a CUDA job needs one GPU per rank");
  KEEL_FAIL(kLayout, "node ", node, " runs ", local_size, local_size == 1 ? " rank" : " ranks",
            " but each rank sees ", device_count, device_count == 1 ? " GPU" : " GPUs", " (",
            visible, "): keel runs one rank per GPU, so start at most ", device_count,
            " ranks per node (mpirun --map-by ppr:", device_count,
            ":node, srun --ntasks-per-node=", device_count, ")");
}

int device_for_rank(const MpiEnv& mpi, int device_count) {
  return device_for_rank(mpi.local_rank(), mpi.local_size(), device_count, mpi.node_name(),
                         std::getenv("CUDA_VISIBLE_DEVICES"));
}

}  // namespace keel
