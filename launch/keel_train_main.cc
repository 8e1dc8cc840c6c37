// keel-train: train a GPT from a config. Exit codes: 0 done; 2 bad usage, config, data or
// layout; 3 halted by the spike guard; 1 any other failure (DESIGN.md).
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/gemm.h"
#include "launch/cli.h"
#include "launch/trainer.h"
#include "parallel/mpi_env.h"
#include "parallel/topology.h"

namespace {

int64_t count_logical_params(keel::GPT& model) {
  int64_t n = 0;
  const keel::ParamStore& ps = model.params();
  for (int id = 0; id < ps.size(); ++id) n += keel::shape_numel(ps.info(id).spec.logical);
  return n;
}

int run(int argc, char** argv, const keel::MpiEnv& mpi) {
  using namespace keel;
  const TrainArgs args = parse_train_args(argc, argv);
  if (args.help) {
    if (mpi.world_rank() == 0) std::printf("%s", train_usage());
    return 0;
  }
  config::KeelConfig cfg = load_config(args.config_path, args.sets);
  // Every rank validates the same config, so a layout error stops all of them before any
  // collective (no hang); rank 0 alone prints it.
  Distributed dist(mpi, cfg.parallel().tp(), cfg.parallel().timeout_s());
  const Topology& topo = dist.topology();
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads =
      cfg.train().threads() > 0 ? cfg.train().threads() : std::max(1, hw / mpi.local_size());
  kernels::set_num_threads(threads);

  TrainerOptions opts;
  opts.run_dir = args.run_dir;
  // mpirun hands ranks a pseudo-terminal: redraw in place only when run directly in a terminal.
  const bool launched =
      std::getenv("OMPI_COMM_WORLD_RANK") || std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID");
  opts.interactive = isatty(STDOUT_FILENO) != 0 && !launched;
  opts.watchdog = &dist.watchdog();
  Trainer trainer(cfg, topo, opts);
  const ModelDims& d = trainer.model().dims();
  if (mpi.world_rank() == 0) {
    std::printf(
        "keel-train: %d ranks = dp %d x tp %d | %d threads per rank | optimizer state "
        "%.1f MiB per rank%s\n",
        topo.world_size, topo.dp, topo.tp, threads,
        static_cast<double>(trainer.optimizer().state_bytes()) / (1024.0 * 1024.0),
        cfg.parallel().zero_stage() == 1 && topo.dp > 1 ? " (ZeRO-1)" : "");
    std::printf(
        "keel-train: %lld parameters (d_model %lld, %lld layers, %lld heads, qk_norm %s/%s, "
        "z_loss %g) | data %s (%lld train tokens) | %lld tokens/step\n",
        static_cast<long long>(count_logical_params(trainer.model())), static_cast<long long>(d.C),
        static_cast<long long>(d.L), static_cast<long long>(d.H),
        config::QkNorm_Name(d.qk_norm).c_str(), config::QkNormScope_Name(d.qk_scope).c_str(),
        cfg.loss().z_loss(), trainer.dataset().train().describe().c_str(),
        static_cast<long long>(trainer.dataset().train().size()),
        static_cast<long long>(trainer.tokens_per_step()));
    std::fflush(stdout);
  }
  trainer.run();
  if (mpi.world_rank() == 0) {
    const StepResult& r = trainer.last();
    std::printf("keel-train: done: %lld steps, final loss %.4f nats/token",
                static_cast<long long>(r.step), r.loss);
    if (trainer.evaluated()) std::printf(", val loss %.4f", trainer.last_val_loss());
    if (auto floor = trainer.dataset().entropy_rate_nats_per_token()) {
      std::printf(" (data entropy rate %.4f)", *floor);
    }
    std::printf("\nkeel-train: outputs in %s/ (metrics.jsonl, config.pbtxt)\n",
                args.run_dir.c_str());
    if (cfg.train().sample_chars() > 0 && d.V <= 256 && topo.tp == 1) {
      const std::string text = trainer.sample(cfg.train().sample_chars(), cfg.train().seed());
      std::printf("keel-train: sample from the trained model:\n%s\n", text.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0, world = 1;
  // MPI outlives the try block, so the error path below can still synchronise the ranks.
  std::unique_ptr<keel::MpiEnv> mpi;
  try {
    mpi = std::make_unique<keel::MpiEnv>(&argc, &argv);
    rank = mpi->world_rank();
    world = mpi->world_size();
    return run(argc, argv, *mpi);
  } catch (const keel::Error& e) {
    const int code = keel::exit_code_for(e.kind());
    // Usage, config, data and layout errors are found identically by every rank; rank 0 speaks.
    // Anything else may have struck one rank only: it names itself and ends the whole job.
    if (code == 2 || world == 1) {
      if (rank == 0) {
        std::fprintf(stderr, "keel-train: %s: %s\n", keel::error_kind_name(e.kind()), e.what());
        std::fflush(stderr);
      }
      if (world > 1 && !keel::MpiEnv::barrier_for(10.0)) {
        // Not every rank found this error (e.g. a file missing on one node): name this rank
        // and end the whole job rather than leave the others blocked in a collective.
        if (rank != 0) {
          std::fprintf(stderr, "keel-train: rank %d: %s: %s\n", rank,
                       keel::error_kind_name(e.kind()), e.what());
        }
        keel::MpiEnv::abort(code);
      }
      return code;
    }
    std::fprintf(stderr, "keel-train: rank %d: %s: %s\n", rank, keel::error_kind_name(e.kind()),
                 e.what());
    keel::MpiEnv::abort(code);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel-train: rank %d: internal error: %s\n", rank, e.what());
    if (world > 1) keel::MpiEnv::abort(1);
    return 1;
  }
}
