#!/usr/bin/env bash
# Installs the Debian packages keel needs to build and test, when they are missing.
# As root it runs apt-get; otherwise it prints the exact apt-get line and exits 2.
# Used by launch/quickstart and tests/run (so CI on a fresh machine installs the same set).
set -euo pipefail

packages=(
  cmake make g++ pkg-config
  libprotobuf-dev protobuf-compiler
  libopenblas-openmp-dev     # OpenMP OpenBLAS: BLAS shares keel's OpenMP thread pool
  libopenmpi-dev openmpi-bin
  libgtest-dev
  libxxhash-dev              # XXH3: data fingerprints, checkpoint checksums
  nlohmann-json3-dev         # keel-ckpt export: the safetensors header and config.json
  python3-venv python3-pip   # tests/run's venv for the export test (safetensors, transformers)
  python3-torch              # PyTorch for that venv (--system-site-packages): the export test
                             # loads the exported model with transformers and compares logits
  python3-matplotlib         # launch/tools/plot_run.py (RUN/plots/*.png), run by /usr/bin/python3;
                             # without it keel-train skips the plots (plot_run.py exits 3)
  clang libclang-rt-dev      # tests/fuzz (tests/run): libFuzzer, ASan and UBSan (compiler-rt)
  libomp-dev                 # OpenMP for clang's build of keel (tests/fuzz)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "keel: missing packages; run as root:" >&2
  echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 2
fi
echo "keel: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
