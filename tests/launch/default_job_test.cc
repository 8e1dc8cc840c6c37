// The quickstart job end to end: launch/configs/default.pbtxt (read at test time, so tuning it
// needs no change here) trained in-process must end with a validation loss below half the
// corpus's byte-unigram entropy (a model that learned only byte frequencies sits at the full
// unigram entropy) and above the corpus's exact entropy rate (no model can beat that floor; a
// loss below it means validation leaks into training or the loss is computed wrongly).
// The spike guard, on by default, raises no alert on it. Takes 1-2 minutes on 2 cores.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "framework/config/config.h"
#include "framework/data/corpus.h"
#include "framework/kernels/gemm.h"
#include "launch/train/trainer.h"
#include "parallel/communicator.h"
#include "tests/launch/launch_test_util.h"

namespace keel {
namespace {

TEST(DefaultJobTest, ValidationLossEndsBetweenEntropyRateAndHalfTheUnigramEntropy) {
  const std::string path = std::string(KEEL_SOURCE_DIR) + "/launch/configs/default.pbtxt";
  const config::KeelConfig cfg = load_config(path, {});
  ASSERT_EQ(cfg.data().format(), config::BUILTIN)
      << "the default job trains on the built-in corpus";
  ASSERT_GT(cfg.train().eval_every(), 0);

  // Threads as keel-train would pick them for one process, with the environment's OpenMP count
  // standing in for the core count.
  const int threads = cfg.train().threads() > 0 ? cfg.train().threads() : omp_get_max_threads();
  kernels::set_num_threads(threads);

  std::unique_ptr<Communicator> tp, dp;
  const Topology topo = Topology::single(tp, dp);
  ASSERT_TRUE(cfg.spike().enabled()) << "the spike guard is on by default";
  testing::TempDir dir("keel_default_job");
  TrainerOptions opts;
  opts.run_dir = dir.file("run");
  opts.progress = true;  // one line per log step, into the test's log
  const double t0 = omp_get_wtime();
  Trainer trainer(cfg, topo, opts);
  ASSERT_TRUE(trainer.dataset().has_val());
  trainer.run();
  const double elapsed = omp_get_wtime() - t0;

  const double val = trainer.last_val_loss();
  EXPECT_EQ(trainer.evaluate(), val) << "the final step did not evaluate, or evaluation drifts";
  const Corpus corpus = generate_corpus(cfg.data().builtin_seed(), cfg.data().builtin_bytes());
  const double unigram = corpus.unigram_entropy_nats;
  ASSERT_TRUE(trainer.dataset().entropy_rate_nats_per_token().has_value());
  const double floor = *trainer.dataset().entropy_rate_nats_per_token();
  EXPECT_EQ(floor, corpus.entropy_rate_nats_per_byte);

  std::printf(
      "default job: %lld steps, %d threads, %.1f s | final train loss %.4f | val loss %.4f | "
      "half unigram entropy %.4f (unigram %.4f) | entropy rate (floor) %.4f nats/byte\n",
      static_cast<long long>(trainer.steps_done()), threads, elapsed, trainer.last().loss, val,
      0.5 * unigram, unigram, floor);
  EXPECT_EQ(trainer.steps_done(), cfg.train().steps());
  // No false positive: the spike guard raised no alert on a healthy run.
  EXPECT_EQ(testing::read_file(dir.file("run") + "/alerts.jsonl"), "");
  EXPECT_TRUE(std::isfinite(val));
  // launch/configs/default.pbtxt's header says the run ends at 0.68 nats/byte.
  EXPECT_GT(val, 0.63);
  EXPECT_LT(val, 0.73);
  EXPECT_LT(val, 0.5 * unigram)
      << "the default job ended above half the corpus's byte-unigram entropy";
  EXPECT_GT(val, floor)
      << "validation loss below the corpus's entropy rate: a leak or a wrong loss";
}

}  // namespace
}  // namespace keel
