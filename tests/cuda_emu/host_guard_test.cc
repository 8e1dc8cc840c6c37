// The emulator's host guard (host_guard.h; issue 30): device memory is host memory on the
// emulator, so a host dereference of a device pointer passes there and faults on a GPU. Under the
// guard it dies here too, with one line naming the address and the allocation: a read and a write
// of a cudaMalloc'd buffer, and the host std::copy of SelfCommunicator::all_gather through device
// pointers (the path the issue names). Device work on guarded memory runs and computes what it
// should: a kernel, cudaMemcpy both ways, cudaMemcpyAsync, cudaMemsetAsync and a cuBLASLt matmul;
// and two steps of the emulated CUDA Trainer run clean, which is the evidence that the training
// path never dereferences device memory on the host (ctest cuda_emu.host_guard_gpu_tests runs
// every test of tests/gpu under the guard as well, cuda_emu.host_guard_nccl keel-train on two
// emulated GPUs).
#include "tests/cuda_emu/host_guard.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/cuda/gemm.h"
#include "framework/kernels/cuda/ops.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"

namespace keel {
namespace {

namespace cuda = kernels::cuda;
namespace host_guard = keel_emu::host_guard;

// The one line a host dereference prints (host_guard.h), for a cudaMalloc of `bytes` bytes
// accessed `offset` bytes in. (The call stack names exported functions; the test's own, in an
// anonymous namespace, shows as the binary and an offset.)
std::string dereference_line(const char* access, int offset, int bytes) {
  return std::string("keel cuda emulator: host ") + access +
         " of device memory at 0x[0-9a-f]+ by [^ ]+ \\(offset " + std::to_string(offset) +
         " in cudaMalloc #[0-9]+ of " + std::to_string(bytes) +
         " bytes at 0x[0-9a-f]+, allocated from keel_cuda_emu_host_guard_tests[+]0x[0-9a-f]+ <- "
         "[^\n]*\\): only device work may "
         "touch it";
}

class HostGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The emulator's pool threads exist: a death test re-runs the binary rather than forking.
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    host_guard::set_enabled(true);
  }
};

TEST_F(HostGuardTest, HostReadOfDeviceMemoryDiesNamingTheAllocation) {
  EXPECT_EXIT(
      {
        void* p = nullptr;
        cudaMalloc(&p, 1000);
        const volatile float x = static_cast<const float*>(p)[3];
        (void)x;
      },
      ::testing::ExitedWithCode(host_guard::kExitCode), dereference_line("read", 12, 1000));
}

TEST_F(HostGuardTest, HostWriteOfDeviceMemoryDies) {
  EXPECT_EXIT(
      {
        void* p = nullptr;
        cudaMalloc(&p, 64);
        static_cast<volatile int*>(p)[0] = 1;
      },
      ::testing::ExitedWithCode(host_guard::kExitCode), dereference_line("write", 0, 64));
}

// The control: without the guard the same read passes, as it always did on the emulator.
TEST_F(HostGuardTest, WithoutTheGuardTheSameReadPasses) {
  host_guard::set_enabled(false);
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1000), cudaSuccess);
  EXPECT_EQ(host_guard::guarded(), 0u);
  EXPECT_TRUE(std::isnan(static_cast<const float*>(p)[3])) << "a fresh allocation is NaN";
  ASSERT_EQ(cudaFree(p), cudaSuccess);
  host_guard::set_enabled(true);
}

// Issue 30: SelfCommunicator's host std::copy through device pointers (unreachable with device
// memory, parallel/communicator.h) dies under the guard; its in-place form copies nothing.
TEST_F(HostGuardTest, SelfCommunicatorCopyThroughDevicePointersDies) {
  SelfCommunicator self;
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 256), cudaSuccess);
  float* d = static_cast<float*>(p);
  self.all_gather(d, d, 64);  // in place: touches nothing
  self.reduce_scatter(d, d, 64);
  EXPECT_EXIT(
      {
        void* q = nullptr;
        cudaMalloc(&q, 256);
        self.all_gather(d, static_cast<float*>(q), 64);
      },
      ::testing::ExitedWithCode(host_guard::kExitCode), "host read of device memory");
  ASSERT_EQ(cudaFree(p), cudaSuccess);
}

TEST_F(HostGuardTest, DeviceWorkOnGuardedMemoryRunsAndIsRight) {
  const size_t guarded_before = host_guard::guarded();
  cuda::Context ctx(0);
  const int64_t n = 3000;  // floats: several pages
  cuda::DeviceBuffer a = ctx.alloc(n * 4), b = ctx.alloc(n * 4), out = ctx.alloc(n * 4);
  EXPECT_GE(host_guard::guarded(), guarded_before + 3) << "the allocator's blocks are guarded";
  std::vector<float> ha(n), hb(n), back(n);
  for (int64_t i = 0; i < n; ++i) {
    ha[i] = static_cast<float>(i % 97);
    hb[i] = static_cast<float>(i % 13) - 6.0f;
  }
  // Synchronous copies both ways, an async copy and a fill, a kernel.
  ASSERT_EQ(cudaMemcpy(a.data(), ha.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(b.data(), hb.data(), n * 4, cudaMemcpyHostToDevice, ctx.stream()),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(out.data(), 0, n * 4, ctx.stream()), cudaSuccess);
  cuda::add_inplace(ctx, out.as<float>(), a.as<float>(), n);
  cuda::add_inplace(ctx, out.as<float>(), b.as<float>(), n);
  ctx.synchronize();
  ASSERT_EQ(cudaMemcpy(back.data(), out.data(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(back[i], ha[i] + hb[i]) << i;

  // A cuBLASLt matmul (fp32, exact on small integers): C[M, N] = A[M, K] B[N, K]^T.
  const int64_t M = 48, N = 40, K = 32;
  cuda::DeviceBuffer A = ctx.alloc(M * K * 4), B = ctx.alloc(N * K * 4), C = ctx.alloc(M * N * 4);
  std::vector<float> hA(M * K), hB(N * K), hC(M * N);
  for (int64_t i = 0; i < M * K; ++i) hA[i] = static_cast<float>(i % 7) - 3.0f;
  for (int64_t i = 0; i < N * K; ++i) hB[i] = static_cast<float>(i % 5) - 2.0f;
  ctx.copy_to_device(A.data(), hA.data(), hA.size() * 4);
  ctx.copy_to_device(B.data(), hB.data(), hB.size() * 4);
  cuda::gemm(ctx, false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N,
             cuda::DType::kF32, cuda::DType::kF32);
  ctx.copy_to_host(hC.data(), C.data(), hC.size() * 4);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      float want = 0.0f;
      for (int64_t p = 0; p < K; ++p) want += hA[i * K + p] * hB[j * K + p];
      ASSERT_EQ(hC[i * N + j], want) << i << "," << j;
    }
  }
  // The device memory is still closed to the host after all that.
  EXPECT_EXIT(
      {
        const volatile float x = *out.as<float>();
        (void)x;
      },
      ::testing::ExitedWithCode(host_guard::kExitCode), "host read of device memory");
}

// Two steps of the emulated CUDA Trainer (budget_test.cc's small GPT-2-shaped config at one
// layer, logged steps so the step's read-backs run), every device allocation guarded.
TEST_F(HostGuardTest, TrainingStepsNeverDereferenceDeviceMemoryOnTheHost) {
  cuda::register_cuda_exec_factory();
  const config::KeelConfig cfg = load_config("", {"model.vocab_size=256",
                                                  "model.seq_len=32",
                                                  "model.d_model=64",
                                                  "model.n_heads=2",
                                                  "model.n_layers=1",
                                                  "model.position=LEARNED",
                                                  "model.mlp=GELU",
                                                  "model.qk_norm=RMS",
                                                  "model.qk_norm_scope=HEAD_SHARED",
                                                  "model.norm=LAYERNORM",
                                                  "model.tie_embeddings=true",
                                                  "model.bias=true",
                                                  "train.global_batch=4",
                                                  "train.steps=10",
                                                  "train.log_every=1",
                                                  "train.eval_every=0",
                                                  "train.sample_chars=0",
                                                  "train.plot=false",
                                                  "train.tensorboard=false",
                                                  "data.builtin_bytes=20000",
                                                  "train.device=CUDA"});
  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  TrainerOptions opts;
  opts.progress = false;
  const size_t guarded_before = host_guard::guarded();
  Trainer trainer(cfg, topo, opts);
  EXPECT_GT(host_guard::guarded(), guarded_before) << "the trainer's device memory is guarded";
  const StepResult first = trainer.step();
  const StepResult second = trainer.step();
  EXPECT_TRUE(std::isfinite(first.loss));
  EXPECT_TRUE(std::isfinite(second.loss));
  EXPECT_NEAR(first.loss, std::log(256.0), 0.5) << "an untrained byte model's loss";
}

}  // namespace
}  // namespace keel
