// The async checkpoint writer (Note [async checkpoint] in async_writer.h): begin() snapshots and
// starts the writing thread, finish() joins it and commits through the synchronous save's parts.
#include "checkpoints/async_writer.h"

#include <chrono>

#include "checkpoints/save_parts.h"
#include "framework/error.h"

namespace keel {
using namespace ckpt_save;

AsyncCheckpointWriter::AsyncCheckpointWriter(const config::KeelConfig& cfg, const Topology& topo,
                                             const CheckpointStore& store, SaveHook on_phase,
                                             Pinned pinned)
    : cfg_(cfg),
      topo_(topo),
      store_(store),
      on_phase_(std::move(on_phase)),
      pinned_(std::move(pinned)) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  // Not committed: the .tmp directory stays for the next start to remove.
  if (thread_.joinable()) thread_.join();
}

void AsyncCheckpointWriter::begin(const TrainState& state) {
  KEEL_CHECK(!pending_, kInternal, "checkpoint of step ", state.step,
             ": the previous async save (step ", header_.step(), ") was not finished");
  const double t0 = now();
  tmp_ = store_.path_of(state.step) + ".tmp";
  make_tmp_dir(topo_, store_, tmp_, state.step);
  header_ = manifest_header(state, cfg_, topo_);
  // The snapshot: this rank's slices, back to back, in host memory (reused between saves).
  const std::vector<PlannedSlice> plan = plan_my_shard(state, topo_);
  int64_t total = 0;
  offsets_.clear();
  for (const PlannedSlice& ps : plan) {
    offsets_.push_back(total);
    total += ps.slice.n();
  }
  const Device device = state.params().params().device();
  if (!snapshot_ || snapshot_device_ != device) {
    snapshot_ = std::make_unique<HostBuffer>(device);
    snapshot_device_ = device;
  }
  float* snap = snapshot_->reserve(static_cast<size_t>(total));
  snapshot_elems_ = total;
  for (size_t i = 0; i < plan.size(); ++i) copy_slice(state, plan[i], snap + offsets_[i]);
  snapshot_s_ = now() - t0;
  // The thread gets copies of the plan's geometry and names, never the state.
  std::vector<PlannedSlice> geometry = plan;
  for (PlannedSlice& ps : geometry) ps.p = nullptr;
  std::vector<std::string> names = names_of(plan);
  error_.clear();
  done_.store(false);
  pending_ = true;
  thread_ = std::thread([this, geometry = std::move(geometry), names = std::move(names)] {
    const double w0 = now();
    try {
      write_shard(
          geometry, names, [this](size_t i) { return snapshot_->data() + offsets_[i]; },
          topo_.world_rank, header_.step(), tmp_, on_phase_);
    } catch (const Error& e) {
      error_ = e.what();
    } catch (const std::exception& e) {
      error_ = std::string("internal error: ") + e.what();
    }
    write_s_ = now() - w0;
    done_.store(true);
  });
}

int64_t AsyncCheckpointWriter::finish() {
  KEEL_CHECK(pending_, kInternal, "no async checkpoint save to finish");
  if (thread_.joinable()) thread_.join();
  pending_ = false;
  const int64_t step = header_.step();
  finish_save(topo_, cfg_.checkpoint(), store_, tmp_, std::move(header_), error_, on_phase_,
              pinned_);
  return step;
}

double AsyncCheckpointWriter::now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace keel
