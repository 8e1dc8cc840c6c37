#!/usr/bin/env python3
"""keel_cuda's compiler launcher: compiles one .cu as asked and records its kernels' resources.

Usage (CUDA_COMPILER_LAUNCHER, framework/CMakeLists.txt):
    nvcc_resources.py OUT_DIR NVCC ARGS...

Runs NVCC ARGS with ptxas's report (-Xptxas=-v) and nvcc's intermediate files kept in a temporary
folder, and writes OUT_DIR/<stem>.tsv, one row per kernel and architecture:

    kernel  source  arch  registers  stack_bytes  spill_store_bytes  spill_load_bytes
    static_smem_bytes  max_threads  mangled

kernel is the unqualified name (as a launch names it), source the .cu's stem, max_threads the
kernel's __launch_bounds__ (0 without one: ptxas then allows up to 255 registers per thread).
ptxas's report is what a GPU checks a launch against ("too many resources requested for launch")
and says where a kernel spills; the emulator and tests/gpu/kernel_resources.py read these tables
(tests/cuda_emu/README.md). The report lines are not printed; every other line of the compiler's
output is, and its exit status is this script's.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
PTX_ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\w+)\(", re.M)
MAXNTID = re.compile(r"^\.maxntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", re.M)


def short_name(demangled):
    """attention_dq_kernel from 'void ns::(anonymous namespace)::attention_dq_kernel<float>(...)'."""
    depth, end = 0, len(demangled)
    for i, ch in enumerate(demangled):  # the parameter list: the first '(' outside <...>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not demangled.startswith("(anonymous", i):
            end = i
            break
    name = demangled[:end]
    while name.endswith(">"):  # template arguments
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {">": 1, "<": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = name.split("::")[-1]
    return name.split()[-1] if name.split() else name


def demangle(names):
    if not names:
        return []
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        if len(out) == len(names):
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return names


def max_threads(ptx_dir):
    """Mangled kernel name -> threads of its __launch_bounds__ (0: none), from the kept PTX."""
    bounds = {}
    for f in os.listdir(ptx_dir):
        if not f.endswith(".ptx"):
            continue
        with open(os.path.join(ptx_dir, f)) as fh:
            text = fh.read()
        entries = list(PTX_ENTRY.finditer(text))
        for i, m in enumerate(entries):
            body = text[m.end():entries[i + 1].start() if i + 1 < len(entries) else len(text)]
            head = body[: body.find("{")] if "{" in body else body
            n = MAXNTID.search(head)
            threads = 0
            if n:
                threads = 1
                for g in n.groups():
                    threads *= int(g) if g else 1
            bounds[m.group(1)] = threads
    return bounds


def main():
    if len(sys.argv) < 4:
        print("usage: nvcc_resources.py OUT_DIR NVCC ARGS...", file=sys.stderr)
        return 2
    out_dir, cmd = sys.argv[1], sys.argv[2:]
    sources = [a for a in cmd if a.endswith(".cu")]
    keep = tempfile.mkdtemp(prefix="keel-nvcc-")
    try:
        proc = subprocess.run(cmd + ["-Xptxas=-v", "--keep", "--keep-dir", keep],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout)
        rows, entry, props, frames = [], None, None, {}
        for line in proc.stderr.splitlines():
            if not line.startswith("ptxas info") and not FRAME.search(line):
                print(line, file=sys.stderr)
                continue
            m = ENTRY.search(line)
            if m:
                entry = m.groups()
                continue
            m = PROPS.search(line)
            if m:
                props = m.group(1)
                continue
            m = FRAME.search(line)
            if m and props:
                frames[props] = m.groups()
                continue
            m = USED.search(line)
            if m and entry:
                rows.append((entry[0], entry[1], int(m.group(1)), int(m.group(2) or 0)))
                entry = None
        if proc.returncode != 0 or len(sources) != 1:
            return proc.returncode
        bounds = max_threads(keep)
    finally:
        shutil.rmtree(keep, ignore_errors=True)
    stem = os.path.splitext(os.path.basename(sources[0]))[0]
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, stem + ".tsv.tmp")
    with open(tmp, "w") as f:
        for (mangled, arch, regs, smem), d in zip(rows, demangle([r[0] for r in rows])):
            stack, st, ld = frames.get(mangled, ("0", "0", "0"))
            f.write("\t".join([short_name(d), stem, arch, str(regs), stack, st, ld, str(smem),
                               str(bounds.get(mangled, 0)), mangled]) + "\n")
    os.replace(tmp, os.path.join(out_dir, stem + ".tsv"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
