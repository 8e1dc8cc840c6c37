// keel-bench: times training steps (forward, backward, clipping, AdamW) of named configs and
// reports tokens/s, achieved GFLOP/s and the fraction of this machine's measured sgemm peak.
// With --checkpoint it measures checkpoint throughput instead (launch/train/checkpoint_bench.h).
// With --device CUDA it times the GPU configs on one GPU and quotes MFU against the GPU's
// measured cuBLASLt peak at the run's precision (bf16 by default on a GPU: train.precision).
//
// The configs and the FLOPs per token: launch/train/bench_configs.h.
#include <cblas.h>
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/gemm.h"
#include "launch/train/bench_configs.h"
#include "launch/train/checkpoint_bench.h"
#include "launch/train/trainer.h"
#include "parallel/mpi_env.h"
#include "parallel/topology.h"
#if KEEL_HAVE_CUDA
#include "framework/kernels/cuda/device.h"
#include "framework/kernels/cuda/exec_context.h"
#endif

namespace {

using keel::config::KeelConfig;

using keel::bench::flops_per_token;
using keel::bench::kConfigs;
using keel::bench::Named;
using keel::bench::print_profile;

// Best of several 2048^3 sgemms on the current thread count.
double measure_sgemm_peak() {
  const int n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = omp_get_wtime();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    const double dt = omp_get_wtime() - t0;
    if (rep > 0) best = std::max(best, 2.0 * n * n * n / dt / 1e9);
  }
  return best;
}

void usage() {
  std::printf(
      "usage: [mpirun -np N] keel-bench [--config S|M|all] [--steps N] [--warmup N]\n"
      "                  [--threads N] [--tp T] [--profile] [--set path=value]...\n"
      "       keel-bench --device CUDA [--config 124M|350M|all] [--steps N] [--warmup N]\n"
      "                  [--set path=value]...\n"
      "       [mpirun -np N] keel-bench --checkpoint [--config S|M|all] [--dir PATH]\n"
      "                  [--rounds N] [--warmup N] [--threads N] [--tp T] [--set path=value]...\n"
      "Under mpirun the same global batch is split over dp = N / T ranks (tokens/s is the whole\n"
      "job's); --threads is per rank. Distributed runs also print the bytes each collective\n"
      "group moved per step and the share of DP all-reduce time not hidden behind backward.\n"
      "Prints per-config tokens/s, GFLOP/s and the fraction of the measured sgemm peak, and\n"
      "ends with one 'config=... tokens_per_s=... gflops=... peak_gflops=... peak_fraction=...'\n"
      "line per config.\n"
      "\n"
      "--device CUDA times the GPU configs (124M: GPT-2 small's shapes, 350M: GPT-2 medium's) on\n"
      "one GPU in train.precision (BF16 unless set), and quotes MFU: the model FLOPs achieved\n"
      "over the GPU's measured cuBLASLt peak at that precision (8192^3, median of 5).\n"
      "\n"
      "--checkpoint measures checkpoints of each config instead, in --rounds (default 5)\n"
      "interleaved rounds: the disk's write and read speed for the checkpoint's bytes,\n"
      "save_checkpoint's and load_checkpoint's GB/s, and the training time one synchronous and\n"
      "one asynchronous save (checkpoint.async) cost, as a fraction of a step, when saving every\n"
      "checkpoint.every (default 2) steps. Its files live in a fresh directory inside PATH\n"
      "(default $TMPDIR or /tmp), removed at the end. It ends with one\n"
      "'ckpt=disk|save|load|sync_cost|async_cost config=... ...' line per measurement.\n");
}

// What keel-bench measures.
enum class BenchMode {
  kSteps,       // training steps: tokens/s, GFLOP/s, fraction of the sgemm peak
  kCheckpoint,  // --checkpoint: disk, save, load and the cost of saves
                // (launch/train/checkpoint_bench.h)
};

// Whether `which` (--config) selects `name`.
bool selected(const std::string& which, const char* name) {
  return which == "all" || which == name;
}

// The named config with the benchmark's settings and the --set overrides, validated.
KeelConfig bench_config(const Named& named, int steps, int warmup, int tp, BenchMode mode,
                        const std::vector<std::string>& sets) {
  KeelConfig cfg = keel::bench::bench_job(named, steps, warmup);
  cfg.mutable_parallel()->set_tp(tp);
  if (mode == BenchMode::kCheckpoint) {
    cfg.mutable_checkpoint()->set_every(2);  // the cost arms' save interval
  }
  for (const auto& s : sets) keel::apply_set(s, cfg);
  keel::validate(cfg);
  return cfg;
}

int run(int argc, char** argv, const keel::MpiEnv& mpi) {
  std::string which = "all";
  int steps = -1, warmup = 2, threads = 2, tp = 1, rounds = -1;  // -1: the mode's default
  bool profile = false;
  BenchMode mode = BenchMode::kSteps;
  std::string dir, device_name = "CPU";
  std::vector<std::string> sets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      KEEL_CHECK(i + 1 < argc, kUsage, a, " needs a value");
      return argv[++i];
    };
    auto int_value = [&]() {
      const std::string v = value();
      try {
        size_t pos = 0;
        const int x = std::stoi(v, &pos);
        KEEL_CHECK(pos == v.size() && x >= 0, kUsage, a, ": not a non-negative integer: ", v);
        return x;
      } catch (const std::logic_error&) {
        KEEL_FAIL(kUsage, a, ": not an integer: ", v);
      }
    };
    if (a == "--config")
      which = value();
    else if (a == "--steps")
      steps = int_value();
    else if (a == "--warmup")
      warmup = int_value();
    else if (a == "--threads")
      threads = int_value();
    else if (a == "--tp")
      tp = int_value();
    else if (a == "--profile")
      profile = true;
    else if (a == "--checkpoint")
      mode = BenchMode::kCheckpoint;
    else if (a == "--dir")
      dir = value();
    else if (a == "--rounds")
      rounds = int_value();
    else if (a == "--set")
      sets.push_back(value());
    else if (a == "--device")
      device_name = value();
    else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else
      KEEL_FAIL(kUsage, "unknown option ", a, " (see --help)");
  }
  const bool checkpoint = mode == BenchMode::kCheckpoint;
  KEEL_CHECK(!checkpoint || steps < 0, kUsage,
             "--steps: --checkpoint times checkpoint.every steps per save (--set "
             "checkpoint.every=N)");
  if (steps < 0) steps = 5;
  KEEL_CHECK(steps >= 1, kUsage, "--steps must be at least 1");
  KEEL_CHECK(threads >= 1, kUsage, "--threads must be at least 1");
#if KEEL_HAVE_CUDA
  keel::kernels::cuda::register_cuda_exec_factory();
#endif
  keel::Device device;
  try {
    device = keel::kernels::resolve_device(device_name);
  } catch (const keel::Error& e) {
    // The message starts "train.device=X: "; here the flag is --device.
    const std::string why = e.what();
    const size_t at = why.find(": ");
    KEEL_FAIL(kUsage, "--device ", device_name, ": ",
              at == std::string::npos ? why : why.substr(at + 2));
  }
  const bool gpu = device == keel::Device::kCuda;
  bool known = which == "all";
  for (const Named& named : kConfigs) known = known || (which == named.name && named.gpu == gpu);
  KEEL_CHECK(known, kUsage, "--config ", which, ": no such ", gpu ? "GPU" : "CPU",
             " benchmark config (", gpu ? "124M, 350M" : "S, M", " or all)");
  KEEL_CHECK(!gpu || (mpi.world_size() == 1 && tp == 1 && mode == BenchMode::kSteps), kUsage,
             "--device CUDA times one GPU: no mpirun, --tp or --checkpoint");
  // Every config runs on --device (before the --set overrides, which may change the precision).
  sets.insert(sets.begin(), std::string("train.device=") + keel::device_name(device));
  if (checkpoint) {
    KEEL_CHECK(!profile, kUsage,
               "--profile times training steps; it does not go with --checkpoint");
    KEEL_CHECK(rounds != 0, kUsage, "--rounds must be at least 1");
    std::error_code ec;
    KEEL_CHECK(dir.empty() || std::filesystem::is_directory(dir, ec), kUsage, "--dir ", dir,
               ": no such directory");
  } else {
    KEEL_CHECK(dir.empty() && rounds < 0, kUsage, dir.empty() ? "--rounds" : "--dir",
               " goes with --checkpoint");
  }
  keel::kernels::set_num_threads(threads);
  keel::kernels::set_flush_denormals(true);  // as keel-train does by default (train.keep_denormals)
  const bool root = mpi.world_rank() == 0;
  if (root) {
    const std::string blas = keel::kernels::blas_kernel_warning();
    if (!blas.empty()) std::fprintf(stderr, "keel-bench: warning: %s\n", blas.c_str());
  }
  if (checkpoint) {
    if (root) {
      std::printf("keel-bench --checkpoint: %d rank(s) x %d threads; GB = 10^9 bytes\n",
                  mpi.world_size(), threads);
    }
    keel::CheckpointBenchOptions opts;
    opts.parent_dir = dir;
    opts.warmup = warmup;
    if (rounds > 0) opts.rounds = rounds;
    std::vector<std::string> summaries;
    for (const Named& named : kConfigs) {
      if (named.gpu || !selected(which, named.name)) continue;
      const KeelConfig cfg = bench_config(named, steps, warmup, tp, mode, sets);
      keel::Distributed dist(mpi, cfg.parallel().tp(), cfg.parallel().timeout_s());
      for (std::string& line : keel::run_checkpoint_bench(named.name, cfg, dist.topology(), opts)) {
        summaries.push_back(std::move(line));
      }
    }
    for (const auto& s : summaries) std::printf("%s\n", s.c_str());
    return 0;
  }
  // The peak is measured on rank 0 alone (others wait), with this rank's thread count; on a GPU
  // it is the GPU's GEMM peak at the run's precision.
  double peak = 0.0;
  keel::kernels::Precision precision = keel::kernels::Precision::kFp32;
  if (gpu) {
    KeelConfig probe = keel::default_config();
    for (const auto& s : sets) keel::apply_set(s, probe);
    precision = keel::kernels::resolve_precision(probe.train().precision(), device);
    std::string gpu_name;
#if KEEL_HAVE_CUDA
    peak =
        1e3 * keel::bench::measure_cuda_peak_tflops(precision == keel::kernels::Precision::kBf16);
    gpu_name = keel::kernels::cuda::device_description(0);
#endif
    std::printf("keel-bench: CUDA 0 (%s), %s cuBLASLt peak %.1f TFLOP/s (8192^3, median of 5)\n",
                gpu_name.c_str(), keel::kernels::precision_name(precision), peak / 1e3);
  } else {
    if (root) peak = measure_sgemm_peak();
    MPI_Bcast(&peak, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (root) {
      std::printf(
          "keel-bench: %d rank(s) x %d threads, sgemm peak %.1f GFLOP/s per rank "
          "(2048^3, best of 4)\n",
          mpi.world_size(), threads, peak);
    }
  }
  // The job's peak: every rank's cores count.
  const double job_peak = peak * mpi.world_size();
  std::vector<std::string> summaries;
  for (const Named& named : kConfigs) {
    if (named.gpu != gpu || !selected(which, named.name)) continue;
    const KeelConfig cfg = bench_config(named, steps, warmup, tp, mode, sets);
    keel::Distributed dist(mpi, cfg.parallel().tp(), cfg.parallel().timeout_s());
    const keel::Topology& topo = dist.topology();
    keel::TrainerOptions opts;
    opts.progress = false;
    keel::Trainer trainer(cfg, topo, opts);
    for (int i = 0; i < warmup; ++i) trainer.step();
    keel::Profiler& prof = trainer.model().profiler();
    prof.reset();
    prof.set_enabled(profile && !gpu);
    topo.tp_comm->reset_counters();
    topo.dp_comm->reset_counters();
    double total = 0.0, exposed = 0.0, window = 0.0, backward = 0.0;
    for (int i = 0; i < steps; ++i) {
      const keel::StepResult r = trainer.step();
      total += r.seconds;
      exposed += r.comm_exposed_s;
      window += r.comm_window_s;
      backward += r.backward_s;
    }
    // The slowest rank sets the pace.
    MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double sec = total / steps;
    const double tps = static_cast<double>(trainer.tokens_per_step()) / sec;
    const double gflops = tps * flops_per_token(cfg) / 1e9;
    const double tp_bytes = static_cast<double>(topo.tp_comm->bytes_moved()) / steps;
    const double dp_bytes = static_cast<double>(topo.dp_comm->bytes_moved()) / steps;
    if (!root) continue;
    if (gpu) {
      std::printf(
          "config %s: %lld parameters, %lld tokens/step, %.3f s/step, %.0f tokens/s, %.1f "
          "TFLOP/s, MFU %.1f%% of the %s peak, loss %.4f\n",
          named.name, static_cast<long long>(trainer.model().params().total_elems()),
          static_cast<long long>(trainer.tokens_per_step()), sec, tps, gflops / 1e3,
          100 * gflops / job_peak, keel::kernels::precision_name(precision), trainer.last().loss);
    } else {
      std::printf(
          "config %s: %lld parameters on this rank, %lld tokens/step, %.3f s/step, %.0f "
          "tokens/s, %.1f GFLOP/s "
          "(%.1f%% of the job's sgemm peak), loss %.4f\n",
          named.name, static_cast<long long>(trainer.model().params().total_elems()),
          static_cast<long long>(trainer.tokens_per_step()), sec, tps, gflops,
          100 * gflops / job_peak, trainer.last().loss);
    }
    if (mpi.world_size() > 1) {
      std::printf(
          "  layout dp %d x tp %d: per step TP moved %.0f bytes, DP moved %.0f bytes "
          "(rank 0's payload; gradient arena %lld bytes)\n",
          topo.dp, topo.tp, tp_bytes, dp_bytes,
          static_cast<long long>(trainer.model().params().total_elems() * 4));
      if (topo.dp > 1 && window > 0) {
        std::printf(
            "  DP overlap: all-reduce window %.1f ms/step, exposed (not hidden behind "
            "backward) %.1f ms/step = %.1f%% of the window; last backward %.1f ms\n",
            1e3 * window / steps, 1e3 * exposed / steps, 100 * exposed / window,
            1e3 * backward / steps);
      }
    }
    if (profile && gpu) {
      keel::bench::profile_device_steps(trainer, steps, "  ");
    } else if (profile) {
      print_profile(prof, steps, sec);
    }
    char line[400];
    std::snprintf(line, sizeof(line),
                  "config=%s tokens_per_s=%.1f gflops=%.2f peak_gflops=%.2f peak_fraction=%.4f "
                  "ranks=%d tp=%d dp=%d tp_bytes_per_step=%.0f dp_bytes_per_step=%.0f device=%s "
                  "precision=%s",
                  named.name, tps, gflops, job_peak, gflops / job_peak, mpi.world_size(), topo.tp,
                  topo.dp, tp_bytes, dp_bytes, keel::device_name(device),
                  keel::kernels::precision_name(precision));
    summaries.push_back(line);
    std::fflush(stdout);
  }
  if (root) {
    for (const auto& s : summaries) std::printf("%s\n", s.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    keel::MpiEnv mpi(&argc, &argv);
    return run(argc, argv, mpi);
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "keel-bench: %s: %s\n", keel::error_kind_name(e.kind()), e.what());
    return keel::exit_code_for(e.kind());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-bench: internal error: %s\n", e.what());
    return 1;
  }
}
