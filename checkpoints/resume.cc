// Rank 0's decisions over the run's checkpoint store: which checkpoint a run resumes from, and
// which one a rewind goes back to (see resume.h).
#include "checkpoints/resume.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <vector>

#include "checkpoints/checkpoint.h"
#include "framework/data/fingerprint.h"
#include "framework/error.h"

namespace keel {

namespace {

// Model fields a resumed run may change: the sequence length and the RoPE base, as context
// extension does, and the init scale (used only before step 1). max_positions (resolved to
// seq_len when 0) is the learned position table's shape, which the shape check covers, and means
// nothing under RoPE. Every other model field decides what the parameters compute.
bool may_change_on_resume(const std::string& field) {
  return field == "seq_len" || field == "max_positions" || field == "rope_theta" ||
         field == "init_std";
}

// proto3's zero value, as TextFormat prints it: what a field reads as in a config written before
// the field existed.
bool zero_value(const std::string& printed) {
  const std::string unspecified = "_UNSPECIFIED";
  return printed == "0" || printed == "false" || printed == "\"\"" ||
         (printed.size() >= unspecified.size() &&
          printed.compare(printed.size() - unspecified.size(), unspecified.size(), unspecified) ==
              0);
}

}  // namespace

std::string changed_model_field(const config::Model& then, const config::Model& now) {
  namespace pb = google::protobuf;
  const pb::Descriptor* d = config::Model::descriptor();
  auto printed = [](const config::Model& m, const pb::FieldDescriptor* f) {
    std::string s;
    pb::TextFormat::PrintFieldValueToString(m, f, -1, &s);
    return s;
  };
  // Every config written since the model's enums all existed has each resolved to a named value;
  // one at UNSPECIFIED marks a checkpoint from before some fields were added, whose zero-valued
  // fields are then unknown, not different.
  bool legacy = false;
  for (int i = 0; i < d->field_count(); ++i) {
    if (d->field(i)->type() == pb::FieldDescriptor::TYPE_ENUM &&
        then.GetReflection()->GetEnumValue(then, d->field(i)) == 0) {
      legacy = true;
    }
  }
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (may_change_on_resume(f->name())) continue;
    // Without QK-norm its scope means nothing.
    if (f->name() == "qk_norm_scope" && then.qk_norm() == config::NONE &&
        now.qk_norm() == config::NONE) {
      continue;
    }
    const std::string a = printed(then, f), b = printed(now, f);
    if (a == b || (legacy && zero_value(a))) continue;
    return "it was written with model." + f->name() + "=" + a + " and this config has model." +
           f->name() + "=" + b +
           " (of the model fields only seq_len, max_positions, rope_theta and init_std may " +
           "change on resume)";
  }
  return "";
}

namespace {

std::string step_list(std::vector<int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  std::string s;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i == 6 && steps.size() > 8)
      return s + ", ... (" + std::to_string(steps.size()) + " in all)";
    s += (i ? ", " : "") + std::to_string(steps[i]);
  }
  return s;
}

// Whether checkpoint directory `dir` is one of `root`'s (the run's own store).
bool inside_store(const std::string& dir, const std::string& root) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(dir).lexically_normal().parent_path();
  return std::filesystem::equivalent(parent.empty() ? "." : parent, root, ec) && !ec;
}

}  // namespace

Resumer::Resumer(const config::KeelConfig& cfg, const TrainState& state,
                 const CheckpointStore* store, ResumeOptions opts,
                 std::function<void(const std::string&)> say)
    : cfg_(cfg), state_(state), store_(store), opts_(std::move(opts)), say_(std::move(say)) {}

std::string Resumer::check(const std::string& dir) const {
  verify_checkpoint(dir);  // corrupt: throws
  const ckpt::Manifest m = read_manifest(dir);
  if (m.train_fingerprint() != state_.train_fingerprint) {
    return "it was trained on other data (" + fingerprint_hex(m.train_fingerprint()) +
           ", this run reads " + fingerprint_hex(state_.train_fingerprint) +
           "): resuming would change the data order's meaning; start a new run directory";
  }
  std::map<std::string, Shape> shapes;
  for (const ckpt::TensorRecord& t : m.tensors()) {
    shapes[t.name()] = Shape(t.shape().begin(), t.shape().end());
  }
  for (const StateParam& p : state_.tensors()) {
    auto it = shapes.find(p.info->spec.name);
    if (it == shapes.end()) {
      return "it has no tensor " + p.info->spec.name + " (the model config changed)";
    }
    if (!loadable_shape(p.info->spec, it->second)) {
      return "tensor " + p.info->spec.name + " has shape " + shape_str(it->second) + " there but " +
             shape_str(p.info->spec.logical) +
             " in this config (a shape-determining model field changed)";
    }
  }
  if (m.has_config()) return changed_model_field(m.config().model(), cfg_.model());
  return "";
}

std::string Resumer::dir_of(const ResumeVerdict& v) const {
  return opts_.mode == ResumeMode::kFrom ? opts_.path : store_->path_of(v.step);
}

ResumeVerdict Resumer::decide() const {
  if (!store_ && opts_.mode != ResumeMode::kFrom) return {};
  if (opts_.mode == ResumeMode::kFrom) {
    const std::string why = check(opts_.path);
    KEEL_CHECK(why.empty(), kData, opts_.path, ": cannot resume from it: ", why);
    if (store_) start_lineage_at(opts_.path, read_manifest(opts_.path).step());
    return {true, 0};
  }
  if (opts_.mode == ResumeMode::kFresh) {
    const std::vector<int64_t> steps = store_->steps();
    if (!steps.empty()) {
      KEEL_CHECK(opts_.overwrite, kUsage, store_->root(), " holds ", steps.size(),
                 " checkpoint(s), the newest at step ", steps.front(),
                 ": drop --no-resume to resume from it, or add --overwrite to delete them");
      store_->remove_all();
      say_("--overwrite: deleted " + std::to_string(steps.size()) + " checkpoint(s) in " +
           store_->root());
    }
    return {};
  }
  const std::optional<int64_t> step = pick_latest();  // kAuto
  return step ? ResumeVerdict{true, *step} : ResumeVerdict{};
}

std::optional<int64_t> Resumer::pick_latest() const {
  // Note [lineage]: LATEST's checkpoint (or a whole one committed after it whose LATEST
  // update a crash cut off), then older ones; never a newer one of an abandoned branch.
  const std::vector<int64_t> candidates = store_->lineage();
  const std::vector<int64_t> off = store_->off_lineage();
  for (int64_t s : off) {
    const std::string dir = store_->path_of(s);
    std::string why;
    try {
      const ckpt::Manifest m = read_manifest(dir);
      why = "its parent is step " + std::to_string(m.parent_step()) + ", not step " +
            std::to_string(store_->latest().value_or(-1)) + " which LATEST names";
    } catch (const Error& e) {
      why = std::string("unusable: ") + e.what();
    }
    say_("checkpoint " + dir + " is not on LATEST's lineage (" + why + ")");
  }
  std::vector<int64_t> unusable;
  std::optional<int64_t> chosen;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const std::string dir = store_->path_of(candidates[i]);
    std::string why;
    try {
      why = check(dir);
    } catch (const Error& e) {
      say_("checkpoint " + dir + " is unusable: " + e.what() +
           (i + 1 < candidates.size() ? "; trying the previous one" : ""));
      unusable.push_back(candidates[i]);
      continue;
    }
    KEEL_CHECK(why.empty(), kData, dir, ": cannot resume from it: ", why);
    chosen = candidates[i];
    break;
  }
  KEEL_CHECK(candidates.empty() || chosen, kData, store_->root(), ": none of its ",
             candidates.size(),
             " checkpoint(s) is usable (see above); pass --no-resume --overwrite to start "
             "over");
  if (chosen) {
    // The run goes on from here: what is newer (unusable, or off the lineage) goes.
    const int64_t step = *chosen;
    const std::vector<int64_t> removed = store_->remove_newer_than(step);
    if (store_->latest() != step) store_->set_latest(step);
    if (!removed.empty()) {
      say_("deleted " + std::to_string(removed.size()) + " checkpoint(s) newer than step " +
           std::to_string(step) + " (steps " + step_list(removed) + "; " +
           std::to_string(off.size()) + " not on LATEST's lineage, " +
           std::to_string(unusable.size()) + " unusable): the run continues from step " +
           std::to_string(step));
    }
  }
  return chosen;
}

void Resumer::start_lineage_at(const std::string& dir, int64_t step) const {
  if (inside_store(dir, store_->root())) {
    // One of this run's own: the run's history continues from it, and the branch it abandons
    // (every newer checkpoint) goes, as after a rewind. LATEST names it until the next save.
    const std::vector<int64_t> removed = store_->remove_newer_than(step);
    store_->set_latest(step);
    if (!removed.empty()) {
      say_("--resume-from " + dir + ": a new lineage from step " + std::to_string(step) +
           "; deleted the " + std::to_string(removed.size()) +
           " newer checkpoint(s) of the branch it abandons (steps " + step_list(removed) + ")");
    }
    return;
  }
  // Another run's checkpoint: this run directory's own checkpoints belong to another history.
  const std::vector<int64_t> steps = store_->steps();
  if (steps.empty()) return;
  KEEL_CHECK(opts_.overwrite, kUsage, store_->root(), " holds ", steps.size(),
             " checkpoint(s) of another history (the newest at step ", steps.front(),
             "): --resume-from ", dir,
             " there would mix two runs; use another --run-dir, or add --overwrite to delete them");
  store_->remove_all();
  say_("--overwrite: deleted " + std::to_string(steps.size()) + " checkpoint(s) in " +
       store_->root());
}

std::optional<int64_t> Resumer::pick_rewind_target(int64_t limit) const {
  if (!store_) return std::nullopt;
  for (int64_t s : store_->steps()) {
    if (s > limit) continue;
    const std::string dir = store_->path_of(s);
    try {
      if (check(dir).empty()) return s;
      say_("checkpoint " + dir + " cannot be rewound to (it does not fit this run)");
    } catch (const Error& e) {
      say_("checkpoint " + dir + " is unusable: " + e.what() + "; trying the previous one");
    }
  }
  return std::nullopt;
}

}  // namespace keel
