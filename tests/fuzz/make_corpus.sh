#!/usr/bin/env bash
# tests/fuzz/make_corpus.sh: remakes the seed corpora under tests/fuzz/corpus/ from keel's own
# output, and the config dictionary from keel.proto. Seeds: the preset configs
# (launch/configs), a tiny run's config.pbtxt and a --set list, the manifests of a tiny
# checkpoint written by one process and by two (tensor parallel, so slices), their exports
# (model.safetensors, keel and GPT-2 names), and small llm.c shards. Needs build/launch/keel-train
# and keel-ckpt (tests/run builds them). Regression inputs (corpus/*/regression-*) are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=build/launch
corpus=tests/fuzz/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

for h in config_fuzz manifest_fuzz shard_fuzz safetensors_fuzz; do
  mkdir -p "$corpus/$h"
  find "$corpus/$h" -type f ! -name 'regression-*' -delete
done

tiny=(--set model.d_model=8 --set model.n_layers=1 --set model.n_heads=2 --set model.d_ff=16
  --set model.seq_len=16 --set train.global_batch=2 --set train.steps=2 --set checkpoint.every=2
  --set data.builtin_bytes=20000 --set train.eval_every=0 --set train.plot=false
  --set train.sample_chars=0)
"$bin/keel-train" "${tiny[@]}" --run-dir "$tmp/one" >/dev/null
mpiexec -n 2 --oversubscribe "$bin/keel-train" "${tiny[@]}" --set parallel.tp=2 \
  --set model.qk_norm=NONE --run-dir "$tmp/tp2" >/dev/null
"$bin/keel-ckpt" export "$tmp/one/checkpoints/step_00000002" "$tmp/one_export" >/dev/null
"$bin/keel-ckpt" export "$tmp/tp2/checkpoints/step_00000002" "$tmp/tp2_export" >/dev/null

# config: the presets, a run's full config.pbtxt (every field), the issue's tiny model as --set
for f in launch/configs/*.pbtxt; do cp "$f" "$corpus/config_fuzz/preset-$(basename "$f")"; done
cp "$tmp/one/config.pbtxt" "$corpus/config_fuzz/run-config.pbtxt"
{
  echo "model { qk_norm: L2 }"
  for s in model.d_model=64 model.n_layers=2 model.n_heads=4 model.d_ff=256 model.seq_len=64 \
    train.global_batch=8 checkpoint.every=5 data.path=/data/fineweb_train_*.bin; do
    echo "--set $s"
  done
} >"$corpus/config_fuzz/sets.txt"

cp "$tmp/one/checkpoints/step_00000002/manifest.pb" "$corpus/manifest_fuzz/one-process.pb"
cp "$tmp/tp2/checkpoints/step_00000002/manifest.pb" "$corpus/manifest_fuzz/tp2.pb"
cp "$tmp/one_export/model.safetensors" "$corpus/safetensors_fuzz/keel-names.safetensors"
cp "$tmp/tp2_export/model.safetensors" "$corpus/safetensors_fuzz/gpt2-names.safetensors"

# shards: llm.c's layouts (int32 header[256] = {20240520, 1, n}, then n uint16 tokens; or
# {20240801, 7, n}, then n uint32 tokens)
python3 - "$corpus/shard_fuzz" <<'PY'
import struct, sys
out = sys.argv[1]
def shard(name, tokens, u32=False):
    header = [20240801, 7] if u32 else [20240520, 1]
    header += [len(tokens)] + [0] * 253
    with open(f"{out}/{name}", "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}{'I' if u32 else 'H'}", *tokens))
shard("one-token.bin", [7])
shard("ramp.bin", list(range(0, 50257, 997)))
shard("last-of-vocab.bin", [50256, 0, 50256, 1])
shard("u32-ramp.bin", list(range(0, 50257, 1999)), u32=True)
shard("u32-last-of-vocab.bin", [50256, 0, 50256, 1], u32=True)
shard("u32-out-of-vocab.bin", [3, 65536 + 7], u32=True)
PY

# The config dictionary: every section and field name (from the run's config.pbtxt, which
# prints every field) and every enum value name of keel.proto.
{
  echo '# written by tests/fuzz/make_corpus.sh from a run'"'"'s config.pbtxt and keel.proto'
  {
    grep -oE '^\s*[a-z_0-9]+' "$tmp/one/config.pbtxt" | tr -d ' '
    grep -oE '^\s*[A-Z][A-Z_0-9]*\s*=' framework/config/keel.proto | grep -v UNSPECIFIED |
      tr -d ' ='
  } | sort -u | sed 's/.*/"&"/'
  printf '"%s"\n' "--set " ": " " {" "}" "true" "false" "=" "#"
} >tests/fuzz/config_fuzz.dict
ls -l "$corpus"/*
