#!/usr/bin/env python3
"""The measured per-kernel device time beside the emulator's roofline estimate.

Usage:
  kernel_table.py DOCS_GPU_MD BENCH_OUTPUT [--config 124M]
  kernel_table.py --self-test DOCS_GPU_MD

DOCS_GPU_MD: docs/gpu.md, whose section "The roofline estimate" holds the estimate table
(kernel | launches | MB read | MB written | GFLOP | est. ms | share, the 124M shapes at 16 x 1024
tokens, one step). BENCH_OUTPUT: the output of `keel-gpu-train-bench --kernel-table`
(tests/gpu/train_bench.cc), whose table per config is the device time per kernel from CUPTI,
per step, followed by "config X: kernel time ... of a ... ms step ...; F TFLOP per step".

Prints, per step: kernel | est. ms | measured ms | measured/est, largest measured first. Rows
match by name: keel's kernels by function name, `cublasLtMatmul <dtype>` as `cublasLtMatmul`,
`cuDNN SDPA forward` / `backward` as they are (both sides merged into `cuDNN SDPA` when the
measured names did not say the direction). The estimate's "N more (...)" row stands against the
measured kernels that match no named row ("other", with those kernels listed under it). Then the
totals and MFU against the datasheet's 989 TFLOP/s dense BF16: the estimate's, the measured kernel
time's and the measured step's (wall time, which adds the gaps between kernels).

--self-test: parses the real DOCS_GPU_MD (its rows, and its total of 23.758 ms) and checks the
comparison on a synthetic measured table. Standard library only. Exit 0 done, 1 a table missing or
a self-test failing, 2 bad arguments.
"""
import re
import sys

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense BF16, the datasheet's (as check.sh and docs/gpu.md)
SECTION = "### The roofline estimate"


def parse_estimate(text):
    """The estimate table of docs/gpu.md: ({name: est ms} without the total, total ms, other
    row's name or None)."""
    start = text.find(SECTION)
    if start < 0:
        raise ValueError("no section %r" % SECTION)
    lines = text[start:].splitlines()
    header = None
    rows, total, other = {}, None, None
    for line in lines:
        if header is None:
            if line.startswith("| kernel |"):
                header = [c.strip() for c in line.strip().strip("|").split("|")]
            continue
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= set("-:"):
            continue  # the alignment row
        if len(cells) != len(header):
            raise ValueError("estimate row with %d cells, header %d: %s" %
                             (len(cells), len(header), line))
        name, ms = cells[0], float(cells[header.index("est. ms")])
        if name == "total":
            total = ms
        else:
            if re.match(r"^\d+ more\b", name):
                other = name
            rows[name] = rows.get(name, 0.0) + ms
    if header is None or total is None:
        raise ValueError("no estimate table (header '| kernel |' and a total row) after %r" %
                         SECTION)
    return rows, total, other


ROW = re.compile(r"^  (.*?)\s+(\d+(?:\.\d+)?)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)%$")
TOTAL = re.compile(r"^  total\s+(\d+(?:\.\d+)?)\s+(\d+\.\d+)\s*$")
HEAD = re.compile(r"^config (\S+): per-kernel device time .* over (\d+) steps")
SUMMARY = re.compile(r"^config (\S+): kernel time (\d+\.\d+) ms/step \(device busy (\d+\.\d+) ms"
                     r".* of a (\d+\.\d+) ms step .*; (\d+\.\d+) TFLOP per step")


def parse_measured(text, config):
    """The --kernel-table output for `config`: {rows: {name: ms}, total, busy, step, tflop,
    steps}, or None when it has none."""
    out = None
    for line in text.splitlines():
        m = HEAD.match(line)
        if m:
            out = {"rows": {}, "steps": int(m.group(2))} if m.group(1) == config else None
            in_table = out is not None
            continue
        if out is None:
            continue
        m = SUMMARY.match(line)
        if m and m.group(1) == config:
            out.update(kernel=float(m.group(2)), busy=float(m.group(3)), step=float(m.group(4)),
                       tflop=float(m.group(5)))
            return out if "total" in out else None
        if not in_table:
            continue
        m = TOTAL.match(line)
        if m:
            out["total"] = float(m.group(2))
            in_table = False
            continue
        m = ROW.match(line)
        if m:
            name = m.group(1).strip()
            out["rows"][name] = out["rows"].get(name, 0.0) + float(m.group(3))
    return None


def key(name):
    if name.startswith("cublasLtMatmul"):
        return "cublasLtMatmul"
    return name


def compare(est_rows, est_total, other_name, measured):
    """[(name, est ms or None, measured ms or None)] largest measured first, then the other row
    (est of the "N more" row, the measured kernels without a named row), and that row's members."""
    merge_sdpa = "cuDNN SDPA" in measured["rows"]

    def k(name):
        n = key(name)
        return "cuDNN SDPA" if merge_sdpa and n.startswith("cuDNN SDPA") else n

    est, meas = {}, {}
    for name, ms in est_rows.items():
        if name != other_name:
            est[k(name)] = est.get(k(name), 0.0) + ms
    for name, ms in measured["rows"].items():
        meas[k(name)] = meas.get(k(name), 0.0) + ms
    rows = [(n, est[n], meas.get(n)) for n in est]
    rows.sort(key=lambda r: (-(r[2] if r[2] is not None else -1.0), -r[1], r[0]))
    members = sorted(((n, ms) for n, ms in meas.items() if n not in est), key=lambda r: -r[1])
    other = ("other", est_rows.get(other_name, 0.0) if other_name else None,
             sum(ms for _, ms in members))
    return rows, other, members


def fmt(v, spec="%.3f"):
    return "-" if v is None else spec % v


def ratio(est, meas):
    return "-" if not est or meas is None else "%.2fx" % (meas / est)


def mfu(tflop, ms):
    return 100.0 * tflop / (ms * 1e-3) / PEAK_TFLOPS


def render(config, est_rows, est_total, other_name, measured):
    rows, other, members = compare(est_rows, est_total, other_name, measured)
    width = max([len(r[0]) for r in rows] + [len("kernel"), 40])
    out = ["config %s: measured device time per step (CUPTI, %d steps) beside the roofline "
           "estimate (docs/gpu.md):" % (config, measured["steps"])]
    line = "  %-" + str(width) + "s %9s %12s %13s"
    out.append(line % ("kernel", "est. ms", "measured ms", "measured/est"))
    for name, e, m in rows:
        out.append(line % (name, fmt(e), fmt(m), ratio(e, m)))
    out.append(line % (other[0], fmt(other[1]), fmt(other[2]), ratio(other[1], other[2])))
    if other_name:
        out.append("    (other: the estimate's \"%s\"; measured, the kernels without a row of "
                   "their own)" % other_name)
    if members:
        out.append("    measured in other: " +
                   ", ".join("%s %.3f" % (n, ms) for n, ms in members[:12]) +
                   (", %d more" % (len(members) - 12) if len(members) > 12 else ""))
    out.append(line % ("total", fmt(est_total), fmt(measured["total"]),
                       ratio(est_total, measured["total"])))
    tflop = measured["tflop"]
    out.append(
        "config %s: %.2f TFLOP a step; MFU of %.0f TFLOP/s: estimate %.3f ms %.1f%%, measured "
        "kernel time %.3f ms %.1f%% (device busy %.3f ms), measured step %.3f ms (wall) %.1f%%" %
        (config, tflop, PEAK_TFLOPS, est_total, mfu(tflop, est_total), measured["total"],
         mfu(tflop, measured["total"]), measured["busy"], measured["step"],
         mfu(tflop, measured["step"])))
    return "\n".join(out)


SYNTHETIC = """keel-gpu-train-bench: NVIDIA H200, BF16 cuBLASLt peak 800.0 TFLOP/s
config 124M: per-kernel device time from CUPTI activity records over 3 steps (after one recorded and dropped), per step:
  kernel                                                        launches    ms/step    mean us   share
  cublasLtMatmul                                                     147     15.000     102.04   50.0%
  norm_backward_dinp_kernel                                           49      3.000      61.22   10.0%
  cuDNN SDPA backward                                                 36      1.000      27.78    3.3%
  cuDNN SDPA forward                                                  12      0.400      33.33    1.3%
  to_bf16_kernel                                                     158      2.000      12.66    6.7%
  foo::bar<int, float>                                                 2      0.500     250.00    1.7%
  memset                                                               4      0.100      25.00    0.3%
  total                                                              408     22.000
config 124M: kernel time 22.000 ms/step (device busy 21.500 ms, the union of their intervals) of a 25.000 ms step (wall, recorded): 88.0%; 14.00 TFLOP per step (keel-bench's count): MFU 56.6% of 989 TFLOP/s
config 350M: per-kernel device time from CUPTI activity records over 3 steps (after one recorded and dropped), per step:
  kernel                                                        launches    ms/step    mean us   share
  cublasLtMatmul                                                     291     45.000     154.00   90.0%
  total                                                              291     50.000
config 350M: kernel time 50.000 ms/step (device busy 50.000 ms, the union of their intervals) of a 55.000 ms step (wall, recorded): 90.9%; 40.00 TFLOP per step (keel-bench's count): MFU 73.5% of 989 TFLOP/s
"""


def self_test(docs_path):
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    with open(docs_path) as f:
        est_rows, est_total, other_name = parse_estimate(f.read())
    expect(abs(est_total - 23.758) < 1e-9, "estimate total %r, want 23.758" % est_total)
    expect(len(est_rows) >= 10, "only %d estimate rows" % len(est_rows))
    for name in ("cublasLtMatmul bf16", "norm_backward_dinp_kernel", "to_bf16_kernel",
                 "cuDNN SDPA backward", "cuDNN SDPA forward"):
        expect(name in est_rows, "estimate row %r missing (rows: %s)" % (name, sorted(est_rows)))
    expect(other_name is not None and other_name.startswith("16 more"),
           "the estimate's 'N more' row: %r" % other_name)
    expect(abs(sum(est_rows.values()) - est_total) < 0.01,
           "estimate rows sum to %.3f, total %.3f" % (sum(est_rows.values()), est_total))

    m = parse_measured(SYNTHETIC, "124M")
    expect(m is not None, "synthetic 124M table not parsed")
    if m is None:
        return failures
    expect(m["steps"] == 3 and m["total"] == 22.0 and m["step"] == 25.0 and m["tflop"] == 14.0
           and m["busy"] == 21.5, "synthetic summary: %r" % m)
    expect(m["rows"].get("foo::bar<int, float>") == 0.5, "a name with spaces: %r" % m["rows"])
    expect(len(m["rows"]) == 7, "synthetic rows: %r" % m["rows"])
    m350 = parse_measured(SYNTHETIC, "350M")
    expect(m350 is not None and m350["total"] == 50.0, "synthetic 350M table: %r" % m350)
    expect(parse_measured(SYNTHETIC, "1B") is None, "a config without a table parsed")
    expect(parse_measured(SYNTHETIC.split("  total")[0], "124M") is None,
           "a table cut before its total parsed")

    rows, other, members = compare(est_rows, est_total, other_name, m)
    by = {r[0]: r for r in rows}
    expect(rows[0][0] == "cublasLtMatmul" and rows[0][1] == est_rows["cublasLtMatmul bf16"]
           and rows[0][2] == 15.0, "first row: %r" % (rows[0],))
    expect(by["cuDNN SDPA forward"][2] == 0.4 and by["cuDNN SDPA backward"][2] == 1.0,
           "SDPA split: %r" % by)
    expect(by["add_kernel"][2] is None, "an estimate row not measured: %r" % (by["add_kernel"],))
    expect([n for n, _ in members] == ["foo::bar<int, float>", "memset"], "other: %r" % members)
    expect(abs(other[2] - 0.6) < 1e-9 and other[1] == est_rows[other_name], "other: %r" % (other,))
    measured_order = [r[2] for r in rows if r[2] is not None]
    expect(measured_order == sorted(measured_order, reverse=True), "not by measured time")

    # A measured table without the direction of cuDNN's kernels: both sides merged.
    merged = dict(m, rows={"cuDNN SDPA": 1.4, "cublasLtMatmul": 15.0})
    rows2, _, _ = compare(est_rows, est_total, other_name, merged)
    by2 = {r[0]: r for r in rows2}
    want = est_rows["cuDNN SDPA forward"] + est_rows["cuDNN SDPA backward"]
    expect("cuDNN SDPA" in by2 and abs(by2["cuDNN SDPA"][1] - want) < 1e-9 and
           "cuDNN SDPA forward" not in by2, "merged SDPA: %r" % by2)

    text = render("124M", est_rows, est_total, other_name, m)
    expect("  cublasLtMatmul " in text and "1.22x" in text, "rendered GEMM row:\n" + text)
    expect(re.search(r"\n  total +23\.758 +22\.000 +0\.93x\n", text) is not None,
           "rendered total:\n" + text)
    expect("estimate 23.758 ms 59.6%" in text and "measured step 25.000 ms (wall) 56.6%" in text,
           "rendered MFU:\n" + text)
    if not failures:
        print(text)
    return failures


def main(argv):
    args = argv[1:]
    if args[:1] == ["--self-test"] and len(args) == 2:
        failures = self_test(args[1])
        for f in failures:
            print("FAIL: " + f)
        print("kernel_table.py self-test: %s" % ("PASS" if not failures else "FAIL"))
        return 1 if failures else 0
    config = "124M"
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            print("kernel_table.py: --config needs a value", file=sys.stderr)
            return 2
        config = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(args[0]) as f:
        est_rows, est_total, other_name = parse_estimate(f.read())
    with open(args[1], errors="replace") as f:
        measured = parse_measured(f.read(), config)
    if measured is None:
        print("kernel_table.py: no kernel table for config %s in %s (keel-gpu-train-bench "
              "--kernel-table prints it)" % (config, args[1]))
        return 1
    print(render(config, est_rows, est_total, other_name, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
