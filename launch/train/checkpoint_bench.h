// keel-bench --checkpoint: checkpoint throughput of one config, measured in one run against the
// disk it writes to. Four measurements, each over interleaved rounds (median and range):
//   disk   the file system's own speed for the checkpoint's bytes: each rank writes a file of its
//          shard's size in 4 MiB buffered write()s followed by one fsync (what the checkpoint
//          writer does), then reads it back from the page cache and again after dropping it from
//          the cache (posix_fadvise DONTNEED; the pages still resident afterwards are counted);
//   save   save_checkpoint (every rank's shard, fsyncs, rank 0's commit) in GB/s, and its
//          median's share of the disk write speed's median;
//   load   load_checkpoint straight after the save (page cache) and after dropping its files;
//   cost   the training time one save costs, as a fraction of a step: three trainers (no saves,
//          synchronous saves, checkpoint.async saves) each run one save interval per round (the
//          save, checkpoint.every steps, finish_checkpoint), one after the other, and each
//          saving arm's interval is compared with the one without saves.
// GB is 10^9 bytes. Collective: every rank calls it; rank 0 prints.
#pragma once

#include <string>
#include <vector>

#include "framework/config/keel.pb.h"
#include "parallel/communicator.h"

namespace keel {

struct CheckpointBenchOptions {
  std::string parent_dir;  // the scratch directory is created inside; empty: $TMPDIR or /tmp
  int warmup = 2;          // untimed steps of each trainer first (at least 1 is taken)
  int rounds = 5;          // interleaved rounds of every measurement
};

// Runs the four measurements on `cfg` (validated; checkpoint.every >= 1 is the save interval of
// the cost measurement, which sets checkpoint.async and train.steps itself) and returns rank 0's
// summary lines (empty on other ranks), one per measurement:
//   ckpt=disk|save|load|sync_cost|async_cost config=NAME ranks=.. tp=.. dp=.. params=.. bytes=..
// followed by the measurement's figures. Everything it writes lives in a fresh directory under
// opts.parent_dir that is removed before it returns (or throws).
std::vector<std::string> run_checkpoint_bench(const std::string& name,
                                              const config::KeelConfig& cfg, const Topology& topo,
                                              const CheckpointBenchOptions& opts);

}  // namespace keel
