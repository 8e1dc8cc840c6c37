// The Trainer's device neutrality, on the fake protected device of tests/fake_device.h (a
// Device::kCuda whose memory the host cannot touch; its ExecContext runs the CPU kernels, so a
// correct run equals the CPU's bit for bit). In one process, train.device=CUDA under the fake
// against train.device=CPU:
//   - six steps (with gradient accumulation) give the same loss, z-loss, log Z, gradient norm,
//     learning rate and max attention logit at every step, and the same parameters and AdamW
//     moments; evaluation and sampling agree;
//   - checkpoints are device-neutral: a checkpoint the fake-device run writes (synchronously or
//     asynchronously) has the CPU run's shard bytes, resumes on the CPU and continues exactly like
//     the uninterrupted CPU run, and a CPU checkpoint resumes on the fake device alike;
//   - the spike guard (an injected spike rewound to a checkpoint, an injected NaN skipped) makes
//     the same decisions with the same state on both;
//   - train.device is validated: an unknown value and CUDA in a build without CUDA are config
//     errors naming train.device, and AUTO picks the CPU when no GPU context is registered.
// Any host dereference of device memory in the trainer, the model, the optimizer, the spike guard
// or the checkpoint code dies with SIGSEGV here (Note in tests/fake_device.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"
#include "tests/fake_device.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

using testing::error_of;
using testing::FakeDeviceMemory;
using testing::read_file;
using testing::ScopedFakeDevice;
using testing::TempDir;

// A tiny byte-level job (as tests/launch/trainer_test.cc): 2 layers, d_model 32, 16-token
// windows, batches of 8 in micro-batches of 4 (so gradients accumulate), six steps. FP32: the
// fake device runs the CPU's fp32 kernels (AUTO would pick BF16 for a GPU).
config::KeelConfig tiny_config(const std::string& device, std::vector<std::string> sets = {}) {
  std::vector<std::string> all = {
      "model.seq_len=16",     "model.d_model=32",        "model.n_layers=2",
      "model.n_heads=2",      "train.global_batch=8",    "train.micro_batch=4",
      "train.steps=6",        "train.eval_batches=1",    "train.sample_chars=0",
      "train.plot=false",     "train.tensorboard=false", "data.builtin_bytes=60000",
      "optim.warmup_steps=2", "train.precision=FP32",    "train.device=" + device};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// A Trainer with its own single-process topology (the Trainer keeps a reference to it).
class TrainerRun {
 public:
  explicit TrainerRun(const config::KeelConfig& cfg, std::string run_dir = "")
      : topo_(Topology::single(tp_, dp_)) {
    TrainerOptions opts;
    opts.run_dir = std::move(run_dir);
    opts.progress = false;
    trainer_ = std::make_unique<Trainer>(cfg, topo_, opts);
  }
  Trainer& operator*() { return *trainer_; }
  Trainer* operator->() { return trainer_.get(); }

  // Host copies through the backend (the arenas may be device memory).
  std::vector<float> params() { return host(trainer_->model().params().params()); }
  std::vector<float> m() { return host(trainer_->optimizer().m()); }
  std::vector<float> v() { return host(trainer_->optimizer().v()); }

  static std::vector<float> host(const Tensor& t) {
    std::vector<float> out(t.numel());
    t.copy_to_host(0, t.numel(), out.data());
    return out;
  }

 private:
  std::unique_ptr<Communicator> tp_, dp_;
  Topology topo_;
  std::unique_ptr<Trainer> trainer_;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Every field a step decides from, bit for bit (NaN equals NaN of the same bits).
void expect_same_step(const StepResult& a, const StepResult& b, const std::string& where) {
  EXPECT_EQ(a.step, b.step) << where;
  EXPECT_TRUE(same_bits(a.loss, b.loss)) << where << ": loss " << a.loss << " vs " << b.loss;
  EXPECT_TRUE(same_bits(a.z_loss, b.z_loss))
      << where << ": z_loss " << a.z_loss << " vs " << b.z_loss;
  EXPECT_TRUE(same_bits(a.log_z, b.log_z)) << where << ": log_z " << a.log_z << " vs " << b.log_z;
  EXPECT_TRUE(same_bits(a.grad_norm, b.grad_norm))
      << where << ": grad_norm " << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_TRUE(same_bits(a.lr, b.lr)) << where << ": lr " << a.lr << " vs " << b.lr;
  EXPECT_TRUE(same_bits(a.max_attn_logit, b.max_attn_logit))
      << where << ": max_attn_logit " << a.max_attn_logit << " vs " << b.max_attn_logit;
  EXPECT_EQ(a.first_sample, b.first_sample) << where;
  EXPECT_EQ(a.guard.anomaly, b.guard.anomaly) << where;
  EXPECT_EQ(a.guard.action, b.guard.action) << where;
  EXPECT_EQ(a.rewound, b.rewound) << where;
}

// Both runs' whole state: parameters, AdamW moments and step count, sampler, guard.
void expect_same_state(TrainerRun& a, TrainerRun& b, const std::string& where) {
  EXPECT_EQ(a->steps_done(), b->steps_done()) << where;
  EXPECT_TRUE(same_bits(a.params(), b.params())) << where << ": parameters differ";
  EXPECT_TRUE(same_bits(a.m(), b.m())) << where << ": AdamW m differs";
  EXPECT_TRUE(same_bits(a.v(), b.v())) << where << ": AdamW v differs";
  EXPECT_EQ(a->optimizer().t(), b->optimizer().t()) << where;
  EXPECT_EQ(a->state().sampler.next_sample, b->state().sampler.next_sample) << where;
  EXPECT_TRUE(a->state().guard == b->state().guard) << where << ": spike guard state differs";
}

std::string step_dir(const std::string& run_dir, int64_t step) {
  return CheckpointStore(run_dir + "/checkpoints").path_of(step);
}

TEST(TrainerDeviceTest, FakeDeviceTrainsLikeTheCpuBitwise) {
  ScopedFakeDevice fake;
  const FakeDeviceMemory::Stats before = fake.memory().stats();
  TrainerRun cpu(tiny_config("CPU")), dev(tiny_config("CUDA"));
  ASSERT_EQ(cpu->exec().device(), Device::kCpu);
  ASSERT_EQ(dev->exec().device(), Device::kCuda);
  ASSERT_EQ(dev->accum_steps(), 2);
  ParamStore& ps = dev->model().params();
  EXPECT_EQ(ps.params().device(), Device::kCuda);
  EXPECT_EQ(ps.grads().device(), Device::kCuda);
  EXPECT_EQ(dev->optimizer().m().device(), Device::kCuda);
  EXPECT_TRUE(fake.memory().is_device_range(ps.params().raw(), ps.params().nbytes()));
  const std::vector<float> initial = cpu.params();
  EXPECT_TRUE(same_bits(initial, dev.params())) << "initial parameters";

  for (int s = 1; s <= 6; ++s) {
    const StepResult rc = cpu->step();
    const StepResult rd = dev->step();
    EXPECT_EQ(rc.step, s);
    EXPECT_TRUE(std::isfinite(rc.loss) && std::isfinite(rc.grad_norm)) << "step " << s;
    EXPECT_EQ(rc.guard.action, GuardAction::kApply) << "step " << s;
    expect_same_step(rc, rd, "step " + std::to_string(s));
  }
  expect_same_state(cpu, dev, "after 6 steps");
  EXPECT_FALSE(same_bits(initial, cpu.params())) << "the steps did not move the parameters";

  const double vc = cpu->evaluate(), vd = dev->evaluate();
  EXPECT_TRUE(std::isfinite(vc));
  EXPECT_TRUE(same_bits(vc, vd)) << "val loss " << vc << " vs " << vd;
  const std::string sc = cpu->sample(40, 7), sd = dev->sample(40, 7);
  EXPECT_EQ(sc.size(), 16u + 40u);
  EXPECT_EQ(sc, sd);
  // Evaluation and sampling left the training state alone on both.
  expect_same_state(cpu, dev, "after evaluate and sample");

  const FakeDeviceMemory::Stats after = fake.memory().stats();
  EXPECT_GT(after.exec_calls, before.exec_calls) << "the fake's ExecContext ran no kernel";
  EXPECT_GT(after.backend_calls, before.backend_calls);
  EXPECT_FALSE(fake.memory().unlocked());
}

// run() end to end (periodic evaluation, checkpoints, metrics) on each device: the same
// checkpoint shards, and the same metrics apart from the wall-clock fields.
TEST(TrainerDeviceTest, RunWritesTheSameCheckpointsAndMetrics) {
  ScopedFakeDevice fake;
  TempDir dir("keel_trainer_device_run");
  const std::vector<std::string> sets = {"checkpoint.every=3", "checkpoint.keep=10",
                                         "train.eval_every=3", "train.log_every=1"};
  {
    TrainerRun cpu(tiny_config("CPU", sets), dir.file("cpu"));
    cpu->run();
    TrainerRun dev(tiny_config("CUDA", sets), dir.file("dev"));
    dev->run();
    EXPECT_FALSE(dev->failed_checkpoint().has_value());
    expect_same_state(cpu, dev, "after run()");
    EXPECT_TRUE(same_bits(cpu->last_val_loss(), dev->last_val_loss()));
  }
  for (int64_t step : {3, 6}) {
    const std::string a = step_dir(dir.file("cpu"), step), b = step_dir(dir.file("dev"), step);
    const std::string shard = read_file(a + "/shard_00000.bin");
    EXPECT_FALSE(shard.empty()) << a;
    EXPECT_EQ(shard, read_file(b + "/shard_00000.bin")) << "step " << step;
  }
  // metrics.jsonl without tokens_per_s (wall time): one line per step, equal text otherwise.
  auto without_speed = [](const std::string& text) {
    std::string out;
    size_t i = 0;
    while (i < text.size()) {
      const size_t k = text.find("\"tokens_per_s\": ", i);
      if (k == std::string::npos) {
        out += text.substr(i);
        break;
      }
      out += text.substr(i, k - i);
      i = text.find(',', k) + 2;  // past ", "
    }
    return out;
  };
  const std::string mc = read_file(dir.file("cpu") + "/metrics.jsonl");
  EXPECT_NE(mc.find("\"val_loss\""), std::string::npos) << mc;
  EXPECT_EQ(without_speed(mc), without_speed(read_file(dir.file("dev") + "/metrics.jsonl")));
}

// Note: trainer steps 1-3, a checkpoint of step 3 saved on `from`, then a new trainer on `to`
// resuming it in the same run directory and taking steps 4-6; everything must equal the
// uninterrupted CPU run, and the step-3 shard must equal the CPU's.
void expect_cross_device_resume(const std::string& from, const std::string& to,
                                const std::vector<std::string>& sets) {
  ScopedFakeDevice fake;
  TempDir dir("keel_trainer_device_resume");
  TrainerRun straight(tiny_config("CPU", sets), dir.file("straight"));
  std::vector<StepResult> want;
  for (int s = 1; s <= 6; ++s) {
    want.push_back(straight->step());
    if (s == 3) {
      straight->save_checkpoint();
      straight->finish_checkpoint();
    }
  }
  const std::string run_dir = dir.file("run");
  {
    TrainerRun first(tiny_config(from, sets), run_dir);
    ASSERT_EQ(first->exec().device(), from == "CPU" ? Device::kCpu : Device::kCuda);
    for (int s = 1; s <= 3; ++s) expect_same_step(want[s - 1], first->step(), "before the save");
    first->save_checkpoint();
    first->finish_checkpoint();
    EXPECT_FALSE(first->failed_checkpoint().has_value());
  }
  EXPECT_EQ(read_file(step_dir(run_dir, 3) + "/shard_00000.bin"),
            read_file(step_dir(dir.file("straight"), 3) + "/shard_00000.bin"))
      << "the " << from << " run's checkpoint differs from the CPU's";
  TrainerRun resumed(tiny_config(to, sets), run_dir);
  ASSERT_EQ(resumed->exec().device(), to == "CPU" ? Device::kCpu : Device::kCuda);
  ASSERT_EQ(resumed->resumed_from(), std::optional<int64_t>(3));
  for (int s = 4; s <= 6; ++s) {
    expect_same_step(want[s - 1], resumed->step(), "resumed step " + std::to_string(s));
  }
  expect_same_state(straight, resumed, "after resuming on " + to);
}

TEST(TrainerDeviceTest, AFakeDeviceCheckpointResumesOnTheCpu) {
  expect_cross_device_resume("CUDA", "CPU", {});
}

TEST(TrainerDeviceTest, AnAsyncFakeDeviceCheckpointResumesOnTheCpu) {
  expect_cross_device_resume("CUDA", "CPU", {"checkpoint.async=true"});
}

TEST(TrainerDeviceTest, ACpuCheckpointResumesOnTheFakeDevice) {
  expect_cross_device_resume("CPU", "CUDA", {});
}

// The spike guard on the device: an injected spike (step 12's learning rate x 1000) makes steps
// 13 and 14 anomalous, and step 14 rewinds to the step-10 checkpoint; an injected NaN (step 3) is
// skipped. Each device's run records every step; both must agree on every value, verdict and
// rewind, and end in the same state.
TEST(TrainerDeviceTest, TheSpikeGuardRewindsAndSkipsAsOnTheCpu) {
  ScopedFakeDevice fake;
  TempDir dir("keel_trainer_device_spike");
  const std::vector<std::string> sets = {"train.steps=20",
                                         "spike.window=5",
                                         "spike.warmup_steps=5",
                                         "spike.patience=2",
                                         "spike.rewind_margin=2",
                                         "spike.skip_batches=2",
                                         "checkpoint.keep=10",
                                         "debug.inject_nan_at_step=3",
                                         "debug.inject_spike_at_step=12"};
  struct Trace {
    std::vector<StepResult> steps;
    int rewinds = 0, skips = 0;
  };
  auto train = [&](const std::string& device, Trace& trace) {
    auto run = std::make_unique<TrainerRun>(tiny_config(device, sets), dir.file(device));
    for (int i = 0; i < 40 && (*run)->steps_done() < 20; ++i) {
      const StepResult r = (*run)->step();
      trace.steps.push_back(r);
      trace.rewinds += r.rewound;
      trace.skips += r.guard.action == GuardAction::kSkip;
      if (!r.rewound && (*run)->steps_done() % 5 == 0 && (*run)->state().guard.streak == 0) {
        (*run)->save_checkpoint();
      }
    }
    return run;
  };
  Trace tc, td;
  std::unique_ptr<TrainerRun> cpu = train("CPU", tc);
  std::unique_ptr<TrainerRun> dev = train("CUDA", td);
  ASSERT_EQ((*dev)->exec().device(), Device::kCuda);

  // The scenario happened on the CPU: the NaN skipped at step 3, the rewind at step 14 to 10.
  ASSERT_GE(tc.steps.size(), 14u);
  EXPECT_TRUE(std::isnan(tc.steps[2].grad_norm));
  EXPECT_EQ(tc.steps[2].guard.anomaly, Anomaly::kNonfiniteGrad);
  EXPECT_EQ(tc.steps[2].guard.action, GuardAction::kSkip);
  ASSERT_EQ(tc.rewinds, 1);
  EXPECT_TRUE(tc.steps[13].rewound);
  EXPECT_EQ(tc.steps[13].step, 14);
  EXPECT_EQ((*cpu)->state().guard.rewinds, std::vector<int64_t>{14});
  ASSERT_EQ((*cpu)->state().guard.skipped.size(), 1u);
  EXPECT_EQ((*cpu)->steps_done(), 20);

  // The device run did exactly the same.
  ASSERT_EQ(td.steps.size(), tc.steps.size());
  EXPECT_EQ(td.rewinds, tc.rewinds);
  EXPECT_EQ(td.skips, tc.skips);
  for (size_t i = 0; i < tc.steps.size(); ++i) {
    expect_same_step(tc.steps[i], td.steps[i], "step call " + std::to_string(i + 1));
  }
  expect_same_state(*cpu, *dev, "after the rewind and 20 steps");
}

// ---- train.device ----

TEST(TrainerDeviceTest, AnUnknownDeviceIsAConfigError) {
  const std::string message = error_of(ErrorKind::kConfig, [] { tiny_config("bogus"); });
  EXPECT_NE(message.find("train.device=bogus"), std::string::npos) << message;
  // Also when the value reaches the Trainer without load_config's validation.
  config::KeelConfig cfg = tiny_config("CPU");
  cfg.mutable_train()->set_device("bogus");
  const std::string trainer_message = error_of(ErrorKind::kConfig, [&] { TrainerRun run(cfg); });
  EXPECT_NE(trainer_message.find("train.device=bogus"), std::string::npos) << trainer_message;
}

TEST(TrainerDeviceTest, CudaWithoutACudaContextIsAConfigError) {
  if (kernels::has_exec_factory(Device::kCuda)) {
    GTEST_SKIP() << "a CUDA execution context factory is registered in this binary";
  }
  const config::KeelConfig cfg = tiny_config("CUDA");
  const std::string message = error_of(ErrorKind::kConfig, [&] { TrainerRun run(cfg); });
  EXPECT_NE(message.find("train.device=CUDA"), std::string::npos) << message;
  EXPECT_NE(message.find("built without CUDA"), std::string::npos) << message;
}

TEST(TrainerDeviceTest, AutoPicksTheCpuWithoutAGpuAndTheGpuWithOne) {
  if (kernels::has_exec_factory(Device::kCuda)) {
    GTEST_SKIP() << "a CUDA execution context factory is registered in this binary";
  }
  EXPECT_EQ(kernels::resolve_device("AUTO"), Device::kCpu);
  {
    TrainerRun run(tiny_config("AUTO"));
    EXPECT_EQ(run->exec().device(), Device::kCpu);
    EXPECT_EQ(run->model().params().params().device(), Device::kCpu);
  }
  // With a (fake) GPU context registered, AUTO takes it.
  ScopedFakeDevice fake;
  EXPECT_EQ(kernels::resolve_device("auto"), Device::kCuda);
  TrainerRun run(tiny_config("AUTO"));
  EXPECT_EQ(run->exec().device(), Device::kCuda);
  EXPECT_EQ(run->model().params().params().device(), Device::kCuda);
}

}  // namespace
}  // namespace keel
