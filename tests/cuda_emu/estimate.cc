// Scaling the emulator's measured records to the benchmark's shapes, and the table (estimate.h).
#include "tests/cuda_emu/estimate.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace keel_emu::estimate {

namespace {

std::vector<Entry> by_name(const std::map<std::string, Entry>& m) {
  std::vector<Entry> out;
  for (const auto& [name, e] : m) out.push_back(e);
  return out;
}

}  // namespace

std::vector<Entry> scale_tokens(const std::vector<roofline::Record>& a,
                                const std::vector<roofline::Record>& b, double n_a, double n_b,
                                double t_b, double n, double t) {
  if (a.size() != b.size()) {
    throw std::runtime_error("the two token counts launched " + std::to_string(a.size()) + " and " +
                             std::to_string(b.size()) + " tasks");
  }
  // value(N) = va + (vb - va) (N - N_a) / (N_b - N_a), at least zero.
  const double w = n_b > n_a ? (n - n_a) / (n_b - n_a) : 0.0;
  const auto at = [w](double va, double vb) { return std::max(0.0, va + (vb - va) * w); };
  std::map<std::string, Entry> sums;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].launches != b[i].launches) {
      throw std::runtime_error("task " + std::to_string(i) + " is " + a[i].name + " at " +
                               std::to_string(n_a) + " tokens and " + b[i].name + " at " +
                               std::to_string(n_b));
    }
    roofline::Record r = b[i];
    r.bytes_read = static_cast<uint64_t>(at(a[i].bytes_read, b[i].bytes_read));
    r.bytes_written = static_cast<uint64_t>(at(a[i].bytes_written, b[i].bytes_written));
    r.flops = at(a[i].flops, b[i].flops);
    r.attention_flops = b[i].attention_flops * (n * t) / (n_b * t_b);
    Entry& e = sums[r.name];
    e.name = r.name;
    e.launches += static_cast<double>(r.launches);
    e.bytes_read += static_cast<double>(r.bytes_read);
    e.bytes_written += static_cast<double>(r.bytes_written);
    e.flops += r.flops + r.attention_flops;
    e.seconds += roofline::seconds(r);
  }
  return by_name(sums);
}

std::vector<Entry> scale_layers(const std::vector<Entry>& one, const std::vector<Entry>& two,
                                int layers) {
  std::map<std::string, Entry> e1, e2, out;
  for (const Entry& e : one) e1[e.name] = e;
  for (const Entry& e : two) e2[e.name] = e;
  for (const auto& m : {e1, e2}) {
    for (const auto& [name, e] : m) out[name].name = name;
  }
  const double k = layers - 1;
  for (auto& [name, e] : out) {
    const Entry x = e1.count(name) ? e1[name] : Entry{};
    const Entry y = e2.count(name) ? e2[name] : Entry{};
    const auto at = [k](double vx, double vy) { return std::max(0.0, vx + k * (vy - vx)); };
    e.launches = at(x.launches, y.launches);
    e.bytes_read = at(x.bytes_read, y.bytes_read);
    e.bytes_written = at(x.bytes_written, y.bytes_written);
    e.flops = at(x.flops, y.flops);
    e.seconds = at(x.seconds, y.seconds);
  }
  return by_name(out);
}

double print_table(const std::vector<Entry>& entries, FILE* out) {
  std::vector<Entry> sorted = entries;
  std::sort(sorted.begin(), sorted.end(),
            [](const Entry& x, const Entry& y) { return x.seconds > y.seconds; });
  Entry total;
  for (const Entry& e : sorted) {
    total.launches += e.launches;
    total.bytes_read += e.bytes_read;
    total.bytes_written += e.bytes_written;
    total.flops += e.flops;
    total.seconds += e.seconds;
  }
  std::fprintf(out, "  %-36s %8s %10s %10s %10s %9s %6s\n", "kernel", "launches", "MB read",
               "MB written", "GFLOP", "est. ms", "share");
  const auto row = [&](const Entry& e) {
    std::fprintf(out, "  %-36s %8.0f %10.1f %10.1f %10.1f %9.3f %5.1f%%\n", e.name.c_str(),
                 e.launches, e.bytes_read / 1e6, e.bytes_written / 1e6, e.flops / 1e9,
                 1e3 * e.seconds, total.seconds > 0 ? 100 * e.seconds / total.seconds : 0.0);
  };
  for (const Entry& e : sorted) {
    if (e.launches > 0 || e.seconds > 0) row(e);
  }
  total.name = "total";
  row(total);
  return total.seconds;
}

}  // namespace keel_emu::estimate
