// ParamStore: every parameter of the model as a logical global tensor with this rank's slice
// stored in flat arenas (parameters, gradients, AdamW m and v share one layout, so the gradient
// arena doubles as the DP bucket space and the optimizer is one loop over the arena).
// Note [layout-independent init]: see framework/philox.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "framework/tensor.h"

namespace keel {

enum class ParamInit { kNormal, kConstant };

struct ParamSpec {
  std::string name;
  Shape logical;       // shape of the whole tensor, whatever the layout
  int shard_dim = -1;  // dimension split over TP ranks; -1: replicated
  ParamInit init = ParamInit::kNormal;
  float value = 0.0f;  // std for kNormal, the constant for kConstant
  bool decay = false;  // AdamW weight decay applies
  // Replicated across TP ranks but each rank's gradient covers only its heads (a gain shared by
  // all heads): the gradient is all-reduced over TP once per step.
  bool tp_partial_grad = false;
  // > 0: dim 0 is padded past this many rows for the TP layout (Note [vocab padding]); rows from
  // here on never affect the loss, so a checkpoint with another padding loads (rows it lacks are
  // zero, rows beyond this model's are dropped).
  int64_t valid_rows = 0;
};

struct ParamInfo {
  ParamSpec spec;
  Shape local;              // this rank's slice
  int64_t shard_begin = 0;  // first index along shard_dim held here
  int64_t offset = 0;       // element offset in the arenas
  int64_t numel() const { return shape_numel(local); }
  bool sharded() const { return local != spec.logical; }
};

class ParamStore {
 public:
  // Registers a parameter; returns its id. Only before allocate().
  int add(ParamSpec spec);
  // Lays out the arenas for this TP rank (64-byte aligned per tensor) on `device` and zeros them;
  // the total is padded to a multiple of 16 x pad_multiple elements (pad_multiple = dp, for
  // ZeRO-1).
  void allocate(int tp_rank, int tp_size, int pad_multiple = 1, Device device = Device::kCpu);
  // Draws every parameter from Philox(seed, name, logical index) on the host and copies it to
  // the arenas' device.
  void init(uint64_t seed);

  // Pointers into the arenas: memory of their device (dereference on the host only on the CPU;
  // otherwise hand them to kernels, or copy with params().copy_to_host).
  float* param(int id) { return params_.f32() + infos_[id].offset; }
  float* grad(int id) { return grads_.f32() + infos_[id].offset; }
  // nullptr for a parameter a model option leaves out (its id is -1, e.g. a bias with
  // model.bias=false), so kernels that take an optional bias can be handed the id's storage as is.
  float* param_or_null(int id) { return id >= 0 ? param(id) : nullptr; }
  float* grad_or_null(int id) { return id >= 0 ? grad(id) : nullptr; }
  const ParamInfo& info(int id) const { return infos_[id]; }
  int find(const std::string& name) const;  // -1 when absent
  int size() const { return static_cast<int>(infos_.size()); }
  int64_t total_elems() const { return total_; }

  Tensor& params() { return params_; }
  Tensor& grads() { return grads_; }
  void zero_grads() { grads_.zero_(); }

  // Logical flat index of local element j of parameter id.
  int64_t logical_index(int id, int64_t j) const;

 private:
  std::vector<ParamInfo> infos_;
  Tensor params_, grads_;
  int64_t total_ = 0;
  bool allocated_ = false;
};

}  // namespace keel

namespace keel {
class Communicator;
// The logical tensor of parameter `id` assembled from every TP rank's slice `local` (gradients or
// values) with an all-gather over `tp`; replicated tensors are returned as they are. Used by
// tests (shard = slice) and, later, checkpoint export.
std::vector<float> gather_logical(const ParamStore& ps, int id, const float* local,
                                  Communicator& tp);
}  // namespace keel
