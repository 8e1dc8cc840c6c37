// The per-kernel device-time table of keel-gpu-train-bench --kernel-table (tests/gpu/README.md):
// the pure half, no CUDA and no CUPTI, so that the CPU covers it (kernel_table_test.cc on the
// CUDA emulator's test binary). tests/gpu/kernel_timing.h records the activity with CUPTI on a GPU
// and hands its records here.
//
// Records are grouped to match the rows of the emulator's roofline estimate (docs/gpu.md, "The
// roofline estimate"; tests/gpu/kernel_table.py puts the two side by side):
//   - keel's kernels by their function name: the demangled
//     `void keel::kernels::cuda::(anonymous namespace)::norm_forward_kernel<float>(...)` is
//     `norm_forward_kernel`;
//   - cuDNN's fused attention (a name containing cudnn, fmha, flash or sdpa) as `cuDNN SDPA
//     forward` or `cuDNN SDPA backward` when the name says which (fprop/fwd/forward,
//     bprop/bwd/backward/dgrad), else `cuDNN SDPA`;
//   - cuBLAS(Lt)'s GEMMs (gemm, xmma, cutlass, sm90_, nvjet, cublas, splitkreduce) as
//     `cublasLtMatmul`;
//   - copies and memsets as `memcpy HtoD` (DtoH, DtoD, HtoH, PtoP) and `memset`;
//   - anything else by its demangled name without `void` and the parameter list.
#pragma once

#include <cxxabi.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace keel::kernel_table {

// One thing the device ran: a kernel (its name as CUPTI gives it, mangled or not), a copy or a
// memset. start_ns == end_ns == 0: CUPTI could not time it (counted, not timed).
struct Record {
  enum class Kind { kKernel, kMemcpy, kMemset };
  Kind kind = Kind::kKernel;
  std::string name;  // kernels: the raw name; memcpy: the direction ("HtoD", ...); memset: ""
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
};

// One row of the table: a group of records.
struct Row {
  std::string name;
  int64_t launches = 0;
  uint64_t total_ns = 0;
};

struct Table {
  std::vector<Row> rows;  // largest total first (then by name)
  int64_t launches = 0;
  uint64_t total_ns = 0;  // the sum of the rows' times
  uint64_t busy_ns = 0;   // the union of the records' intervals: the device busy with anything
  int64_t untimed = 0;    // records without timestamps (in launches, not in the times)
};

// `name` demangled (abi::__cxa_demangle), or unchanged when it is not a mangled C++ name.
inline std::string demangle(const std::string& name) {
  if (name.rfind("_Z", 0) != 0) return name;
  int status = 0;
  char* out = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  std::string result = status == 0 && out != nullptr ? std::string(out) : name;
  std::free(out);
  return result;
}

namespace detail {

// Index of the bracket opening the one that closes at `close` (s[close] is ')' or '>'), scanning
// back over nested (), <> and []; npos when unbalanced.
inline size_t matching_open(std::string_view s, size_t close) {
  int depth = 0;
  for (size_t i = close + 1; i-- > 0;) {
    const char c = s[i];
    if (c == ')' || c == '>' || c == ']') ++depth;
    if (c == '(' || c == '<' || c == '[') {
      if (--depth == 0) return i;
    }
  }
  return std::string_view::npos;
}

inline bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

}  // namespace detail

// A demangled kernel name without its return type (`void `) and parameter list:
// `void ns::f<int>(float*, int)` -> `ns::f<int>`.
inline std::string qualified_name(std::string_view d) {
  if (d.rfind("void ", 0) == 0) d.remove_prefix(5);
  if (!d.empty() && d.back() == ')') {
    const size_t open = detail::matching_open(d, d.size() - 1);
    if (open != std::string_view::npos && open > 0) d = d.substr(0, open);
  }
  return std::string(d);
}

// The function's own name: `ns::(anonymous namespace)::f<int>` -> `f`.
inline std::string function_name(std::string_view q) {
  if (!q.empty() && q.back() == '>') {
    const size_t open = detail::matching_open(q, q.size() - 1);
    if (open != std::string_view::npos && open > 0) q = q.substr(0, open);
  }
  // The last `::` outside brackets.
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i + 1 < q.size(); ++i) {
    const char c = q[i];
    if (c == '(' || c == '<' || c == '[') ++depth;
    if (c == ')' || c == '>' || c == ']') --depth;
    if (depth == 0 && c == ':' && q[i + 1] == ':') start = i + 2;
  }
  return std::string(q.substr(start));
}

// The row a kernel's name (raw, as CUPTI gives it) belongs to; see the top of this file.
inline std::string group_kernel(const std::string& raw) {
  const std::string q = qualified_name(demangle(raw));
  if (q.rfind("keel::", 0) == 0) return function_name(q);
  const std::string l = detail::lower(raw + " " + q);
  using detail::contains;
  if (contains(l, "cudnn") || contains(l, "fmha") || contains(l, "flash") || contains(l, "sdpa")) {
    if (contains(l, "bprop") || contains(l, "bwd") || contains(l, "backward") ||
        contains(l, "dgrad"))
      return "cuDNN SDPA backward";
    if (contains(l, "fprop") || contains(l, "fwd") || contains(l, "forward"))
      return "cuDNN SDPA forward";
    return "cuDNN SDPA";
  }
  for (const char* gemm : {"gemm", "xmma", "cutlass", "sm90_", "nvjet", "cublas", "splitkreduce"}) {
    if (contains(l, gemm)) return "cublasLtMatmul";
  }
  return q;
}

inline std::string group(const Record& r) {
  switch (r.kind) {
    case Record::Kind::kMemcpy:
      return "memcpy " + r.name;
    case Record::Kind::kMemset:
      return "memset";
    case Record::Kind::kKernel:
      break;
  }
  return group_kernel(r.name);
}

// The records grouped (group()), largest total time first.
inline Table aggregate(const std::vector<Record>& records) {
  Table t;
  std::map<std::string, Row> by_name;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const Record& r : records) {
    Row& row = by_name[group(r)];
    ++row.launches;
    ++t.launches;
    if (r.start_ns == 0 && r.end_ns == 0) {
      ++t.untimed;
      continue;
    }
    const uint64_t ns = r.end_ns > r.start_ns ? r.end_ns - r.start_ns : 0;
    row.total_ns += ns;
    t.total_ns += ns;
    spans.emplace_back(r.start_ns, std::max(r.start_ns, r.end_ns));
  }
  for (auto& [name, row] : by_name) {
    row.name = name;
    t.rows.push_back(row);
  }
  std::sort(t.rows.begin(), t.rows.end(), [](const Row& a, const Row& b) {
    return a.total_ns != b.total_ns ? a.total_ns > b.total_ns : a.name < b.name;
  });
  std::sort(spans.begin(), spans.end());
  uint64_t end = 0;
  for (const auto& [s, e] : spans) {
    if (e <= end) continue;
    t.busy_ns += e - std::max(s, end);
    end = e;
  }
  return t;
}

namespace detail {

__attribute__((format(printf, 1, 2))) inline std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return buf;
}

// Launches per step: whole when they divide evenly.
inline std::string per_step(int64_t launches, int steps) {
  return launches % steps == 0 ? std::to_string(launches / steps)
                               : format("%.1f", static_cast<double>(launches) / steps);
}

}  // namespace detail

// The table per step (times divided by `steps`): a header line, one line per row (name, launches
// per step, ms per step, mean us a launch, share of the kernel time) and a total line. Names
// longer than 60 characters are cut to 57 and `...`. tests/gpu/kernel_table.py parses the rows
// from the right (the name may hold spaces).
inline std::string format_table(const Table& t, int steps) {
  using detail::format;
  const double per = steps > 0 ? static_cast<double>(steps) : 1.0;
  const int n = steps > 0 ? steps : 1;
  std::string out =
      format("  %-60s %9s %10s %10s %7s\n", "kernel", "launches", "ms/step", "mean us", "share");
  for (const Row& r : t.rows) {
    std::string name = r.name.size() > 60 ? r.name.substr(0, 57) + "..." : r.name;
    const double ms = 1e-6 * static_cast<double>(r.total_ns) / per;
    const double mean_us =
        r.launches > 0 ? 1e-3 * static_cast<double>(r.total_ns) / static_cast<double>(r.launches)
                       : 0.0;
    const double share =
        t.total_ns > 0 ? 100.0 * static_cast<double>(r.total_ns) / static_cast<double>(t.total_ns)
                       : 0.0;
    out += format("  %-60s %9s %10.3f %10.2f %6.1f%%\n", name.c_str(),
                  detail::per_step(r.launches, n).c_str(), ms, mean_us, share);
  }
  out += format("  %-60s %9s %10.3f\n", "total", detail::per_step(t.launches, n).c_str(),
                1e-6 * static_cast<double>(t.total_ns) / per);
  return out;
}

}  // namespace keel::kernel_table
