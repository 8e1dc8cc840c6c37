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
  // value(N) = va + (vb - va) (N - N_a) / (N_b - N_a), at least zero.
  const double w = n_b > n_a ? (n - n_a) / (n_b - n_a) : 0.0;
  const auto at = [w](double va, double vb) { return std::max(0.0, va + (vb - va) * w); };
  std::map<std::string, std::vector<const roofline::Record*>> in_a, in_b;
  for (const auto& r : a) in_a[r.name].push_back(&r);
  for (const auto& r : b) in_b[r.name].push_back(&r);
  std::map<std::string, Entry> sums;
  for (const auto& [name, rb] : in_b) {
    const auto found = in_a.find(name);
    if (found == in_a.end()) throw std::runtime_error(name + " ran at only one token count");
    const std::vector<const roofline::Record*>& ra = found->second;
    Entry& e = sums[name];
    e.name = name;
    // Tasks matched in order within their name, each scaled and priced alone; a name launched a
    // different number of times at the two counts (launches that depend on the rows) is scaled
    // whole: bytes and flops summed per run, launches those of the larger run.
    std::vector<std::pair<roofline::Record, roofline::Record>> pairs;
    if (ra.size() == rb.size()) {
      for (size_t i = 0; i < rb.size(); ++i) pairs.emplace_back(*ra[i], *rb[i]);
    } else {
      e.whole = true;
      roofline::Record sa = *rb[0], sb = *rb[0];
      sa.launches = sb.launches = 0;
      sa.bytes_read = sa.bytes_written = sb.bytes_read = sb.bytes_written = 0;
      sa.flops = sa.attention_flops = sb.flops = sb.attention_flops = 0;
      for (const auto* r : ra) {
        sa.bytes_read += r->bytes_read;
        sa.bytes_written += r->bytes_written;
        sa.flops += r->flops;
      }
      for (const auto* r : rb) {
        sb.launches += r->launches;
        sb.bytes_read += r->bytes_read;
        sb.bytes_written += r->bytes_written;
        sb.flops += r->flops;
        sb.attention_flops += r->attention_flops;
      }
      sa.launches = sb.launches;
      pairs.emplace_back(sa, sb);
    }
    for (const auto& [x, y] : pairs) {
      roofline::Record r = y;
      r.bytes_read = static_cast<uint64_t>(at(x.bytes_read, y.bytes_read));
      r.bytes_written = static_cast<uint64_t>(at(x.bytes_written, y.bytes_written));
      r.flops = at(x.flops, y.flops);
      r.attention_flops = y.attention_flops * (n * t) / (n_b * t_b);
      e.launches += static_cast<double>(r.launches);
      e.bytes_read += static_cast<double>(r.bytes_read);
      e.bytes_written += static_cast<double>(r.bytes_written);
      e.flops += r.flops + r.attention_flops;
      e.seconds += roofline::seconds(r);
    }
  }
  for (const auto& [name, ra] : in_a) {
    if (!in_b.count(name)) throw std::runtime_error(name + " ran at only one token count");
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
    e.whole = x.whole || y.whole;
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
  bool whole = false;
  const auto row = [&](const Entry& e) {
    whole = whole || e.whole;
    const std::string name = e.whole ? e.name + " *" : e.name;
    std::fprintf(out, "  %-36s %8.0f %10.1f %10.1f %10.1f %9.3f %5.1f%%\n", name.c_str(),
                 e.launches, e.bytes_read / 1e6, e.bytes_written / 1e6, e.flops / 1e9,
                 1e3 * e.seconds, total.seconds > 0 ? 100 * e.seconds / total.seconds : 0.0);
  };
  for (const Entry& e : sorted) {
    if (e.launches > 0 || e.seconds > 0) row(e);
  }
  if (whole) {
    std::fprintf(out,
                 "  * launched a different number of times at the two token counts: scaled "
                 "whole, with the larger run's launches\n");
  }
  total.name = "total";
  row(total);
  return total.seconds;
}

}  // namespace keel_emu::estimate
