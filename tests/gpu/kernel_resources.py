#!/usr/bin/env python3
"""Holds keel's CUDA kernels to the resource rules a GPU enforces or punishes, from ptxas's own
report of the sm_90 build (the tables cmake/nvcc_resources.py writes while keel_cuda compiles).

    kernel_resources.py TABLE_DIR CUDA_SOURCE_DIR   # ctest cuda.kernel_resources
    kernel_resources.py --self-test                 # each rule, provoked

Rules, for every kernel of every framework/kernels/cuda/*.cu (cub's kernels, which keel launches
through cub's own tuned configurations, only for the first):
  - it is in a table (the .cu was compiled through the launcher: the emulator's launch checks
    would otherwise have nothing to check against);
  - no register spills and no stack frame: local memory is an L1/L2 round trip per access, the
    cliff ptxas takes silently when a kernel needs more registers than it may use or indexes a
    register array at run time;
  - without __launch_bounds__, at most 64 registers per thread, so that every block size up to
    1024 threads fits the 64 K registers of an SM ("too many resources requested for launch"
    otherwise: a launch error no test on a machine without a GPU could show). A kernel with
    bounds gets its registers fitted to them by ptxas; the emulator fails a launch above them;
  - static shared memory within the 48 KiB a kernel gets without the opt-in attribute.
Prints the table, then one line per broken rule; exits 1 if any.
"""
import os
import sys

REGISTERS_PER_SM = 65536
MAX_STATIC_SMEM = 48 << 10
FIELDS = ("kernel", "source", "arch", "registers", "stack", "spill_stores", "spill_loads",
          "smem", "max_threads", "mangled")


def read_tables(table_dir):
    rows = []
    if not os.path.isdir(table_dir):
        return rows
    for f in sorted(os.listdir(table_dir)):
        if not f.endswith(".tsv"):
            continue
        with open(os.path.join(table_dir, f)) as fh:
            for line in fh:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != len(FIELDS):
                    continue
                row = dict(zip(FIELDS, parts))
                for k in FIELDS[3:9]:
                    row[k] = int(row[k])
                rows.append(row)
    return rows


def check(rows, stems):
    """The broken rules, one line each; stems: the .cu files that must have kernels."""
    problems = []
    have = {r["source"] for r in rows}
    for stem in sorted(stems):
        if stem not in have:
            problems.append("%s.cu: no kernels in the ptxas tables (compiled without "
                            "cmake/nvcc_resources.py?)" % stem)
    for r in rows:
        where = "%s (%s.cu, %s)" % (r["kernel"], r["source"], r["arch"])
        if r["mangled"].startswith("_ZN3cub"):
            continue  # cub's own kernels and launch configurations
        if r["spill_stores"] or r["spill_loads"]:
            problems.append("%s spills: %d bytes stored, %d loaded per thread" %
                            (where, r["spill_stores"], r["spill_loads"]))
        elif r["stack"]:
            problems.append("%s has a %d-byte stack frame (local memory: a register array "
                            "indexed at run time?)" % (where, r["stack"]))
        if r["max_threads"] == 0 and r["registers"] > REGISTERS_PER_SM // 1024:
            problems.append("%s uses %d registers without __launch_bounds__: a block of more "
                            "than %d threads cannot launch" %
                            (where, r["registers"], REGISTERS_PER_SM // r["registers"] // 32 * 32))
        if r["smem"] > MAX_STATIC_SMEM:
            problems.append("%s has %d bytes of static shared memory, above the %d a kernel may "
                            "declare" % (where, r["smem"], MAX_STATIC_SMEM))
    return problems


def self_test():
    def row(**kw):
        r = dict(kernel="k", source="a", arch="sm_90", registers=32, stack=0, spill_stores=0,
                 spill_loads=0, smem=0, max_threads=0, mangled="_ZN4keel1kEv")
        r.update(kw)
        return r

    cases = [
        ([row()], {"a"}, []),
        ([row()], {"a", "b"}, ["b.cu: no kernels"]),
        ([row(spill_stores=8, stack=8)], {"a"}, ["spills: 8 bytes stored"]),
        ([row(stack=128)], {"a"}, ["128-byte stack frame"]),
        ([row(registers=65)], {"a"}, ["65 registers without __launch_bounds__: a block of more "
                                      "than 992 threads"]),
        ([row(registers=168, max_threads=128)], {"a"}, []),
        ([row(smem=49153)], {"a"}, ["49153 bytes of static shared memory"]),
        ([row(spill_stores=8, mangled="_ZN3cub6kernelEv")], {"a"}, []),
    ]
    failed = 0
    for rows, stems, want in cases:
        got = check(rows, stems)
        ok = len(got) == len(want) and all(w in g for w, g in zip(want, got))
        if not ok:
            failed += 1
            print("self-test FAIL: %r -> %r, want %r" % (rows, got, want))
    print("kernel_resources.py self-test: %d of %d cases %s" %
          (len(cases) - failed, len(cases), "passed" if not failed else "FAILED"))
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[3], file=sys.stderr)
        return 2
    table_dir, src_dir = sys.argv[1], sys.argv[2]
    stems = {f[:-3] for f in os.listdir(src_dir) if f.endswith(".cu")}
    rows = read_tables(table_dir)
    print("%-34s %-17s %5s %6s %6s %7s %8s" %
          ("kernel", "source", "regs", "stack", "spill", "smem", "bounds"))
    seen = set()
    for r in sorted(rows, key=lambda r: (r["source"], r["kernel"], -r["registers"])):
        key = tuple(r[k] for k in FIELDS[:9])
        if key in seen:
            continue
        seen.add(key)
        print("%-34s %-17s %5d %6d %6d %7d %8s" %
              (r["kernel"][:34], r["source"], r["registers"], r["stack"],
               r["spill_stores"] + r["spill_loads"], r["smem"], r["max_threads"] or "-"))
    problems = check(rows, stems)
    for p in problems:
        print("kernel_resources: " + p)
    print("kernel_resources: %d kernel instances in %d sources, %d broken rules" %
          (len(rows), len({r["source"] for r in rows}), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
