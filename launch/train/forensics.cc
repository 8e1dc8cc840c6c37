#include "launch/train/forensics.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "framework/file_io.h"
#include "framework/metrics.h"

namespace keel {

namespace fs = std::filesystem;

uint64_t local_print(const double* stats, int n_stats, const Tensor& grads, int64_t offset,
                     int64_t n) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, stats, sizeof(double) * static_cast<size_t>(n_stats));
  // In chunks, so a device's gradients need no second arena on the host.
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<float> buf(static_cast<size_t>(std::min(n, kChunk)));
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t len = std::min(kChunk, n - at);
    grads.copy_to_host(offset + at, len, buf.data());
    XXH3_64bits_update(st, buf.data(), sizeof(float) * static_cast<size_t>(len));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

int64_t flip_bit(const Tensor& t, int64_t offset, int64_t n, int bit) {
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<float> buf(static_cast<size_t>(std::min(std::max<int64_t>(n, 1), kChunk)));
  int64_t at = offset;
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t len = std::min(kChunk, n - i);
    t.copy_to_host(offset + i, len, buf.data());
    const auto nz = std::find_if(buf.begin(), buf.begin() + len, [](float v) { return v != 0; });
    if (nz != buf.begin() + len) {
      at = offset + i + (nz - buf.begin());
      break;
    }
  }
  float v;
  t.copy_to_host(at, 1, &v);
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  b ^= uint32_t{1} << bit;
  std::memcpy(&v, &b, sizeof(b));
  t.copy_from_host(at, 1, &v);
  return at;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "an unknown host";
  return buf;
}

ReplayVerdict name_ranks(Communicator* world, bool mine, const std::string& host) {
  constexpr size_t kHost = 64;  // host names are cut to 63 bytes in the message
  char my_host[kHost] = {};
  std::strncpy(my_host, host.c_str(), kHost - 1);
  const int64_t flag = mine ? 1 : 0;
  const int world_size = world ? world->size() : 1;
  std::vector<int64_t> flags(static_cast<size_t>(world_size), flag);
  std::vector<char> hosts(kHost * static_cast<size_t>(world_size));
  std::memcpy(hosts.data(), my_host, kHost);
  if (world && world_size > 1) {
    world->all_gather_bytes(&flag, flags.data(), sizeof(int64_t));
    world->all_gather_bytes(my_host, hosts.data(), kHost);
  }
  ReplayVerdict v;
  for (int r = 0; r < world_size; ++r) {
    if (flags[static_cast<size_t>(r)] == 0) continue;
    v.ranks.push_back(r);
    v.hosts.emplace_back(&hosts[kHost * static_cast<size_t>(r)]);
  }
  v.same = v.ranks.empty();
  return v;
}

ReplayVerdict compare_replay(Communicator* world, const StepPrint& first, const StepPrint& replay,
                             const std::string& host) {
  // Bits, not values: NaN != NaN, and a flipped bit of the same magnitude still counts.
  auto bits = [](double v) {
    uint64_t b;
    std::memcpy(&b, &v, sizeof(b));
    return b;
  };
  const bool global_changed =
      bits(first.loss) != bits(replay.loss) || bits(first.grad_norm) != bits(replay.grad_norm);
  ReplayVerdict v = name_ranks(world, first.local != replay.local, host);
  v.same = !global_changed && v.ranks.empty();
  return v;
}

std::string describe_ranks(const ReplayVerdict& v) {
  if (v.ranks.empty()) return "no rank's own figures (only the all-reduced ones)";
  std::string s = v.ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < v.ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v.ranks[i]) + " (host " + v.hosts[i] + ")";
  }
  return s;
}

namespace {

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return name;
}

template <typename T>
void append_array(std::string& out, const std::vector<T>& v) {
  out += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ", ";
    append_json_number(out, static_cast<double>(v[i]));
  }
  out += ']';
}

}  // namespace

// Note [anomaly evidence]
// ~~~~~~~~~~~~~~~~~~~~~~~
// RUN/anomalies/step_N/ (N zero-padded to 8 digits, as checkpoints are) holds, for each step the
// guard found anomalous:
//   summary.json  the step, the anomaly, the replay's verdict ("same": the data or the
//                 optimisation; "different": suspected hardware, with the ranks and hosts), the
//                 loss, z-loss, log Z and gradient norm of the step and of its replay, each
//                 block's largest attention logit and gradient norm (the last entry: every
//                 parameter outside the blocks) and output norm over the batch (from the
//                 replay; empty without one), the first sample, and each sample's offset in the
//                 training token stream;
//   tokens.bin    the global batch's input token ids, int32 little-endian, [batch, seq_len];
//   alerts.jsonl  the alert lines of that step (alerts.jsonl's format).
// It lives beside checkpoints/, never inside it, and holds at most spike.keep_anomalies step
// directories (the oldest are removed). Written by rank 0, best effort: a failure to write
// evidence is reported and never stops the run. keel-ckpt anomaly DIR prints one.
void write_anomaly(const std::string& anomalies_dir, const AnomalyEvidence& e, int keep) {
  if (keep <= 0) return;
  try {
    const std::string dir = anomalies_dir + "/" + step_dir_name(e.step);
    fs::create_directories(dir);
    std::string j = "{";
    auto key = [&](const char* k) {
      if (j.size() > 1) j += ", ";
      append_json_string(j, k);
      j += ": ";
    };
    key("step");
    j += std::to_string(e.step);
    key("kind");
    append_json_string(j, e.kind);
    key("replay");
    append_json_string(j, e.verdict);
    key("ranks");
    append_json_string(j, e.ranks);
    key("loss");
    append_json_number(j, e.loss);
    key("replay_loss");
    append_json_number(j, e.replay_loss);
    key("grad_norm");
    append_json_number(j, e.grad_norm);
    key("replay_grad_norm");
    append_json_number(j, e.replay_grad_norm);
    key("z_loss");
    append_json_number(j, e.z_loss);
    key("log_z");
    append_json_number(j, e.log_z);
    key("max_attn_logit_layers");
    append_array(j, e.max_attn_logit_layers);
    key("grad_norm_layers");
    append_array(j, e.grad_norm_layers);
    key("act_norm_layers");
    append_array(j, e.act_norm_layers);
    key("first_sample");
    j += std::to_string(e.first_sample);
    key("seq_len");
    j += std::to_string(e.seq_len);
    key("sample_offsets");
    append_array(j, e.sample_offsets);
    j += "}\n";
    write_file_atomic(dir + "/summary.json", j);
    write_file_atomic(dir + "/tokens.bin",
                      std::string_view(reinterpret_cast<const char*>(e.tokens.data()),
                                       e.tokens.size() * sizeof(int32_t)));
    // Bounded: the newest `keep` step directories stay.
    std::vector<std::string> steps;
    for (const auto& entry : fs::directory_iterator(anomalies_dir)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_directory() && name.rfind("step_", 0) == 0) steps.push_back(name);
    }
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
      fs::remove_all(anomalies_dir + "/" + steps[i]);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "keel-train: anomaly evidence of step %lld not written: %s\n",
                 static_cast<long long>(e.step), ex.what());
  }
}

void append_anomaly_alert(const std::string& anomalies_dir, int64_t step, const std::string& json) {
  const std::string dir = anomalies_dir + "/" + step_dir_name(step);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::ofstream out(dir + "/alerts.jsonl", std::ios::app);
  out << json << "\n";
}

}  // namespace keel
