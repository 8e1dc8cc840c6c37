#!/usr/bin/env bash
# tests/gpu/multi_gpu.sh: the multi-GPU checks, for a node with 2 or more GPUs (4 for TP2 x DP2)
# and mpirun, with keel built there (build/launch/keel-train). check.sh runs it when the machine
# qualifies; the lent single-GPU machine does not.
#   - layouts: a tiny job at TP2, DP2, DP2 + ZeRO-1, TP2 with sequence parallelism and TP2 x DP2
#     logs the losses of the same job on one GPU, step by step, within 1e-5 relative (fp32;
#     NCCL's and cuBLAS's sums differ from one GPU's by rounding only); with --device CUDA also
#     TP2 (with and without sequence parallelism) and DP2 in BF16 against one GPU in BF16 (the
#     bf16 TP wire, BF16's default, and the fp32 one; an OLMo 2-like block too), within
#     1e-4; TP2 with bf16 on the TP wire (parallel.tp_comm_dtype=BF16) in FP32 against one GPU's
#     (or the CPU's) fp32 run, within 1e-4;
#   - a rank killed at step 3 ends the job, with a line naming the collective that did not
#     complete, within parallel.timeout_s + 60 s (a bound on a hang, generous for a loaded
#     machine and the launcher, not a speed);
#   - a rank that stalls at step 3 ends the job through the watchdog (which aborts the NCCL
#     communicators first) within the same bound;
#   - a rank that throws at step 3 (an error on it alone) ends the job with its own message,
#     within the same bound.
# --device CPU runs the same checks on the CPU over MPI: tests/launch/multi_gpu_script_test keeps
# the script itself tested on machines without GPUs.
#
# --gpus N takes the node's GPU count as N instead of asking nvidia-smi: the CUDA emulator's
# ctest (tests/cuda_emu) runs the CUDA checks with its keel-train on emulated GPUs.
#
# usage: tests/gpu/multi_gpu.sh [--device CUDA|CPU] [--bin DIR (default build/launch)] [--gpus N]
# Exit: 0 every check passed, 1 a check failed, 77 skipped (no mpirun, or fewer than 2 GPUs).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

DEVICE=CUDA
BIN=build/launch
GPUS=
while (($#)); do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    *) echo "multi_gpu.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
  esac
done
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null; then
  echo "multi_gpu.sh: skipped: no $MPIRUN on this machine"
  exit 77
fi
if [[ ! -x "$BIN/keel-train" ]]; then
  echo "multi_gpu.sh: $BIN/keel-train not found (build keel here first)" >&2
  exit 1
fi
ranks=4
if [[ $DEVICE == CUDA ]]; then
  gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
  if ((gpus < 2)); then
    echo "multi_gpu.sh: skipped: $gpus GPU(s) on this machine (2 or more needed)"
    exit 77
  fi
  ((gpus < 4)) && ranks=2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tiny=(--set model.seq_len=32 --set model.d_model=64 --set model.n_layers=2 --set model.n_heads=4
  --set train.global_batch=8 --set train.steps=6 --set train.eval_every=0
  --set train.sample_chars=0 --set train.plot=false --set train.tensorboard=false
  --set train.log_every=1 --set data.builtin_bytes=60000 --set spike.enabled=false
  --set train.precision=FP32 --set "train.device=$DEVICE")
status=0

# run NP NAME ARGS...: keel-train on NP ranks into $work/NAME (log $work/NAME.log); sets $rc, $secs
run() {
  local np=$1 name=$2
  shift 2
  local t0=$SECONDS
  timeout -k 5 300 "$MPIRUN" -n "$np" --oversubscribe --bind-to none "$BIN/keel-train" \
    "${tiny[@]}" "$@" --run-dir "$work/$name" >"$work/$name.log" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
}

# losses RUN: "step loss" per line of RUN's metrics.jsonl
losses() {
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r: print(r["step"], repr(r["loss"]))' "$work/$1/metrics.jsonl"
}

verdict() {  # verdict NAME OK MESSAGE
  if (($2)); then
    echo "PASS $1: $3"
  else
    echo "FAIL $1: $3"
    tail -5 "$work/$1.log" | sed 's/^/    /'
    status=1
  fi
}

# compare NAME REF BOUND: NAME's 6 losses against REF's, each within BOUND (relative)
compare() {
  local name=$1 ref=$2 bound=$3 worst ok
  worst=$(python3 -c 'import sys
a = [l.split() for l in open(sys.argv[1])]
b = [l.split() for l in open(sys.argv[2])]
assert len(a) == len(b) == 6, (len(a), len(b))
print(max(abs(float(x[1]) - float(y[1])) / abs(float(y[1])) for x, y in zip(a, b)))' \
    <(losses "$name") <(losses "$ref") 2>&1)
  ok=$(python3 -c "import sys; print(int(float(sys.argv[1]) <= float(sys.argv[2])))" "$worst" \
    "$bound" 2>/dev/null || echo 0)
  verdict "$name" "$ok" "6 steps' losses within $bound of $ref (worst $worst)"
}

# layouts REF BOUND LAYOUT...: runs each "NP NAME --set ..." layout and compares it with REF
layouts() {
  local ref=$1 bound=$2 l np name extra
  shift 2
  for l in "$@"; do
    read -r np name extra <<<"$l"
    # shellcheck disable=SC2086  # extra holds whole --set words
    run "$np" "$name" $extra
    if ((rc != 0)); then
      verdict "$name" 0 "exit $rc"
      continue
    fi
    compare "$name" "$ref" "$bound"
  done
}

run 1 one
verdict one "rc == 0" "1 rank on $DEVICE (exit $rc, ${secs}s)"
fp32=("2 tp2 --set parallel.tp=2" "2 dp2" "2 dp2_zero1 --set parallel.zero_stage=1"
  "2 tp2_sp --set parallel.tp=2 --set parallel.sequence_parallel=true")
# TP2 x DP2 with buckets of a few parameters, so DP buckets reduce while backward's TP
# all-reduces run: the emulated NCCL fails a collective that starts while the other
# communicator's is in flight unordered (Note [nccl launch order] in parallel/nccl_communicator.h).
((ranks >= 4)) && fp32+=("4 tp2xdp2 --set parallel.tp=2 --set parallel.bucket_mb=0.01")
layouts one 1e-5 "${fp32[@]}"
# Sequence parallelism (Note [sequence parallel] in layers/gpt.h): keel-train's banner says so.
verdict tp2_sp "$(grep -c 'sequence parallel (TP all-gathers' "$work/tp2_sp.log")" \
  "keel-train's banner names sequence parallelism"
# bf16 on the TP wire (parallel.tp_comm_dtype=BF16, Note [bf16 wire]): the TP all-reduces round
# activations and gradients to bf16, so TP2 tracks one rank's fp32 run to bf16 rounding, not 1e-5
# (measured: 5.2e-6 on the CPU, 4.9e-6 on 4 emulated GPUs); keel-train's banner says which wire
# the TP all-reduces use.
layouts one 1e-4 "2 tp2_bf16_wire --set parallel.tp=2 --set parallel.tp_comm_dtype=BF16"
verdict tp2_bf16_wire "$(grep -c 'TP all-reduces in BF16' "$work/tp2_bf16_wire.log")" \
  "keel-train's banner names the bf16 TP wire"
if [[ $DEVICE == CUDA ]]; then
  # BF16, the GPU's default precision: TP2 and DP2 against one GPU in BF16. The ranks round the
  # same values to bf16; fp32 sums in another order can flip a rounding, and TP2's all-reduces
  # move bf16, hence a looser bound (on 4 emulated GPUs: 1.8e-5 for TP2, 1.4e-5 with the fp32
  # wire, 1.3e-5 for the OLMo 2-like block, 9.7e-6 for DP2). keel-train names the attention path it
  # took (cuDNN's fused SDPA, or keel's kernel and why) after the first step.
  run 1 one_bf16 --set train.precision=BF16
  attention=$(grep -o "keel-train: attention: .*" "$work/one_bf16.log" | head -1)
  verdict one_bf16 "rc == 0 && ${#attention} > 0" \
    "1 rank on CUDA in BF16 (exit $rc, ${secs}s; ${attention:-no attention line})"
  # TP2 in BF16 moves bf16 on the TP wire by default (parallel.tp_comm_dtype=AUTO: the projections
  # write bf16, NCCL sums it, the residual adds read it); tp2_bf16_fp32_wire keeps fp32.
  layouts one_bf16 1e-4 "2 tp2_bf16 --set parallel.tp=2 --set train.precision=BF16" \
    "2 dp2_bf16 --set train.precision=BF16" \
    "2 tp2_bf16_sp --set parallel.tp=2 --set train.precision=BF16 --set parallel.sequence_parallel=true" \
    "2 tp2_bf16_fp32_wire --set parallel.tp=2 --set train.precision=BF16 --set parallel.tp_comm_dtype=FP32"
  verdict tp2_bf16 "$(grep -c 'TP all-reduces in BF16' "$work/tp2_bf16.log")" \
    "keel-train's banner names the bf16 TP wire, BF16's default"
  # An OLMo 2-like block (SwiGLU, norms after each sublayer, no biases), whose sublayer outputs
  # feed norms and whose MLP input gradient sums two projections: the bf16 wire rounds fp32
  # buffers there instead of the projections writing bf16.
  olmo=(--set model.mlp=SWIGLU --set model.norm_placement=POST_SUBLAYER --set model.bias=false
    --set model.position=ROPE --set train.precision=BF16)
  run 1 one_bf16_olmo "${olmo[@]}"
  verdict one_bf16_olmo "rc == 0" "1 rank on CUDA in BF16, OLMo 2-like block (exit $rc, ${secs}s)"
  layouts one_bf16_olmo 1e-4 "2 tp2_bf16_olmo --set parallel.tp=2 ${olmo[*]}"
fi

# fault NAME LINE MESSAGE ARGS...: a TP2 job whose rank 1 meets a fault at step 3 (ARGS say which)
# must fail, print LINE (a grep pattern) and end within parallel.timeout_s + 60 s: a bound on a
# hang, generous for a loaded machine and the launcher, not a speed.
timeout_s=5
fault() {
  local name=$1 line=$2 message=$3 named
  shift 3
  run 2 "$name" --set parallel.tp=2 --set train.steps=50 --set debug.kill_rank=1 \
    --set debug.kill_at_step=3 --set parallel.timeout_s=$timeout_s "$@"
  grep -q "$line" "$work/$name.log"
  named=$?
  verdict "$name" "rc != 0 && named == 0 && secs <= timeout_s + 60" \
    "$message (exit $rc, ${secs}s, its line printed: $((named == 0)))"
}

fault killed "did not complete" "a rank killed at step 3 ends the job, the collective named"
fault stalled "did not complete within parallel.timeout_s=$timeout_s" \
  "a rank stalled at step 3 ends the job through the watchdog" --set debug.fault=STALL
# One rank fails alone (an internal error at step 3 while its peer is inside a TP collective): its
# communicators are aborted, not destroyed (NCCL's destroy waits for the node's other ranks), so
# it prints its own error and ends the job, rather than waiting behind the peer's watchdog.
fault failing "rank 1: internal error: debug.kill_rank=1: injected error at step 3" \
  "a rank failing alone at step 3 ends the job with its own error" --set debug.fault=THROW

echo "multi_gpu.sh: $( ((status == 0)) && echo PASS || echo FAIL) on $DEVICE"
exit $status
