// Internal to checkpoints/: the geometry of a slice shared by the writer (checkpoint.cc) and the
// readers (checkpoint_load.cc): which TP block of a logical tensor a rank holds, and a logical
// shape seen around one dimension.
#pragma once

#include <cstdint>

#include "checkpoints/manifest.pb.h"
#include "framework/tensor.h"
#include "layers/params.h"

namespace keel::ckpt_detail {

inline constexpr ckpt::TensorKind kKinds[] = {ckpt::PARAM, ckpt::ADAM_M, ckpt::ADAM_V};

// The block of the logical tensor a rank's slice of parameter `info` is: dim D (the spec's shard
// dimension, or 0 for a replicated one) and [begin, begin + len) along it.
struct Block {
  int dim = -1;  // -1: the whole tensor
  int64_t begin = 0, len = 0;
};

inline Block block_of(const ParamInfo& info) {
  if (!info.sharded()) return {};
  const int d = info.spec.shard_dim;
  return {d, info.shard_begin, info.local.at(d)};
}

// Geometry of a logical shape around dim d: outer x extent x inner (d = -1: 1 x numel x 1).
struct Geometry {
  int64_t outer = 1, extent = 1, inner = 1;
};

inline Geometry geometry(const Shape& shape, int d) {
  Geometry g;
  if (d < 0) {
    g.extent = shape_numel(shape);
    return g;
  }
  for (int i = 0; i < d; ++i) g.outer *= shape[i];
  g.extent = shape[d];
  for (size_t i = d + 1; i < shape.size(); ++i) g.inner *= shape[i];
  return g;
}

}  // namespace keel::ckpt_detail
