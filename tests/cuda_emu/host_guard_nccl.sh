#!/usr/bin/env bash
# tests/cuda_emu/host_guard_nccl.sh: keel-train on 2 emulated GPUs under the emulator's host guard
# (tests/cuda_emu/host_guard.h; ctest cuda_emu.host_guard_nccl): TP2 with sequence parallelism
# (NCCL all-reduces, all-gathers and reduce-scatters of activations) and DP2 with ZeRO-1 (the
# gradient reduce-scatter and the parameter all-gather), every device allocation closed to host
# code and the emulated NCCL staging its buffers through host copies. A host dereference of device
# memory on either path ends a rank with the guard's line; the two layouts' losses must also agree
# step by step (each matches one GPU's within 1e-5 in tests/gpu/multi_gpu.sh), so the staged
# collectives moved the right data.
#
# usage: tests/cuda_emu/host_guard_nccl.sh --bin DIR (the emulator's keel-train); MPIRUN names
# mpiexec. Exit: 0 passed, 1 failed, 77 skipped (no mpiexec).
set -u
BIN=
while (($#)); do
  case $1 in
    --bin) BIN=$2; shift 2 ;;
    *) echo "host_guard_nccl.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
MPIRUN=${MPIRUN:-mpiexec}
if ! command -v "$MPIRUN" >/dev/null; then
  echo "host_guard_nccl.sh: skipped: no $MPIRUN"
  exit 77
fi
export KEEL_CUDA_EMU_HOST_GUARD=1 KEEL_CUDA_EMU_DEVICES=2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tiny=(--set model.seq_len=32 --set model.d_model=64 --set model.n_layers=2 --set model.n_heads=4
  --set train.global_batch=8 --set train.steps=4 --set train.eval_every=0
  --set train.sample_chars=0 --set train.plot=false --set train.tensorboard=false
  --set train.log_every=1 --set data.builtin_bytes=60000 --set spike.enabled=false
  --set train.precision=FP32 --set train.device=CUDA)
status=0
for layout in "tp2_sp --set parallel.tp=2 --set parallel.sequence_parallel=true" \
  "dp2_zero1 --set parallel.zero_stage=1"; do
  read -r name extra <<<"$layout"
  # shellcheck disable=SC2086  # extra holds whole --set words
  timeout -k 5 120 "$MPIRUN" -n 2 --oversubscribe --bind-to none "$BIN/keel-train" "${tiny[@]}" \
    $extra --run-dir "$work/$name" >"$work/$name.log" 2>&1
  rc=$?
  if ((rc != 0)) || grep -q "of device memory" "$work/$name.log"; then
    echo "FAIL $name: exit $rc"
    grep -m1 "keel cuda emulator" "$work/$name.log" || tail -5 "$work/$name.log"
    status=1
  else
    echo "PASS $name: 4 steps under the host guard"
  fi
done
if ((status == 0)); then
  worst=$(python3 -c 'import json, sys
def losses(p):
    return [r["loss"] for r in map(json.loads, open(p)) if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == len(b) == 4, (len(a), len(b))
print(max(abs(x - y) / abs(y) for x, y in zip(a, b)))' \
    "$work/tp2_sp/metrics.jsonl" "$work/dp2_zero1/metrics.jsonl" 2>&1)
  if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 2e-5 else 1)" "$worst" \
    2>/dev/null; then
    echo "PASS losses: tp2_sp and dp2_zero1 agree within 2e-5 (worst $worst)"
  else
    echo "FAIL losses: tp2_sp and dp2_zero1 differ by $worst (bound 2e-5)"
    status=1
  fi
fi
((status == 0)) && echo "host_guard_nccl.sh: PASS"
exit $status
