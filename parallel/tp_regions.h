// The tensor-parallel region boundaries (Note [tp regions]): Megatron's conjugate pairs
// (tensor_parallel/mappings.py) as explicit forward and backward calls, for keel's hand-written
// backward passes. A layer writes its body once; TpRegion picks the copy/reduce pair or, under
// sequence parallelism, the all-gather/reduce-scatter pair.
#pragma once

#include <cstdint>

#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "framework/profiler.h"
#include "parallel/communicator.h"

namespace keel {

// Note [tp regions]
// ~~~~~~~~~~~~~~~~~
// A tensor-parallel sublayer (attention, the MLP; the vocab-parallel embedding is an exit alone,
// the LM head an entry alone) is entered by its column-parallel input projection and left by its
// row-parallel output projection. Between the sublayers the residual stream is replicated over
// the TP group, or split into token rows under sequence parallelism (Note [sequence parallel] in
// layers/gpt.h); inside, every rank holds all B T rows and a part of the hidden dimension:
//
//             without SP                                    with SP
//   enter     copy_to_tp                                    gather_from_sp
//     fwd     identity                                      all-gather the rows
//     bwd     all-reduce the partial input gradient         reduce-scatter it to this rank's rows
//   exit      reduce_from_tp                                reduce_scatter_to_sp
//     fwd     all-reduce the partial output                 reduce-scatter it to this rank's rows
//     bwd     identity                                      all-gather the output gradient's rows
//
// Conjugate: an entry's backward is its exit's forward (every rank's partial summed into this
// rank's rows), an exit's backward its entry's forward (this rank's rows on every row). So the
// block (layers/gpt.cc) is one pre-norm and one post-norm body, the sublayers call enter() and
// exit() where their projections are (layers/attention.cc, layers/mlp.cc), and the pair is chosen
// here, once. Every TP collective of activations and their gradients goes through TpRegion; the
// others are the QK-norm statistics of PROJECTION scope (layers/attention.cc), a sequence-parallel
// norm's weight gradients (layers/norm.cc) and the vocab-parallel loss's row statistics
// (layers/vocab_parallel_loss.cc), so the communication formula in docs/distributed.md is read off
// these call sites. The sums move bf16 for bf16 memory, and for fp32 memory on the bf16 wire (Note
// [bf16 wire] in parallel/communicator.h); the gathers and scatters move fp32.
//
// `n` is always the element count of this rank's rows (rows(B) x C: all B T rows without SP);
// an `all` buffer holds every rank's rows, tp x n elements, rank r's at [r n, (r + 1) n).
class TpRegion {
 public:
  // tp: the TP group's tensor communicator. bf16_wire: fp32 sums move bf16. exec widens a bf16
  // partial input gradient; prof (may be null) times each collective ("tp.all_reduce",
  // "tp.all_gather", "tp.reduce_scatter").
  TpRegion(Communicator& tp, bool sequence_parallel, bool bf16_wire, kernels::ExecContext& exec,
           Profiler* prof)
      : tp_(tp), sp_(sequence_parallel), bf16_wire_(bf16_wire), exec_(exec), prof_(prof) {}

  bool sequence_parallel() const { return sp_; }

  // Where a sublayer writes a partial result for exit() (its output) or enter_backward() (its
  // input gradient) to sum into `dest`: dest itself without SP (summed in place), `all` under SP
  // (fp32, every row, reduce-scattered into dest).
  kernels::ActOut partial(kernels::ActOut dest, float* all) const {
    return sp_ ? kernels::ActOut(all) : dest;
  }
  float* partial(float* dest, float* all) const { return sp_ ? all : dest; }

  // Entering, forward (copy_to_tp | gather_from_sp): the sublayer's input on every row from this
  // rank's `rows`: rows itself, or (SP, fp32) gathered into `all`.
  kernels::ActIn enter(kernels::ActIn rows, kernels::ActOut all, int64_t n) const {
    if (!sp_) return rows;
    float* out = kernels::act_f32(all, "TpRegion::enter", "all");
    gather(kernels::act_f32(rows, "TpRegion::enter", "rows"), out, n);
    return out;
  }
  // Entering, backward (= exit's forward): every rank's partial input gradient `partial` (from
  // partial(dx or a bf16 stand-in, all)) summed into this rank's rows `dx` (=). Without SP the sum
  // is in place, and a bf16 stand-in is then widened into dx.
  void enter_backward(kernels::ActOut partial, float* dx, int64_t n) const {
    if (sp_) {
      scatter(kernels::act_f32(partial, "TpRegion::enter_backward", "partial"), dx, n);
      return;
    }
    sum(partial, n);
    if (partial.data != dx) exec_.copy_to_f32(dx, partial, n);
  }

  // Leaving, forward (reduce_from_tp | reduce_scatter_to_sp): every rank's partial output
  // `partial` (from partial(y, all)) summed into this rank's rows `y` (=): in place without SP.
  void exit(kernels::ActOut partial, kernels::ActOut y, int64_t n) const {
    if (sp_) {
      scatter(kernels::act_f32(partial, "TpRegion::exit", "partial"),
              kernels::act_f32(y, "TpRegion::exit", "y"), n);
      return;
    }
    KEEL_ASSERT(partial.data == y.data);
    sum(y, n);
  }
  // Leaving, backward (= enter's forward): the output gradient on every row from this rank's rows
  // `dy`: dy itself, or (SP) gathered into `all`.
  const float* exit_backward(const float* dy, float* all, int64_t n) const {
    if (!sp_) return dy;
    gather(dy, all, n);
    return all;
  }

 private:
  // In place over the TP group, bf16 on the wire for bf16 memory or with bf16_wire_.
  void sum(kernels::ActOut x, int64_t n) const {
    ProfileScope p(prof_, "tp.all_reduce");
    if (x.dtype == DType::kBF16) {
      tp_.all_reduce_bf16(static_cast<Bf16*>(x.data), n);
    } else if (bf16_wire_) {
      tp_.all_reduce_bf16(static_cast<float*>(x.data), n);
    } else {
      tp_.all_reduce(static_cast<float*>(x.data), n, ReduceOp::kSum);
    }
  }
  void gather(const float* mine, float* all, int64_t n) const {
    ProfileScope p(prof_, "tp.all_gather");
    tp_.all_gather(mine, all, n);
  }
  // mine[n] = the sum over TP ranks of their partial[rank() n, (rank() + 1) n).
  void scatter(const float* partial, float* mine, int64_t n) const {
    ProfileScope p(prof_, "tp.reduce_scatter");
    tp_.reduce_scatter(partial, mine, n);
  }

  Communicator& tp_;
  bool sp_, bf16_wire_;
  kernels::ExecContext& exec_;
  Profiler* prof_;
};

}  // namespace keel
