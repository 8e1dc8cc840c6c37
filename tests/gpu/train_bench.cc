// keel-gpu-train-bench: keel-bench's GPU mode (launch/train/bench_configs.h: 124M with GPT-2
// small's shapes, 350M with GPT-2 medium's) without MPI, for the GPU check (tests/gpu/check.sh):
// the lent GPU machine has no OpenMPI, and keel-bench starts MPI. Times whole training steps
// (forward, backward, clipping, AdamW) of the in-process Trainer on GPU 0 and prints tokens/s,
// achieved TFLOP/s and MFU against the GPU's measured cuBLASLt peak at the run's precision, ending
// with one keel-bench summary line per config.
//
// With --nccl it also times each config with its TP and DP collectives on 1-rank NCCL
// communicators (the multi-GPU path on one GPU), interleaved with the plain run over 3 rounds,
// and prints the overhead (issue: at most 2%).
//
// With --profile it then runs `steps` more steps with the device synchronised at every profiled
// op and prints the per-op device time (framework/profiler.h), where the step's time goes.
//
// Usage: keel-gpu-train-bench [--config 124M|350M|all] [--steps N] [--warmup N] [--nccl]
//                             [--profile] [--kernel-table] [--peak-n N] [--set path=value]...
//                             [--estimate [--estimate-tokens N]]
// --peak-n: the peak GEMM's size (default 8192); with --set shrinking the model, a smoke run of
// the whole bench (the CUDA emulator's cuda_emu.train_bench_smoke test).
//
// --kernel-table (a build with CUPTI only: tests/gpu/kernel_timing.h): after the timed steps (and
// the profile), `steps` more steps recorded with CUPTI's activity API, one more before them
// recorded and dropped, and the device time per kernel per step (tests/gpu/kernel_table.h: keel's
// kernels by function name, cuBLASLt's GEMMs as cublasLtMatmul, cuDNN's as cuDNN SDPA forward /
// backward, copies, memsets), ending with "config X: kernel time A ms/step (device busy B ms ...)
// of a C ms step ...; F TFLOP per step ...: MFU M% of 989 TFLOP/s". tests/gpu/kernel_table.py
// puts it beside the roofline estimate of docs/gpu.md. Without CUPTI (the emulator's build) the
// flag is refused: "--kernel-table: this build has no CUPTI ...".
//
// --estimate (the CUDA emulator's build only; tests/cuda_emu/estimate.h): instead of timing, the
// step's H200 roofline estimate for the config (124M by default): a per-kernel table of bytes
// read and written, flops and estimated time, ending with "estimated H200 step: X ms, MFU Y% of
// 989 TFLOP/s". The emulator measures steps of 1 and 2 layers at the real widths on one sequence
// of --estimate-tokens tokens (default 512, capped at seq_len) and of half that, and scales them
// to the config's layers and tokens (docs/gpu.md, "The roofline estimate").
// Exit codes: 0 done, 77 no CUDA device (skipped), 2 bad arguments, 1 error.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/exec_context.h"
#include "framework/kernels/exec_context.h"
#include "launch/train/bench_configs.h"
#include "launch/train/nccl_tensor_comms.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"
#if KEEL_HAVE_CUPTI
#include "tests/gpu/kernel_table.h"
#include "tests/gpu/kernel_timing.h"
#endif
#if KEEL_CUDA_EMULATOR
#include "tests/cuda_emu/estimate.h"
#include "tests/cuda_emu/roofline.h"
#endif

namespace keel {
namespace {

#if KEEL_CUDA_EMULATOR
namespace roofline = keel_emu::roofline;

// One measured step (after a warm-up step) of cfg at `layers` layers and one sequence of `seq`
// tokens, the learned position table kept at `positions` rows as in the real config.
std::vector<roofline::Record> measure_step(config::KeelConfig cfg, int layers, int64_t seq,
                                           int64_t positions) {
  cfg.mutable_model()->set_n_layers(layers);
  cfg.mutable_model()->set_seq_len(static_cast<int32_t>(seq));
  cfg.mutable_model()->set_max_positions(static_cast<int32_t>(positions));
  cfg.mutable_train()->set_global_batch(1);
  cfg.mutable_train()->set_micro_batch(0);
  validate(cfg);
  std::unique_ptr<Communicator> tp_holder, dp_holder;
  const Topology topo = Topology::single(tp_holder, dp_holder);
  TrainerOptions opts;
  opts.progress = false;
  Trainer trainer(cfg, topo, opts);
  trainer.step();  // the first step's allocations and one-time work stay out
  trainer.exec().synchronize();
  roofline::take();
  roofline::set_enabled(true);
  trainer.step();
  trainer.exec().synchronize();
  roofline::set_enabled(false);
  return roofline::take();
}

// --estimate: the H200 roofline estimate of one step of `cfg` (tests/cuda_emu/estimate.h).
void estimate_step(const char* name, const config::KeelConfig& cfg, int64_t tokens) {
  namespace estimate = keel_emu::estimate;
  const int layers = cfg.model().n_layers();
  const int64_t T = cfg.model().seq_len(), B = cfg.train().global_batch();
  const int64_t positions = cfg.model().max_positions() > 0 ? cfg.model().max_positions() : T;
  const int64_t t_b = std::min<int64_t>(T, tokens), t_a = std::max<int64_t>(1, t_b / 2);
  const double n = static_cast<double>(B * T);
  const auto at_tokens = [&](int l) {
    const auto a = measure_step(cfg, l, t_a, positions);
    const auto b = measure_step(cfg, l, t_b, positions);
    return estimate::scale_tokens(a, b, static_cast<double>(t_a), static_cast<double>(t_b),
                                  static_cast<double>(t_b), n, static_cast<double>(T));
  };
  const std::vector<estimate::Entry> one = at_tokens(1);
  const std::vector<estimate::Entry> entries =
      layers == 1 ? one : estimate::scale_layers(one, at_tokens(2), layers);
  std::printf(
      "config %s: H200 roofline estimate per step: max(bytes / 4.8 TB/s HBM3e, flops / peak "
      "(989 TFLOP/s dense BF16 tensor cores, 494.5 TF32, 67 FP32 CUDA cores), 2.5 us a launch), "
      "bytes as pages first touched (4 KiB), measured on %s at %lld and %lld tokens and scaled "
      "to %d layers and %lld x %lld tokens:\n",
      name, layers == 1 ? "1 layer" : "1 and 2 layers", static_cast<long long>(t_a),
      static_cast<long long>(t_b), layers, static_cast<long long>(B), static_cast<long long>(T));
  const double seconds = estimate::print_table(entries, stdout);
  const double model_flops = bench::flops_per_token(cfg) * n;
  std::printf("config %s: model FLOPs per step %.2f TFLOP (keel-bench's count)\n", name,
              model_flops / 1e12);
  std::printf("%s\n", roofline::summary_line(1e3 * seconds, model_flops).c_str());
  std::fflush(stdout);
}
#endif

#if KEEL_HAVE_CUPTI
// --kernel-table: `steps` steps of trainer recorded with CUPTI (one before them recorded and
// dropped, so CUPTI's first-use set-up stays out), the table per step and the kernel time
// against the steps' wall time and the model's FLOPs.
void print_kernel_table(Trainer& trainer, const config::KeelConfig& cfg, int steps,
                        const char* name) {
  kernel_timing::Recorder recorder;
  recorder.start();
  trainer.step();
  recorder.stop();
  recorder.start();
  double wall = 0.0;
  for (int i = 0; i < steps; ++i) wall += trainer.step().seconds;
  const kernel_table::Table table = kernel_table::aggregate(recorder.stop());
  std::printf(
      "config %s: per-kernel device time from CUPTI activity records over %d steps (after one "
      "recorded and dropped), per step:\n%s",
      name, steps, kernel_table::format_table(table, steps).c_str());
  if (table.untimed > 0) {
    std::printf("config %s: %lld records without timestamps (counted, not timed)\n", name,
                static_cast<long long>(table.untimed));
  }
  const double kernel_ms = 1e-6 * static_cast<double>(table.total_ns) / steps;
  const double busy_ms = 1e-6 * static_cast<double>(table.busy_ns) / steps;
  const double step_ms = 1e3 * wall / steps;
  const double tflop =
      bench::flops_per_token(cfg) * static_cast<double>(trainer.tokens_per_step()) / 1e12;
  std::printf(
      "config %s: kernel time %.3f ms/step (device busy %.3f ms, the union of their intervals) "
      "of a %.3f ms step (wall, recorded): %.1f%%; %.2f TFLOP per step (keel-bench's count): "
      "MFU %.1f%% of 989 TFLOP/s\n",
      name, kernel_ms, busy_ms, step_ms, 100 * kernel_ms / step_ms, tflop,
      100 * tflop / (step_ms * 1e-3) / 989.0);
  std::fflush(stdout);
}
#endif

int run(int argc, char** argv) {
  std::string which = "all";
  int steps = 5, warmup = 2, peak_n = 8192, estimate_tokens = 512;
  std::vector<std::string> sets;
  bool nccl = false, profile = false, estimate = false, kernel_times = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nccl" || a == "--profile" || a == "--estimate" || a == "--kernel-table") {
      (a == "--nccl"       ? nccl
       : a == "--profile"  ? profile
       : a == "--estimate" ? estimate
                           : kernel_times) = true;
      continue;
    }
    KEEL_CHECK(a == "--config" || a == "--steps" || a == "--warmup" || a == "--peak-n" ||
                   a == "--set" || a == "--estimate-tokens",
               kUsage, "unknown option ", a,
               " (usage: keel-gpu-train-bench [--config 124M|350M|all] [--steps N] [--warmup N] "
               "[--nccl] [--profile] [--kernel-table] [--peak-n N] [--set path=value]... "
               "[--estimate [--estimate-tokens N]])");
    KEEL_CHECK(i + 1 < argc, kUsage, a, " needs a value");
    const std::string v = argv[++i];
    if (a == "--config") {
      which = v;
    } else if (a == "--set") {
      sets.push_back(v);
    } else {
      const int n = std::atoi(v.c_str());
      KEEL_CHECK(n >= (a == "--warmup" ? 0 : 1) && std::to_string(n) == v, kUsage, a,
                 ": not a valid count: ", v);
      (a == "--steps"             ? steps
       : a == "--warmup"          ? warmup
       : a == "--estimate-tokens" ? estimate_tokens
                                  : peak_n) = n;
    }
  }
#if !KEEL_HAVE_CUPTI
  KEEL_CHECK(!kernel_times, kUsage,
             "--kernel-table: this build has no CUPTI (libcupti was not found when it was "
             "configured; the CUDA emulator's build never has it)");
#endif
  if (kernels::cuda::device_count() == 0) {
    std::printf("keel-gpu-train-bench: no CUDA device (no GPU or no driver); skipped\n");
    return 77;
  }
  kernels::cuda::register_cuda_exec_factory();
  bool known = which == "all";
  for (const bench::Named& n : bench::kConfigs) known = known || (n.gpu && which == n.name);
  KEEL_CHECK(known, kUsage, "--config ", which, ": no such GPU config (124M, 350M or all)");
  if (estimate) {
#if KEEL_CUDA_EMULATOR
    // Attention as on an H200: cuDNN's fused SDPA (the emulated one), unless the caller says.
    setenv("KEEL_CUDA_EMU_CUDNN", "1", /*overwrite=*/0);
    for (const bench::Named& named : bench::kConfigs) {
      // The 124M shapes unless a config is named.
      if (!named.gpu || (which == "all" ? std::string(named.name) != "124M" : which != named.name))
        continue;
      config::KeelConfig cfg = bench::bench_job(named, 1, 1);
      cfg.mutable_train()->set_device("CUDA");
      for (const auto& s : sets) apply_set(s, cfg);
      validate(cfg);
      estimate_step(named.name, cfg, estimate_tokens);
    }
    return 0;
#else
    KEEL_FAIL(kUsage, "--estimate: only in the CUDA emulator's build (keel-gpu-train-bench-emu)");
#endif
  }

  config::KeelConfig probe = default_config();
  for (const auto& s : sets) apply_set(s, probe);
  const kernels::Precision precision =
      kernels::resolve_precision(probe.train().precision(), Device::kCuda);
  const double peak_tflops =
      bench::measure_cuda_peak_tflops(precision == kernels::Precision::kBf16, peak_n);
  std::printf("keel-gpu-train-bench: %s, %s cuBLASLt peak %.1f TFLOP/s (%d^3, median of 5)\n",
              kernels::cuda::device_description(0).c_str(), kernels::precision_name(precision),
              peak_tflops, peak_n);
  std::fflush(stdout);
  std::vector<std::string> summaries;
  for (const bench::Named& named : bench::kConfigs) {
    if (!named.gpu || (which != "all" && which != named.name)) continue;
    config::KeelConfig cfg = bench::bench_job(named, steps, warmup);
    cfg.mutable_train()->set_device("CUDA");
    for (const auto& s : sets) apply_set(s, cfg);
    validate(cfg);
    std::unique_ptr<Communicator> tp_holder, dp_holder;
    const Topology topo = Topology::single(tp_holder, dp_holder);
    TrainerOptions opts;
    opts.progress = false;
    Trainer trainer(cfg, topo, opts);
    for (int i = 0; i < warmup; ++i) trainer.step();
    const auto timed = [&](Trainer& t) {
      double total = 0.0;
      for (int i = 0; i < steps; ++i) total += t.step().seconds;
      return total / steps;
    };
    double sec = timed(trainer);
    if (nccl) {
#if KEEL_HAVE_NCCL
      // The same job with its tensor collectives on 1-rank NCCL communicators, timed in 3
      // interleaved rounds against the plain one (medians), so clock and thermal drift hit both.
      TrainerOptions with = opts;
      with.tensor_comms_for_one_rank = true;
      with.make_tensor_comms = [](kernels::ExecContext& exec, const Topology&) {
        return one_rank_nccl_comms(exec);
      };
      Trainer over_nccl(cfg, topo, with);
      for (int i = 0; i < warmup; ++i) over_nccl.step();
      std::vector<double> plain, via;
      for (int round = 0; round < 3; ++round) {
        plain.push_back(timed(trainer));
        via.push_back(timed(over_nccl));
      }
      std::sort(plain.begin(), plain.end());
      std::sort(via.begin(), via.end());
      sec = plain[1];
      std::printf(
          "config %s: 1-rank NCCL step %.4f s against %.4f s without (medians of 3 rounds of %d "
          "steps): overhead %+.2f%%; losses %.6f and %.6f\n",
          named.name, via[1], plain[1], steps, 100 * (via[1] / plain[1] - 1), over_nccl.last().loss,
          trainer.last().loss);
#else
      KEEL_FAIL(kUsage, "--nccl: this build has no NCCL");
#endif
    }
    // Which attention the run took (cuDNN's fused SDPA or keel's kernel, and why), decided at
    // the first step: the MFU means little without it.
    const auto* cuda_exec = dynamic_cast<const kernels::cuda::CudaExec*>(&trainer.exec());
    const std::string attention = cuda_exec != nullptr && !cuda_exec->attention_path().empty()
                                      ? cuda_exec->attention_path()
                                      : "fp32 (keel's fused attention)";
    const double tps = static_cast<double>(trainer.tokens_per_step()) / sec;
    const double gflops = tps * bench::flops_per_token(cfg) / 1e9;
    const double peak_gflops = 1e3 * peak_tflops;
    std::printf(
        "config %s: %lld parameters, %lld tokens/step, %.3f s/step, %.0f tokens/s, %.1f TFLOP/s, "
        "MFU %.1f%% of the %s peak, loss %.4f (%s; attention: %s)\n",
        named.name, static_cast<long long>(trainer.model().params().total_elems()),
        static_cast<long long>(trainer.tokens_per_step()), sec, tps, gflops / 1e3,
        100 * gflops / peak_gflops, kernels::precision_name(trainer.exec().precision()),
        trainer.last().loss, trainer.exec().describe().c_str(), attention.c_str());
    if (profile)
      bench::profile_device_steps(trainer, steps, std::string("config ") + named.name + ": ");
#if KEEL_HAVE_CUPTI
    if (kernel_times) print_kernel_table(trainer, cfg, steps, named.name);
#endif
    std::fflush(stdout);
    char line[400];
    std::snprintf(line, sizeof(line),
                  "config=%s tokens_per_s=%.1f gflops=%.2f peak_gflops=%.2f peak_fraction=%.4f "
                  "ranks=1 tp=1 dp=1 tp_bytes_per_step=0 dp_bytes_per_step=0 device=CUDA "
                  "precision=%s",
                  named.name, tps, gflops, peak_gflops, gflops / peak_gflops,
                  kernels::precision_name(trainer.exec().precision()));
    summaries.push_back(line);
  }
  for (const auto& s : summaries) std::printf("%s\n", s.c_str());
  return 0;
}

}  // namespace
}  // namespace keel

int main(int argc, char** argv) {
  try {
    return keel::run(argc, argv);
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "keel-gpu-train-bench: %s: %s\n", keel::error_kind_name(e.kind()),
                 e.what());
    return keel::exit_code_for(e.kind());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-gpu-train-bench: internal error: %s\n", e.what());
    return 1;
  }
}
