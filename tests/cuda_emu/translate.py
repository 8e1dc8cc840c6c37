#!/usr/bin/env python3
"""Rewrites a CUDA source of keel's backend into host C++ for the CUDA emulator (README.md here).

Only the three constructs a host compiler cannot parse change; every other line stays as written
(a #line directive keeps compiler messages pointing at the .cu file):
  kernel<...><<<grid, block, smem, stream>>>(args)  ->  ::keel_emu::launch(kernel<...>, "kernel",
                                                __FILE__, grid, block, smem, stream)(args)
  kernel<<<grid, block, smem, stream>>>(args)       ->  ::keel_emu::launch_deduced("kernel",
                      __FILE__, grid, block, smem, stream)([](auto... a) { kernel(a...); }, args)
(__FILE__ is the .cu, through the #line directive: the emulator finds the kernel's ptxas
resources by its source and name.)
  extern __shared__ T name[];                        ->  T* name = ::keel_emu::dynamic_shared_as<T>();
  __shared__ T a[32], b[4][4];                       ->  the block's static shared memory (emu.h)
  #include <cub/...>                                 ->  (dropped: tests/cuda_emu/emu.h has the sort)

Usage: translate.py IN.cu OUT.cc. Exits 2 with one line when a launch cannot be parsed.
"""
import re
import sys

# The kernel expression before <<<: a (qualified) name with optional template arguments.
LAUNCH = re.compile(r"([A-Za-z_][\w:]*)(\s*<[^<>;{}]*>)?(\s*)<<<(.*?)>>>(\s*)\(", re.S)
EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
# A static __shared__ declaration: a one-word type and one or more name[dims] declarators.
STATIC_SHARED = re.compile(
    r"__shared__\s+(?:__align__\(\s*(\d+)\s*\)\s+)?([\w:]+)\s+((?:\w+(?:\s*\[[^\]]+\])*\s*,?\s*)+);")
DECLARATOR = re.compile(r"(\w+)((?:\s*\[[^\]]+\])*)")
CUB_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<cub/[^>]*>.*$", re.M)


def translate(text, path):
    def launch(m):
        name, targs, cfg = m.group(1), m.group(2) or "", m.group(4)
        newlines = "\n" * (m.group(3) + m.group(5)).count("\n")
        if "<<<" in cfg:
            raise ValueError("nested <<< in a launch of " + name)
        # Keep the line count: newlines inside the configuration stay where they were.
        if targs:  # a kernel with its template arguments named: its address is known
            return "::keel_emu::launch(%s%s, \"%s\", __FILE__, %s)(%s" % (
                name, targs, name, cfg, newlines)
        # A plain name may be a template whose arguments the call deduces: call it from a generic
        # lambda, with the arguments as given.
        return "::keel_emu::launch_deduced(\"%s\", __FILE__, %s)([](auto... a) { %s(a...); }, %s" % (
            name, cfg, name, newlines)

    out, n = LAUNCH.subn(launch, text)
    if "<<<" in out:
        line = out[: out.index("<<<")].count("\n") + 1
        raise ValueError("%s:%d: a kernel launch the emulator cannot parse" % (path, line))
    out = EXTERN_SHARED.sub(r"\1* \2 = ::keel_emu::dynamic_shared_as<\1>();", out)

    # Static shared memory lives in the running block's area (poisoned with NaN for every block):
    # the tag, a static local, tells the declarations apart (one per template instantiation).
    def static_shared(m):
        align, ty, decls = m.group(1), m.group(2), m.group(3)
        align_arg = ", %s" % align if align else ""
        parts = []
        for d in DECLARATOR.finditer(decls):
            name, dims = d.group(1), re.sub(r"\s+", "", d.group(2))
            parts.append(
                "static char keel_emu_tag_%s; auto& %s = ::keel_emu::static_shared<%s%s%s>("
                "&keel_emu_tag_%s);" % (name, name, ty, dims, align_arg, name))
        return " ".join(parts)

    out = STATIC_SHARED.sub(static_shared, out)
    code = re.sub(r"//[^\n]*", "", out)  # comments go; line breaks stay
    leftover = re.search(r"\b__shared__\b", code)
    if leftover:
        line = code[: leftover.start()].count("\n")
        raise ValueError("%s:%d: a __shared__ declaration the emulator cannot parse" % (path, line))
    out = CUB_INCLUDE.sub("// (cub: tests/cuda_emu/emu.h)", out)
    return '#line 1 "%s"\n' % path + out, n


def main():
    if len(sys.argv) != 3:
        print("usage: translate.py IN.cu OUT.cc", file=sys.stderr)
        return 2
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    try:
        out, _ = translate(text, src)
    except ValueError as e:
        print("translate.py: %s" % e, file=sys.stderr)
        return 2
    with open(dst, "w") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
