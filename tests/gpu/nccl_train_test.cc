// The multi-GPU path on one GPU: a training job whose TP and DP tensor collectives go through
// 1-rank NCCL communicators (TrainerOptions::tensor_comms_for_one_rank) equals the same job on
// the GPU without NCCL bit for bit (a 1-rank NCCL all-reduce leaves its buffer as it is), and
// moves the bytes docs/distributed.md's formula gives a group of one: none. With a RoPE + SwiGLU
// block and PROJECTION-scope QK-norm, so every kind of TP collective in the layers (activations,
// norm statistics, the loss's row statistics) runs. Skips without a GPU or without NCCL.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/exec_context.h"
#include "launch/train/nccl_tensor_comms.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"
#if KEEL_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif

namespace keel {
namespace {

#if KEEL_HAVE_NCCL
std::vector<float> to_host(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.copy_to_host(0, t.numel(), v.data());
  return v;
}

struct JobRun {
  std::vector<double> losses, grad_norms;
  std::vector<float> params;
  int64_t tp_bytes = -1, dp_bytes = -1;
  bool nccl = false;
};

JobRun train(bool over_nccl) {
  const config::KeelConfig cfg =
      load_config("", {"model.seq_len=32", "model.d_model=64", "model.n_layers=2",
                       "model.n_heads=4", "model.position=ROPE", "model.mlp=SWIGLU",
                       "model.qk_norm=RMS", "model.qk_norm_scope=PROJECTION",
                       "train.global_batch=8", "train.steps=4", "train.eval_every=0",
                       "train.sample_chars=0", "train.plot=false", "train.tensorboard=false",
                       "data.builtin_bytes=60000", "train.precision=FP32", "train.device=CUDA"});
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  TrainerOptions opts;
  opts.progress = false;
  if (over_nccl) {
    opts.tensor_comms_for_one_rank = true;
    opts.make_tensor_comms = [](kernels::ExecContext& exec, const Topology&) {
      return one_rank_nccl_comms(exec);
    };
  }
  Trainer trainer(cfg, topo, opts);
  JobRun r;
  for (int i = 0; i < 4; ++i) {
    const StepResult s = trainer.step();
    r.losses.push_back(s.loss);
    r.grad_norms.push_back(s.grad_norm);
  }
  r.params = to_host(trainer.model().params().params());
  const Topology& t = trainer.topology();
  r.nccl = dynamic_cast<NcclCommunicator*>(&t.tp_tensors()) != nullptr &&
           dynamic_cast<NcclCommunicator*>(&t.dp_tensors()) != nullptr;
  r.tp_bytes = t.tp_tensors().bytes_moved();
  r.dp_bytes = t.dp_tensors().bytes_moved();
  return r;
}
#endif

TEST(NcclTrain, OneRankNcclJobEqualsTheJobWithoutNccl) {
  if (kernels::cuda::device_count() == 0) {
    GTEST_SKIP() << "no CUDA device: no GPU or no driver on this machine";
  }
#if KEEL_HAVE_NCCL
  kernels::cuda::register_cuda_exec_factory();
  const JobRun plain = train(false);
  const JobRun nccl = train(true);
  EXPECT_FALSE(plain.nccl);
  ASSERT_TRUE(nccl.nccl) << "the tensor collectives did not go through NCCL";
  EXPECT_EQ(nccl.losses, plain.losses);
  EXPECT_EQ(nccl.grad_norms, plain.grad_norms);
  EXPECT_TRUE(nccl.params == plain.params) << "parameters differ after 4 steps";
  EXPECT_EQ(nccl.tp_bytes, 0);  // docs/distributed.md: a group of one moves nothing
  EXPECT_EQ(nccl.dp_bytes, 0);
#else
  GTEST_SKIP() << "this build has no NCCL (keel_nccl)";
#endif
}

}  // namespace
}  // namespace keel
