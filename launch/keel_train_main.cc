// keel-train: train a GPT from a config. Exit codes: 0 done; 2 bad usage, config, data or
// layout; 3 halted by the spike guard; 1 any other failure (DESIGN.md).
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>

#include "framework/config/config.h"
#include "framework/error.h"
#include "framework/kernels/gemm.h"
#include "launch/cli.h"
#include "launch/trainer.h"
#include "parallel/mpi_env.h"

namespace {

int run(int argc, char** argv, const keel::MpiEnv& mpi) {
  using namespace keel;
  const TrainArgs args = parse_train_args(argc, argv);
  if (args.help) {
    if (mpi.world_rank() == 0) std::printf("%s", train_usage());
    return 0;
  }
  config::KeelConfig cfg = load_config(args.config_path, args.sets);
  KEEL_CHECK(mpi.world_size() == 1, kLayout, "keel-train was started on ", mpi.world_size(),
             " ranks, but multi-process training (parallel.tp / data parallelism) is not built "
             "yet: run one process");
  KEEL_CHECK(cfg.parallel().tp() == 1, kLayout, "parallel.tp=", cfg.parallel().tp(),
             " needs ", cfg.parallel().tp(), " ranks; this build trains in one process (tp=1)");
  std::unique_ptr<Communicator> tp_comm, dp_comm;
  Topology topo = Topology::single(tp_comm, dp_comm);
  topo.world_size = mpi.world_size();
  topo.world_rank = mpi.world_rank();

  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = cfg.train().threads() > 0 ? cfg.train().threads()
                                                : std::max(1, hw / mpi.local_size());
  kernels::set_num_threads(threads);

  TrainerOptions opts;
  opts.run_dir = args.run_dir;
  opts.interactive = isatty(STDOUT_FILENO) != 0;
  Trainer trainer(cfg, topo, opts);
  const ModelDims& d = trainer.model().dims();
  if (mpi.world_rank() == 0) {
    std::printf(
        "keel-train: %lld parameters (d_model %lld, %lld layers, %lld heads, qk_norm %s/%s, "
        "z_loss %g) | data %s (%lld train tokens) | %lld tokens/step | %d threads\n",
        static_cast<long long>(trainer.model().params().total_elems()),
        static_cast<long long>(d.C), static_cast<long long>(d.L), static_cast<long long>(d.H),
        config::QkNorm_Name(d.qk_norm).c_str(), config::QkNormScope_Name(d.qk_scope).c_str(),
        cfg.loss().z_loss(), trainer.dataset().train().describe().c_str(),
        static_cast<long long>(trainer.dataset().train().size()),
        static_cast<long long>(trainer.tokens_per_step()), threads);
    std::fflush(stdout);
  }
  trainer.run();
  if (mpi.world_rank() == 0) {
    const StepResult& r = trainer.last();
    std::printf("keel-train: done: %lld steps, final loss %.4f nats/token", 
                static_cast<long long>(r.step), r.loss);
    if (trainer.dataset().has_val()) std::printf(", val loss %.4f", trainer.last_val_loss());
    if (auto floor = trainer.dataset().entropy_rate_nats_per_token()) {
      std::printf(" (data entropy rate %.4f)", *floor);
    }
    std::printf("\nkeel-train: outputs in %s/ (metrics.jsonl, config.pbtxt)\n",
                args.run_dir.c_str());
    if (cfg.train().sample_chars() > 0 && d.V <= 256) {
      const std::string text = trainer.sample(cfg.train().sample_chars(), cfg.train().seed());
      std::printf("keel-train: sample from the trained model:\n%s\n", text.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
  try {
    keel::MpiEnv mpi(&argc, &argv);
    rank = mpi.world_rank();
    return run(argc, argv, mpi);
  } catch (const keel::Error& e) {
    if (rank == 0) std::fprintf(stderr, "keel-train: %s: %s\n", keel::error_kind_name(e.kind()), e.what());
    return keel::exit_code_for(e.kind());
  } catch (const std::exception& e) {
    if (rank == 0) std::fprintf(stderr, "keel-train: internal error: %s\n", e.what());
    return 1;
  }
}
