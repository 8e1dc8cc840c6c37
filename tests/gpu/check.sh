#!/usr/bin/env bash
# tests/gpu/check.sh: the GPU check, run on a GPU machine from a copy of the repository that
# carries build-gpu/pack.tar.gz (made here by tests/gpu/pack.sh). Points the loader at the pack
# and at the CUDA pip wheels' libraries, prints the GPU and library versions, runs the CUDA backend's
# tests against the CPU kernels (and whole training steps against the CPU), then the GEMM
# benchmark and the training benchmark (keel-bench's GPU configs: tokens/s, TFLOP/s, MFU, the
# per-op device time), requiring that attention took cuDNN's fused SDPA, and the 124M config's
# per-kernel device time from CUPTI beside the emulator's roofline estimate (docs/gpu.md; a
# diagnostic: a pack without CUPTI says so in a line, and no result here fails the check); then compute-sanitizer
# (memcheck, racecheck, synccheck) over a few kernel tests when the machine has it, and last the
# 200-step default-job comparisons with the time left. The benchmarks run before the long tests
# so that they always run. Every step is under `timeout` and the whole check ends within ~340 s.
# Output also goes to $OUT/gpu_check.log when $OUT is set.
#
# Exit: 0 when the tests pass (or skip on a machine without a GPU), the benchmark ran with
# cuDNN's attention and the sanitizers (where installed) found nothing; 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PACK=${KEEL_GPU_PACK:-build-gpu/pack}
# The pack travels compressed (tests/gpu/pack.sh: build-gpu/pack.tar.gz; the device machine takes
# 64 MiB of carried files with the working tree, and the pack itself is about 57 MiB): unpack it
# into a temporary folder when only the archive is here.
if [[ ! -x "$PACK/keel_gpu_tests" && -z "${KEEL_GPU_PACK:-}" && -f build-gpu/pack.tar.gz ]]; then
  unpacked=$(mktemp -d)
  trap 'rm -rf "$unpacked"' EXIT
  if tar -C "$unpacked" -xzf build-gpu/pack.tar.gz; then
    PACK="$unpacked/pack"
  else
    echo "check.sh: could not unpack build-gpu/pack.tar.gz" >&2
  fi
fi
LOG=/dev/null
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT" && LOG="$OUT/gpu_check.log"
fi
DEADLINE=340 # seconds from the start for everything (the issue: under 6 minutes)

# min(want, time left before the deadline minus `reserve` for later steps), at least 5
budget() {
  local want=$1 reserve=$2
  local left=$((DEADLINE - SECONDS - reserve))
  ((left < want)) && want=$left
  ((want < 5)) && want=5
  echo "$want"
}

# Library directories of the NVIDIA pip wheels (nvidia/<lib>/lib and nvidia/cu13/lib layouts).
wheel_lib_dirs() {
  local py
  py=$(command -v python3 || true)
  [[ -z "$py" && -x /opt/torch/.venv/bin/python3 ]] && py=/opt/torch/.venv/bin/python3
  if [[ -n "$py" ]]; then
    timeout 30 "$py" - <<'EOF' || echo "check.sh: wheel discovery with $py failed" >&2
import glob, os, sys
roots = []
try:
    import nvidia
    roots += [p for p in nvidia.__path__]
except Exception as e:
    print("check.sh: import nvidia failed: %s" % e, file=sys.stderr)
for p in sys.path:  # namespace packages can hide a root; also look in every site directory
    r = os.path.join(p, "nvidia")
    if os.path.isdir(r) and r not in roots:
        roots.append(r)
dirs = []
for r in roots:
    for pat in ("*/lib", "*/lib64", "cu13/lib", "cu*/lib"):
        for d in sorted(glob.glob(os.path.join(r, pat))):
            if os.path.isdir(d) and d not in dirs and glob.glob(os.path.join(d, "*.so*")):
                dirs.append(d)
print(":".join(dirs))
EOF
  fi
}

# Directories holding `lib` under any site-packages/nvidia (the fallback when Python cannot say).
find_wheel_libs() {
  timeout 30 find / -xdev -path '*/nvidia/*' \( -name 'libcudart.so.1*' -o -name 'libcublasLt.so.1*' \
    -o -name 'libcudnn.so.9*' -o -name 'libnccl.so.2*' \) 2>/dev/null | xargs -r -n1 dirname |
    sort -u | paste -sd: -
}

# compute-sanitizer's memcheck, racecheck and synccheck over a few kernel tests (out-of-bounds
# and misaligned accesses, shared-memory races, illegal barriers), each within its budget, when
# the machine has the tool (the CUDA toolkit's, not in the pip wheels). Sets sanitize_status: 1
# when a tool reported an error. Uses ldpath and PACK from main.
sanitize_status=0
sanitize() {
  echo "== compute-sanitizer"
  local tool_bin
  tool_bin=$(command -v compute-sanitizer || true)
  [[ -z "$tool_bin" && -x /usr/local/cuda/bin/compute-sanitizer ]] &&
    tool_bin=/usr/local/cuda/bin/compute-sanitizer
  if [[ -z "$tool_bin" ]]; then
    echo "not installed here (the CUDA toolkit's compute-sanitizer): skipped"
    return
  fi
  # Small shapes: the sanitizers slow kernels by 10-100x.
  local filter='OpsTest.*:LayerKernelsTest.*:AttentionTest.*:NormBf16Test.*'
  local tool rc
  for tool in memcheck racecheck synccheck; do
    if ((DEADLINE - SECONDS < 45)); then
      echo "$tool: not run ($((DEADLINE - SECONDS)) s left)"
      continue
    fi
    LD_LIBRARY_PATH="$ldpath" timeout -k 5 "$(budget 30 20)" "$tool_bin" --tool "$tool" \
      --error-exitcode 3 --print-limit 20 "$PACK/keel_gpu_tests" --gtest_brief=1 \
      --gtest_filter="$filter" 2>&1 | tail -25
    rc=${PIPESTATUS[0]}
    case $rc in
      0) echo "$tool: clean" ;;
      124) echo "$tool: timed out (not a finding; the tests ran under it until the budget)" ;;
      3) echo "FAIL: $tool reported errors" && sanitize_status=1 ;;
      *) echo "FAIL: $tool: exit $rc" && sanitize_status=1 ;;
    esac
  done
}

# The per-kernel device time of the 124M config from CUPTI's activity records
# (keel-gpu-train-bench --kernel-table, 3 steps after 2 of warm-up) and beside it the emulator's
# roofline estimate of docs/gpu.md (tests/gpu/kernel_table.py; README.md says how to read it).
# Diagnostic: a pack built without CUPTI, libcupti missing, no Python or a failure of the run is
# one line (the run's tail for a failure) and never fails the check. Uses ldpath and PACK from
# main; KEEL_KERNEL_TABLE_TIMEOUT_S caps its run (default 45 s, less when the deadline is near).
kernel_table() {
  echo "== per-kernel device time (CUPTI) beside the roofline estimate (docs/gpu.md)"
  if ((DEADLINE - SECONDS < 50)); then
    echo "kernel table: not run ($((DEADLINE - SECONDS)) s left)"
    return
  fi
  local out rc py
  out=$(mktemp)
  LD_LIBRARY_PATH="$ldpath" timeout -k 5 "$(budget "${KEEL_KERNEL_TABLE_TIMEOUT_S:-45}" 40)" \
    "$PACK/keel-gpu-train-bench" --config 124M --kernel-table --steps 3 --warmup 2 >"$out" 2>&1
  rc=$?
  if grep -q 'has no CUPTI' "$out"; then
    echo "kernel table: skipped, the pack's keel-gpu-train-bench has no CUPTI (libcupti was not" \
      "found where pack.sh built it)"
  elif grep -q 'libcupti.*cannot open shared object' "$out"; then
    echo "kernel table: skipped, libcupti is not in the pack or the wheels here"
  elif ((rc != 0)); then
    echo "kernel table: keel-gpu-train-bench --kernel-table: exit $rc$( ((rc == 124)) &&
      echo ' (timed out)') (not counted as a failure); its last lines:"
    tail -15 "$out"
  else
    grep -v '^keel-gpu-train-bench: ' "$out"
    py=$(command -v python3 || true)
    [[ -z "$py" && -x /opt/torch/.venv/bin/python3 ]] && py=/opt/torch/.venv/bin/python3
    if [[ -z "$py" ]]; then
      echo "kernel table: no python3 here for the comparison with the estimate"
    else
      timeout 30 "$py" tests/gpu/kernel_table.py docs/gpu.md "$out" --config 124M ||
        echo "kernel table: the comparison with the estimate failed (not counted as a failure)"
    fi
  fi
  rm -f "$out"
}

main() {
  echo "== keel GPU check: $(date -u +%FT%TZ) on $(hostname) ($(uname -m)), pack $PACK"
  [[ -f "$PACK/MANIFEST.txt" ]] && cat "$PACK/MANIFEST.txt"
  if [[ ! -x "$PACK/keel_gpu_tests" ]]; then
    echo "FAIL: $PACK/keel_gpu_tests missing (run tests/gpu/pack.sh and carry" \
      "build-gpu/pack.tar.gz)"
    return 1
  fi
  echo "== machine"
  ldd --version 2>&1 | head -1
  local gpus=0
  if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi -L
    gpus=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
      --format=csv
  else
    echo "nvidia-smi: not installed"
  fi
  echo "GPUs listed by nvidia-smi: $gpus"

  echo "== libraries"
  local wheels
  wheels=$(wheel_lib_dirs)
  if [[ -z "$wheels" ]]; then
    echo "no wheel directories from Python; searching the file system"
    wheels=$(find_wheel_libs)
  fi
  echo "wheel library directories:"
  tr ':' '\n' <<<"$wheels" | sed 's/^/  /'
  local ldpath="$PACK${wheels:+:$wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The machine's own C++ runtime when it serves the binaries; else the pack's (gcc/).
  if LD_LIBRARY_PATH="$ldpath" timeout 20 ldd "$PACK/keel_gpu_tests" 2>&1 |
    grep -qE "GLIBCXX|CXXABI|GCC_[0-9]|libstdc\+\+.*not found|libgcc_s.*not found"; then
    echo "the system libstdc++/libgcc_s do not serve the binaries: using $PACK/gcc"
    ldpath="$PACK/gcc:$ldpath"
  else
    echo "using the system libstdc++ and libgcc_s"
  fi
  # libcudnn.so.9: cuDNN fused attention, in builds with the cuDNN frontend (MANIFEST.txt's needs);
  # libnvrtc.so.13: cuDNN compiles its SDPA engines at run time with NVRTC (the
  # nvidia-cuda-nvrtc wheel); without it every SDPA graph fails to build and attention falls back
  # to keel's kernel, which the benchmark's attention check below turns into a failure.
  for lib in libcudart.so.13 libcublasLt.so.13 libcudnn.so.9 libnccl.so.2 libnvrtc.so.13; do
    local hit=""
    for d in ${ldpath//:/ }; do [[ -e "$d/$lib" ]] && hit="$d/$lib" && break; done
    echo "  $lib: ${hit:-NOT FOUND in the pack or the wheels}"
  done
  for b in keel_gpu_tests keel-gpu-gemm-bench keel-gpu-train-bench cuda_backend_test; do
    local missing
    missing=$(LD_LIBRARY_PATH="$ldpath" timeout 20 ldd "$PACK/$b" 2>&1 | grep 'not found')
    if [[ -n "$missing" ]]; then
      echo "  $b: unresolved libraries:"
      echo "$missing"
    else
      echo "  $b: all libraries resolved"
    fi
  done
  LD_LIBRARY_PATH="$ldpath" timeout 20 ldd "$PACK/keel_gpu_tests" | grep -E 'cudart|cublas' |
    sed 's/^/  /'

  local status=0 rc
  echo "== cuda_backend_test (host side)"
  LD_LIBRARY_PATH="$ldpath" timeout -k 5 30 "$PACK/cuda_backend_test" \
    --gtest_brief=1
  rc=$?
  echo "cuda_backend_test: exit $rc"
  ((rc != 0)) && status=1

  echo "== keel_gpu_tests (CUDA kernels and training steps against the CPU)"
  local json=() json_job=()
  [[ -n "${OUT:-}" ]] && json=(--gtest_output="json:$OUT/gpu_tests.json")
  [[ -n "${OUT:-}" ]] && json_job=(--gtest_output="json:$OUT/gpu_default_job.json")
  local out
  out=$(mktemp)
  # The 200-step default-job comparisons run last, after the benchmarks and the sanitizers, with
  # the time left, so their time (a CPU run on every core plus two GPU runs) cannot cost the
  # kernel tests their results or the benchmarks their run.
  LD_LIBRARY_PATH="$ldpath" timeout -k 10 "$(budget 110 170)" "$PACK/keel_gpu_tests" \
    --gtest_brief=1 --gtest_filter='-*DefaultJob*' "${json[@]}" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  echo "keel_gpu_tests (all but the default job): exit $rc$( ((rc == 124)) && echo ' (timed out)')"
  if ((rc != 0)); then
    status=1
    # A fault in one kernel poisons the process for the tests after it: rerun each failed test
    # alone, synchronising after every launch, so each reports its own first error.
    local failed
    failed=$(grep -o '^\[  FAILED  \] [A-Za-z0-9_/]*\.[A-Za-z0-9_/]*' "$out" | awk '{print $4}' |
      sort -u)
    for t in $failed; do
      # 35 s a rerun, and the two benchmarks' 100 s after them
      ((DEADLINE - SECONDS < 140)) && { echo "(no time left for more reruns)"; break; }
      echo "-- rerun alone with KEEL_CUDA_SYNC_CHECK=1: $t"
      LD_LIBRARY_PATH="$ldpath" KEEL_CUDA_SYNC_CHECK=1 timeout -k 5 30 "$PACK/keel_gpu_tests" \
        --gtest_filter="$t" 2>&1 | grep -vE '^\[ *(RUN|OK|----------|==========) *\]|^$' |
        head -40
    done
  fi
  rm -f "$out"

  echo "== keel-gpu-gemm-bench"
  LD_LIBRARY_PATH="$ldpath" timeout -k 5 "$(budget 30 110)" "$PACK/keel-gpu-gemm-bench" --quick
  rc=$?
  echo "keel-gpu-gemm-bench: exit $rc"
  if ((rc == 77)); then
    if ((gpus > 0)); then
      echo "FAIL: nvidia-smi lists $gpus GPU(s) but the CUDA runtime finds none"
      status=1
    else
      echo "no GPU on this machine: GPU tests and benchmark skipped"
    fi
  elif ((rc != 0)); then
    status=1
  fi

  if ((rc != 77)); then
    echo "== keel-gpu-train-bench (keel-bench's GPU configs in BF16; MFU against the bf16 peak)"
    local bench
    bench=$(mktemp)
    LD_LIBRARY_PATH="$ldpath" timeout -k 5 "$(budget 70 40)" "$PACK/keel-gpu-train-bench" --nccl \
      --profile --steps 5 --warmup 2 2>&1 | tee "$bench"
    rc=${PIPESTATUS[0]}
    echo "keel-gpu-train-bench: exit $rc$( ((rc == 124)) && echo ' (timed out)')"
    ((rc != 0)) && status=1
    # The attention path each config took (its line ends "attention: ..."): anything but cuDNN's
    # fused SDPA (or keel's kernel in an FP32 config, which cuDNN's bf16 graphs do not serve)
    # means the GPU runs keel's fallback kernel, several times slower, and the reason (often
    # NVRTC missing, see the libraries above) is in the line.
    echo "attention paths taken:"
    grep -o 'attention: .*' "$bench" | sed 's/)$//' | sort | uniq -c
    local other
    other=$(grep '^config .*attention: ' "$bench" | grep -v 'attention: cuDNN fused SDPA' |
      grep -v "attention: fp32 (keel's fused attention)")
    if [[ -n "$other" ]] || ! grep -q 'attention: cuDNN fused SDPA' "$bench"; then
      echo "FAIL: attention did not take cuDNN's fused SDPA in every BF16 config (see the lines" \
        "above; keel's kernel is the fallback, not the GPU path)"
      status=1
    fi
    # MFU against the datasheet's dense BF16 peak (989 TFLOP/s for an H100/H200 SXM, as llm.c
    # quotes it) beside the benchmark's own, against the cuBLASLt peak it measured.
    awk '/^config=/ {
      delete v
      for (i = 1; i <= NF; i++) { n = index($i, "="); v[substr($i, 1, n - 1)] = substr($i, n + 1) }
      printf "  config %s (%s): %.1f TFLOP/s, MFU %.1f%% of the datasheet 989 TFLOP/s, %.1f%% of the measured peak %.0f TFLOP/s\n",
        v["config"], v["precision"], v["gflops"] / 1e3, 100 * v["gflops"] / 989e3,
        100 * v["peak_fraction"], v["peak_gflops"] / 1e3
    }' "$bench"
    rm -f "$bench"
    kernel_table
    sanitize
    ((sanitize_status != 0)) && status=1
  fi

  echo "== keel_gpu_tests: the 200-step default-job comparisons (the time left)"
  if ((DEADLINE - SECONDS < 20)); then
    echo "not run: $((DEADLINE - SECONDS)) s left before the ${DEADLINE} s deadline"
  else
    local rc_job
    LD_LIBRARY_PATH="$ldpath" timeout -k 10 "$(budget 100 0)" "$PACK/keel_gpu_tests" \
      --gtest_brief=1 --gtest_filter='*DefaultJob*' "${json_job[@]}" 2>&1
    rc_job=$?
    echo "keel_gpu_tests (default job): exit $rc_job$( ((rc_job == 124)) && echo ' (timed out)')"
    ((rc_job != 0)) && status=1
  fi
  echo "== multi-GPU checks (tests/gpu/multi_gpu.sh)"
  if ((gpus < 2)); then
    echo "skipped: $gpus GPU(s) here; run tests/gpu/multi_gpu.sh on a node with 2 or more GPUs"
  elif ! command -v mpirun >/dev/null || [[ ! -x build/launch/keel-train ]]; then
    echo "skipped: needs mpirun and keel built on this machine (build/launch/keel-train)"
  else
    # A node with several GPUs is not the lent machine, whose 6 minutes the deadline is for: the
    # multi-GPU checks (about 20 short jobs) get their own budget.
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      timeout -k 5 "${KEEL_MULTI_GPU_TIMEOUT_S:-1200}" tests/gpu/multi_gpu.sh --device CUDA
    rc=$?
    ((rc != 0 && rc != 77)) && status=1
  fi
  echo "== GPU check done in ${SECONDS}s: $( ((status == 0)) && echo PASS || echo FAIL)"
  return $status
}

# Sourced (tests/gpu/check_kernel_table_test.sh), it only defines its functions.
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0
main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
