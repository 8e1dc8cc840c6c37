#!/usr/bin/env bash
# tests/gpu/check_kernel_table_test.sh [EMU_BENCH]: check.sh's kernel-table step (its function
# kernel_table, check.sh sourced) without a GPU, against stand-in benchmarks in a stand-in pack:
# one printing a --kernel-table output (the comparison with docs/gpu.md's estimate follows it),
# one that cannot load libcupti, one failing, and with EMU_BENCH (keel-gpu-train-bench-emu, which
# has no CUPTI) the real refusal; each must end in its one line and none may touch check.sh's
# status. Also: with the deadline near the step does not run. ctest cuda.check_kernel_table.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
emu_bench=${1:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export KEEL_GPU_PACK="$tmp/pack" OUT=
mkdir -p "$tmp/pack"
# shellcheck source=check.sh
source "$here/check.sh" || exit 1
set +e
ldpath=""
status=0
fails=0

# run_case NAME BENCH_BODY PATTERN...: kernel_table's output must match every PATTERN (grep -E).
run_case() {
  local name=$1 body=$2
  shift 2
  printf '#!/usr/bin/env bash\n%s\n' "$body" >"$PACK/keel-gpu-train-bench"
  chmod +x "$PACK/keel-gpu-train-bench"
  local got
  got=$(kernel_table 2>&1)
  for pattern in "$@"; do
    if ! grep -qE -- "$pattern" <<<"$got"; then
      echo "FAIL: $name: no line matching: $pattern"
      echo "$got" | sed 's/^/  | /'
      fails=$((fails + 1))
      return
    fi
  done
  echo "ok: $name"
}

synthetic="$tmp/synthetic.txt"
python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import kernel_table
sys.stdout.write(kernel_table.SYNTHETIC)' "$here" >"$synthetic" || exit 1

run_case "a table, then the comparison" \
  "[[ \" \$* \" == *' --config 124M --kernel-table '* ]] || { echo bad args: \$*; exit 9; }
cat '$synthetic'" \
  '^config 124M: per-kernel device time from CUPTI' \
  '^config 124M: measured device time per step \(CUPTI, 3 steps\) beside the roofline estimate' \
  '^  cublasLtMatmul +12\.282 +15\.000 +1\.22x$' \
  '^  total +23\.758 +22\.000 +0\.93x$' \
  'measured step 25\.000 ms \(wall\) 56\.6%$'
run_case "libcupti missing" \
  "echo 'keel-gpu-train-bench: error while loading shared libraries: libcupti.so.13: cannot open shared object file: No such file or directory' >&2; exit 127" \
  '^kernel table: skipped, libcupti is not in the pack or the wheels here$'
run_case "a failing run" "echo 'keel-gpu-train-bench: internal: CUPTI: cuptiActivityEnable(kind) failed: x'; exit 1" \
  '^kernel table: keel-gpu-train-bench --kernel-table: exit 1 \(not counted as a failure\)' \
  'CUPTI: cuptiActivityEnable\(kind\) failed'
run_case "no table for the config" "echo 'config 350M: nothing'" \
  '^kernel_table.py: no kernel table for config 124M' \
  '^kernel table: the comparison with the estimate failed \(not counted as a failure\)$'
if [[ -n "$emu_bench" ]]; then
  run_case "the emulator's build (no CUPTI)" "exec '$emu_bench' \"\$@\"" \
    "^kernel table: skipped, the pack's keel-gpu-train-bench has no CUPTI"
fi
saved=$DEADLINE
DEADLINE=$((SECONDS + 20))
run_case "the deadline near" "exit 5" '^kernel table: not run \([0-9]+ s left\)$'
DEADLINE=$saved
if ((status != 0)); then
  echo "FAIL: kernel_table changed check.sh's status to $status"
  fails=$((fails + 1))
fi
echo "check_kernel_table_test: $( ((fails == 0)) && echo PASS || echo "FAIL ($fails)")"
((fails == 0))
