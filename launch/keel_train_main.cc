// keel-train: train a GPT from a config. Exit codes: 0 done (or stopped by SIGTERM / SIGUSR1
// after saving a checkpoint); 2 bad usage, config, data or
// layout; 3 halted by the spike guard; 1 any other failure (DESIGN.md).
#include <mpi.h>
#include <omp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "framework/config/config.h"
#include "framework/data/data_dir.h"
#include "framework/data/dataset.h"
#include "framework/data/tokenizer_json.h"
#include "framework/error.h"
#include "framework/file_io.h"
#include "framework/kernels/exec_context.h"
#include "framework/kernels/gemm.h"
#if KEEL_HAVE_CUDA
#include "framework/kernels/cuda/exec_context.h"
#endif
#include "launch/train/cli.h"
#include "launch/train/nccl_tensor_comms.h"
#include "launch/train/sampling.h"
#include "launch/train/stop_signals.h"
#include "launch/train/trainer.h"
#include "layers/memory_estimate.h"
#include "parallel/device_map.h"
#include "parallel/mpi_env.h"
#include "parallel/topology.h"

namespace {

// A closed stdout (keel-train | head) or a file-size limit must not kill a training job: with
// these ignored, the write fails instead (printf's errors are ignored; the run's files report
// theirs), and training goes on.
void ignore_write_signals() {
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGXFSZ, SIG_IGN);
}

// OpenMP + BLAS threads per rank: train.threads, or the node's hardware threads shared by its
// ranks. An explicit value above OpenBLAS's limit or above 4 x the hardware threads (which only
// oversubscribes the cores) is refused; the automatic value is held to OpenBLAS's limit.
int choose_threads(const keel::config::Train& t, int local_ranks) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int blas_max = keel::kernels::max_threads();
  if (t.threads() == 0) {
    const int threads = std::max(1, hw / std::max(1, local_ranks));
    return blas_max > 0 ? std::min(threads, blas_max) : threads;
  }
  KEEL_CHECK(blas_max <= 0 || t.threads() <= blas_max, kConfig, "train.threads=", t.threads(),
             " exceeds OpenBLAS's limit of ", blas_max,
             " threads (its buffers are sized for that many concurrent callers when it is built)");
  KEEL_CHECK(t.threads() <= 4 * static_cast<int64_t>(hw), kConfig, "train.threads=", t.threads(),
             " is more than 4 x this machine's ", hw,
             " hardware threads (oversubscribing the cores only slows training; 0: automatic)");
  return t.threads();
}

// The job's estimated memory per rank (layers/memory_estimate.h); refuses it when that exceeds
// this node's physical memory divided among its ranks, before any of it is allocated.
keel::MemoryEstimate check_memory(const keel::config::KeelConfig& cfg, const keel::Topology& topo,
                                  int local_ranks, int threads) {
  using namespace keel;
  const int64_t per_rank = cfg.train().global_batch() / topo.dp;
  // A micro-batch that does not fit the per-rank batch is the Trainer's error to report.
  const int64_t micro = cfg.train().micro_batch() > 0
                            ? std::min<int64_t>(cfg.train().micro_batch(), per_rank)
                            : per_rank;
  const Device device = kernels::resolve_device(cfg.train().device());
  MemoryEstimate need =
      estimate_memory(cfg, topo.tp, topo.dp, std::max<int64_t>(1, micro), threads, device);
  // A GPU run keeps its model on the GPU: the host's memory is not what limits it (the device's
  // caching allocator names the request it cannot serve).
  if (device != Device::kCpu) return need;
  // What the process holds before the model exists (libraries, MPI) replaces the fixed baseline
  // when it is more: about 200 MiB more in a CUDA-enabled build.
  need.overhead += std::max(0.0, resident_memory_bytes() - kProcessBaselineBytes);
  const double ram = physical_memory_bytes();
  if (ram <= 0 || micro < 1) return need;
  const double share = ram / std::max(1, local_ranks);
  KEEL_CHECK(need.total() <= share, kConfig, "this job needs about ", need.describe(),
             " per rank (micro-batch ", micro, " x model.seq_len=", cfg.model().seq_len(),
             "), but this machine has ", format_bytes(ram), " of memory",
             local_ranks > 1 ? " for its " + std::to_string(local_ranks) + " ranks (" +
                                   format_bytes(share) + " each)"
                             : std::string(),
             ": use a smaller model, model.seq_len or train.micro_batch, or more ranks "
             "(parallel.tp, parallel.zero_stage=1)",
             cfg.train().recompute_layers() < cfg.model().n_layers()
                 ? ", or recompute activations (train.recompute_layers)"
                 : "",
             cfg.parallel().tp() > 1 && !cfg.parallel().sequence_parallel()
                 ? ", or split them over TP (parallel.sequence_parallel)"
                 : "");
  return need;
}

// An error message as one printable line: control characters (a newline in a --set value, a
// stray byte of a binary file) become '?', and anything past 2000 bytes is cut.
std::string one_line(const char* message) {
  std::string s = message;
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  constexpr size_t kMax = 2000;
  if (s.size() > kMax) {
    s = s.substr(0, kMax) + "... (" + std::to_string(s.size() - kMax) + " more bytes)";
  }
  return s;
}

// RUN/plots/*.png from metrics.jsonl and alerts.jsonl through plot_run.py (copied beside this
// binary by the build), with Debian's python3 and matplotlib. Never fails the run: without
// python3, the script or matplotlib it says so in one line.
std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

void plot_run(const std::string& run_dir) {
  std::error_code ec;
  const std::filesystem::path script =
      std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "plot_run.py";
  if (ec || !std::filesystem::exists(script, ec) || !std::filesystem::exists("/usr/bin/python3")) {
    std::printf("keel-train: no plots (needs /usr/bin/python3 and %s)\n", script.c_str());
    return;
  }
  const std::string cmd =
      "/usr/bin/python3 " + shell_quote(script.string()) + " " + shell_quote(run_dir) + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return;
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) out += buf;
  const int status = pclose(p);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 0) {
    std::printf("keel-train: plots in %s/plots/ (loss, grad_norm, lr, max_attn_logit .png)\n",
                run_dir.c_str());
  } else if (rc == 3) {
    std::printf(
        "keel-train: no plots (matplotlib is not installed: apt-get install "
        "python3-matplotlib)\n");
  } else {
    std::printf("keel-train: plot_run.py failed (exit %d): %s\n", rc,
                one_line(out.c_str()).c_str());
  }
}

// A config file's text, as load_config reads it: a regular file (a FIFO is refused, not waited
// on) of at most 64 MiB.
std::string read_config_text(const std::string& path) {
  constexpr int64_t kMaxBytes = int64_t{64} << 20;
  struct stat st {};
  KEEL_CHECK(stat(path.c_str(), &st) == 0, kConfig, path,
             ": cannot open config file: ", std::strerror(errno));
  KEEL_CHECK(!S_ISDIR(st.st_mode), kConfig, path, ": is a directory, not a config file");
  KEEL_CHECK(S_ISREG(st.st_mode), kConfig, path, ": is ", keel::file_type_name(st.st_mode),
             ", not a regular config file");
  KEEL_CHECK(st.st_size <= kMaxBytes, kConfig, path, ": is ", st.st_size,
             " bytes; a config file is at most ", kMaxBytes, " bytes");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  KEEL_CHECK(in.good() || in.eof(), kConfig, path, ": cannot read config file");
  return text.str();
}

// load_config (framework/config/config.h) with one step between the --set overrides and
// validate(): a data.path that names a keel-data directory becomes its shard globs, and
// model.vocab_size 0 takes the data's (resolve_data_dir), which validate() would refuse.
keel::config::KeelConfig load_train_config(const keel::TrainArgs& args,
                                           std::optional<keel::DataDir>& data_dir) {
  using namespace keel;
  config::KeelConfig cfg = default_config();
  if (!args.config_path.empty()) {
    merge_config_text(read_config_text(args.config_path), args.config_path, cfg);
  }
  for (const std::string& set : args.sets) apply_set(set, cfg);
  data_dir = resolve_data_dir(cfg);
  validate(cfg);
  return cfg;
}

int run(int argc, char** argv, const keel::MpiEnv& mpi) {
  using namespace keel;
  const TrainArgs args = parse_train_args(argc, argv);
  if (args.help) {
    if (mpi.world_rank() == 0) std::printf("%s", train_usage());
    return 0;
  }
  std::optional<DataDir> data_dir;
  config::KeelConfig cfg = load_train_config(args, data_dir);
#if KEEL_HAVE_CUDA
  // train.device=AUTO|CUDA can pick a GPU (without one, or without a driver, AUTO is the CPU).
  kernels::cuda::register_cuda_exec_factory();
#endif
  // Every rank validates the same config, so a layout error stops all of them before any
  // collective (no hang); rank 0 alone prints it.
  Distributed dist(mpi, cfg.parallel().tp(), cfg.parallel().timeout_s());
  const Topology& topo = dist.topology();
  const auto& dbg = cfg.debug();
  KEEL_CHECK(dbg.kill_at_step() == 0 || (dbg.kill_rank() >= 0 && dbg.kill_rank() < topo.world_size),
             kConfig, "debug.kill_rank=", dbg.kill_rank(),
             " is not a rank of this job (world size ", topo.world_size, ": ranks 0..",
             topo.world_size - 1, ")");
  const int threads = choose_threads(cfg.train(), mpi.local_size());
  // Checks that need the layout or the data's size, before anything large is built.
  const MemoryEstimate memory = check_memory(cfg, topo, mpi.local_size(), threads);
  Dataset::check_eval_batches(cfg);
  kernels::set_num_threads(threads);

  TrainerOptions opts;
  opts.run_dir = args.run_dir;
  // mpirun hands ranks a pseudo-terminal: redraw in place only when run directly in a terminal.
  const bool launched =
      std::getenv("OMPI_COMM_WORLD_RANK") || std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID");
  opts.interactive = isatty(STDOUT_FILENO) != 0 && !launched;
  opts.watchdog = &dist.watchdog();
  opts.resume = args.resume;
  // SIGTERM / SIGUSR1: finish the step, save, exit 0 (Note [preemption]).
  StopSignals stop_signals(mpi.world_rank());
  opts.stop_signal = &StopSignals::received;
#if KEEL_HAVE_CUDA
  if (kernels::resolve_device(cfg.train().device()) == Device::kCuda) {
    // One rank per GPU: the node-local rank picks it (CUDA_VISIBLE_DEVICES honoured); more ranks
    // than GPUs on a node exits 2 naming the node.
    opts.device_index = device_for_rank(mpi, kernels::exec_device_count(Device::kCuda));
#if KEEL_HAVE_NCCL
    // TP and DP over NCCL on the run's stream, bootstrapped over the MPI groups; each
    // communicator is a watchdog abort hook, so a stalled collective ends the job.
    opts.make_tensor_comms = nccl_tensor_comms(dist);
#endif
  }
#endif
  Trainer trainer(cfg, topo, opts);
  const ModelDims& d = trainer.model().dims();
  if (mpi.world_rank() == 0) {
    std::printf(
        "keel-train: %d ranks = dp %d x tp %d | %d threads per rank | optimizer state "
        "%.1f MiB per rank%s | memory about %s per rank%s\n",
        topo.world_size, topo.dp, topo.tp, threads,
        static_cast<double>(trainer.optimizer().state_bytes()) / (1024.0 * 1024.0),
        cfg.parallel().zero_stage() == 1 && topo.dp > 1 ? " (ZeRO-1)" : "",
        format_bytes(memory.total()).c_str(),
        trainer.exec().device() == Device::kCpu ? "" : " on the GPU");
    std::printf(
        "keel-train: %lld parameters (d_model %lld, %lld layers, %lld heads, qk_norm %s/%s, "
        "z_loss %g) | data %s (%lld train tokens) | %lld tokens/step\n",
        static_cast<long long>(GPT::count_parameters(cfg)), static_cast<long long>(d.C),
        static_cast<long long>(d.L), static_cast<long long>(d.H),
        config::QkNorm_Name(d.qk_norm).c_str(), config::QkNormScope_Name(d.qk_scope).c_str(),
        cfg.loss().z_loss(), trainer.dataset().train().describe().c_str(),
        static_cast<long long>(trainer.dataset().train().size()),
        static_cast<long long>(trainer.tokens_per_step()));
    // With the banner (stdout), after every check that can refuse the run: a refused run prints
    // only its error.
    const int recompute = cfg.train().recompute_layers();
    std::printf("keel-train: device %s, %s matmuls%s%s\n", trainer.exec().describe().c_str(),
                kernels::precision_name(trainer.exec().precision()),
                d.tp < 2 ? ""
                : d.sp   ? ", sequence parallel (TP all-gathers and reduce-scatters in FP32)"
                : d.tp_bf16_wire ? ", TP all-reduces in BF16"
                                 : ", TP all-reduces in FP32",
                recompute == 0 ? ""
                               : (", activations of " + std::to_string(recompute) + " of " +
                                  std::to_string(d.L) + " blocks recomputed in backward")
                                     .c_str());
    if (data_dir) {
      std::printf(
          "keel-train: data directory %s (keel-data): vocabulary %lld%s, model.vocab_size %d\n",
          data_dir->dir.c_str(), static_cast<long long>(data_dir->vocab_size),
          data_dir->tokenizer.empty() ? "" : " (tokenizer.json)", cfg.model().vocab_size());
    }
    const std::string blas = kernels::blas_kernel_warning();
    if (!blas.empty()) std::printf("keel-train: warning: %s\n", blas.c_str());
    std::fflush(stdout);
  }
  trainer.run();
  if (trainer.stopped_by_signal() != 0) return 0;  // the trainer said where it saved
  if (trainer.hardware_stop()) {
    if (mpi.world_rank() == 0) {
      std::fprintf(stderr,
                   "keel-train: stopped at step %lld on a suspected hardware fault "
                   "(spike.on_hardware_fault=STOP; see %s/alerts.jsonl and %s/anomalies/): the "
                   "newest checkpoint is the last state known good; resume on other nodes\n",
                   static_cast<long long>(trainer.steps_done()), args.run_dir.c_str(),
                   args.run_dir.c_str());
    }
    return 4;
  }
  if (trainer.halted()) {
    if (mpi.world_rank() == 0) {
      std::fprintf(stderr,
                   "keel-train: halted by the spike guard at step %lld (see %s/alerts.jsonl); "
                   "the run directory's newest checkpoint is the last good state\n",
                   static_cast<long long>(trainer.steps_done()), args.run_dir.c_str());
      if (cfg.train().plot()) plot_run(args.run_dir);
    }
    return 3;
  }
  if (const auto failed = trainer.failed_checkpoint()) {
    if (mpi.world_rank() == 0) {
      std::fprintf(stderr,
                   "keel-train: io error: the checkpoint of step %lld failed (see above) and no "
                   "later one succeeded: the run's last steps are not saved\n",
                   static_cast<long long>(*failed));
    }
    return 1;
  }
  if (mpi.world_rank() == 0) {
    const StepResult& r = trainer.last();
    std::printf("keel-train: done: %lld steps", static_cast<long long>(trainer.steps_done()));
    // A run resumed at its last step takes no step here, so it has no loss of its own.
    if (r.step > 0) std::printf(", final loss %.4f nats/token", r.loss);
    if (trainer.evaluated()) std::printf(", val loss %.4f", trainer.last_val_loss());
    if (auto floor = trainer.dataset().entropy_rate_nats_per_token()) {
      std::printf(" (data entropy rate %.4f)", *floor);
    }
    std::printf(
        "\nkeel-train: outputs in %s/ (metrics.jsonl, alerts.jsonl, tensorboard/, "
        "config.pbtxt%s)\n",
        args.run_dir.c_str(),
        cfg.checkpoint().every() > 0 || cfg.checkpoint().every_minutes() > 0 ? ", checkpoints/"
                                                                             : "");
    if (cfg.train().plot()) plot_run(args.run_dir);
    std::fflush(stdout);  // the results are out before sampling starts
    // Decoded through the data's tokenizer when it has one; else byte-level vocabularies only.
    std::optional<TokenizerJson> tokenizer;
    if (data_dir && !data_dir->tokenizer.empty()) {
      tokenizer = TokenizerJson::load(data_dir->tokenizer);
    }
    if (cfg.train().sample_chars() > 0 && (tokenizer || d.V <= 256) && topo.tp == 1) {
      const std::string text =
          tokenizer ? sample_text(trainer.model(), trainer.dataset(), topo,
                                  cfg.train().sample_chars(), cfg.train().seed(), 0.8f, &*tokenizer)
                    : trainer.sample(cfg.train().sample_chars(), cfg.train().seed());
      std::printf("keel-train: sample from the trained model:\n%s\n", text.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0, world = 1;
  // MPI outlives the try block, so the error path below can still synchronise the ranks.
  std::unique_ptr<keel::MpiEnv> mpi;
  ignore_write_signals();
  try {
    mpi = std::make_unique<keel::MpiEnv>(&argc, &argv);
    ignore_write_signals();  // again, in case MPI's initialisation installed its own handlers
    rank = mpi->world_rank();
    world = mpi->world_size();
    return run(argc, argv, *mpi);
  } catch (const keel::Error& e) {
    const int code = keel::exit_code_for(e.kind());
    // Usage, config, data and layout errors are found identically by every rank; rank 0 speaks.
    // Anything else may have struck one rank only: it names itself and ends the whole job.
    if (code == 2 || world == 1) {
      if (rank == 0) {
        std::fprintf(stderr, "keel-train: %s: %s\n", keel::error_kind_name(e.kind()),
                     one_line(e.what()).c_str());
        std::fflush(stderr);
      }
      if (world > 1 && !keel::MpiEnv::barrier_for(10.0)) {
        // Not every rank found this error (e.g. a file missing on one node): name this rank
        // and end the whole job rather than leave the others blocked in a collective.
        if (rank != 0) {
          std::fprintf(stderr, "keel-train: rank %d: %s: %s\n", rank,
                       keel::error_kind_name(e.kind()), one_line(e.what()).c_str());
        }
        keel::MpiEnv::abort(code);
      }
      return code;
    }
    std::fprintf(stderr, "keel-train: rank %d: %s: %s\n", rank, keel::error_kind_name(e.kind()),
                 one_line(e.what()).c_str());
    keel::MpiEnv::abort(code);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-train: rank %d: internal error: %s\n", rank,
                 one_line(e.what()).c_str());
    if (world > 1) keel::MpiEnv::abort(1);
    return 1;
  }
}
