#!/usr/bin/env bash
# tests/gpu/pack.sh: build the CUDA backend's test and benchmark binaries (Release, sm_90, no
# -march=native: the GPU machine's CPU is not this one) in build-gpu/, and copy them with the
# non-CUDA shared libraries they load into build-gpu/pack/, which tests/gpu/check.sh runs on a GPU
# machine. The CUDA libraries (runtime, cuBLAS(Lt), cuDNN, NCCL) and the driver are not copied:
# there they come from the pip wheels and the driver. libcupti is (CUPTI, linked into the
# training benchmark for --kernel-table where this toolkit has it; the wheels there may lack it;
# about 4 MiB, 1.4 MiB compressed). glibc is not copied either (it must match
# the machine's loader). The pack travels as build-gpu/pack.tar.gz (check.sh unpacks it): the
# device machine takes 64 MiB of carried files together with the working tree's tracked files,
# and the pack itself is about 57 MiB (OpenBLAS alone is 36 MB), its archive about 19 MiB. Fails
# when a binary needs the driver stub libcuda or MPI, the training benchmark was built without
# NCCL (check.sh runs it with --nccl), or the archive and the tracked files exceed 60 MiB.
#
# Usage: tests/gpu/pack.sh        (env: JOBS=2 parallel compile jobs, BUILD=build-gpu)
set -euo pipefail
cd "$(dirname "$0")/../.."

build=${BUILD:-build-gpu}
pack="$build/pack"
jobs=${JOBS:-2}
limit_mib=60 # archive + tracked files, against the device machine's 64 MiB
bins=(keel_gpu_tests keel-gpu-gemm-bench keel-gpu-train-bench cuda_backend_test)

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# RUNPATH (not RPATH), so LD_LIBRARY_PATH on the GPU machine takes precedence over build paths.
cmake -S . -B "$build" "${gen[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON \
  -DKEEL_NATIVE=OFF -DKEEL_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--enable-new-dtags >/dev/null
cmake --build "$build" -j "$jobs" --target "${bins[@]}"

rm -rf "$pack"
mkdir -p "$pack"
for b in "${bins[@]}"; do
  src="$build/tests/$b"
  [[ -x "$src" ]] || { echo "pack.sh: $src was not built" >&2; exit 1; }
  if readelf -d "$src" | grep -q 'NEEDED.*\[libcuda\.so'; then
    echo "pack.sh: $b needs libcuda (the driver stub); it would not start without a driver" >&2
    exit 1
  fi
  # The GPU machine has no MPI: a binary that needs it would not start there (an MPI header
  # included by a test, or an object of nccl_mpi.cc pulled in, does this).
  if readelf -d "$src" | grep -q 'NEEDED.*\[libmpi'; then
    echo "pack.sh: $b needs libmpi, which the GPU machine does not have" >&2
    exit 1
  fi
  cp "$src" "$pack/$b"
  strip --strip-unneeded "$pack/$b"
done
if ! readelf -d "$build/tests/keel-gpu-train-bench" | grep -q 'NEEDED.*\[libnccl'; then
  echo "pack.sh: keel-gpu-train-bench was built without NCCL (check.sh runs it with --nccl):" \
    "point NCCL_ROOT at NCCL" >&2
  exit 1
fi

# Shared libraries: everything ldd resolves except the CUDA libraries, the driver and glibc.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libresolv\.so|libutil\.so|libcuda\.so|libcudart\.so|libcublas|libcudnn|libnccl|libnvrtc|libnvJitLink|libcufft|libcurand|libcusparse|libcusolver)'
for b in "${bins[@]}"; do
  if ldd "$build/tests/$b" | grep -q 'not found'; then
    echo "pack.sh: $b has unresolved libraries here:" >&2
    ldd "$build/tests/$b" | grep 'not found' >&2
    exit 1
  fi
  ldd "$build/tests/$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' |
    while read -r name path; do
      if [[ "$name" =~ $skip ]] || [[ -e "$pack/$name" ]]; then continue; fi
      cp -L "$path" "$pack/$name"
      chmod u+w "$pack/$name"
    done
done

# libcupti: keel-gpu-train-bench needs it where this toolkit had it (its --kernel-table), and
# would not start without it; the loop above carries it (not a CUDA library it skips).
cupti=none
if readelf -d "$build/tests/keel-gpu-train-bench" | grep -q 'NEEDED.*\[libcupti'; then
  cupti=$(cd "$pack" && compgen -G 'libcupti.so*' | head -1 || true)
  if [[ -z "$cupti" ]]; then
    echo "pack.sh: keel-gpu-train-bench needs libcupti but it was not copied into $pack" >&2
    exit 1
  fi
fi

# The C++ runtime goes to gcc/: this machine's libstdc++ needs a newer glibc (2.36) than the
# binaries (2.34), so check.sh uses the GPU machine's own libstdc++ when it is new enough (the
# binaries need GLIBCXX_3.4.29, GCC 11) and falls back to these only when it is not.
mkdir -p "$pack/gcc"
for lib in libstdc++.so.6 libgcc_s.so.1; do
  [[ -e "$pack/$lib" ]] && mv "$pack/$lib" "$pack/gcc/$lib"
done
glibc=$(find "$pack" -maxdepth 1 -type f -exec objdump -T {} \; 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
glibcxx=$(find "$pack" -maxdepth 1 -type f -exec objdump -T {} \; 2>/dev/null |
  grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
# The CUDA-side libraries the binaries need from the wheels there (cuDNN only in builds with the
# cuDNN frontend, for fused attention).
cuda_libs=$(for b in "${bins[@]}"; do readelf -d "$pack/$b"; done |
  grep -o 'NEEDED.*\[lib\(cudart\|cublas\|cudnn\|nccl\)[^]]*' | sed 's/.*\[//' | sort -u |
  paste -sd' ' - || true)
bytes=$(du -sb "$pack" | cut -f1)
{
  echo "keel GPU pack: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+changes'), built $(date -u +%FT%TZ) on $(uname -m)"
  echo "needs: glibc >= ${glibc#GLIBC_}, libstdc++ with ${glibcxx} (else gcc/), ${cuda_libs} (CUDA 13 and cuDNN 9 wheels), an sm_90 GPU"
  echo "kernel table (keel-gpu-train-bench --kernel-table): CUPTI $cupti"
  find "$pack" -type f ! -name MANIFEST.txt -printf '%s %P\n' | sort -k2
} >"$pack/MANIFEST.txt"
cat "$pack/MANIFEST.txt"
archive="$build/pack.tar.gz"
tar -C "$build" -czf "$archive" pack
archive_bytes=$(stat -c %s "$archive")
tracked_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "pack: $pack, $((bytes / 1024 / 1024)) MiB ($bytes bytes); $archive, $((archive_bytes / 1024 / 1024)) MiB ($archive_bytes bytes), to carry"
echo "carried with the tracked files ($((tracked_bytes / 1024 / 1024)) MiB): $(((archive_bytes + tracked_bytes) / 1024 / 1024)) MiB of the device machine's 64"
if ((archive_bytes + tracked_bytes > limit_mib * 1024 * 1024)); then
  echo "pack.sh: $archive and the tracked files are more than $limit_mib MiB" >&2
  exit 1
fi
