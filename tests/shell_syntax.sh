#!/usr/bin/env bash
# tests/shell_syntax.sh SOURCE_DIR: every shell script of the repository (a file tracked or not
# whose first line is a bash or sh shebang, outside build directories) parses with `bash -n` and
# is executable, and tests/gpu/check.sh, which only a lent GPU machine runs in full, gets through
# its prologue when run as a command: with no pack it exits 1 naming the pack and
# tests/gpu/pack.sh. A commit once rewrote check.sh into text bash cannot parse and dropped its
# executable bit, and nothing here ran it.
set -uo pipefail
src=${1:?usage: shell_syntax.sh SOURCE_DIR}
cd "$src" || exit 1
status=0 n=0
while IFS= read -r -d '' f; do
  first=$(head -c 200 "$f" | tr -d '\000' | head -1)
  [[ "$first" =~ ^#!.*(bash|/sh) ]] || continue
  n=$((n + 1))
  if ! err=$(bash -n "$f" 2>&1); then
    echo "FAIL: $f does not parse: $err"
    status=1
  fi
  if [[ ! -x "$f" ]]; then
    echo "FAIL: $f has a shebang but is not executable (chmod +x; git keeps the mode)"
    status=1
  fi
done < <(find . \( -path './build*' -o -path './.git' -o -name venv \) -prune -o -type f -print0)
echo "shell scripts parsed: $n"
if ((n < 8)); then
  echo "FAIL: expected at least 8 shell scripts (found $n)"
  status=1
fi
out=$(KEEL_GPU_PACK=/nonexistent/pack OUT= tests/gpu/check.sh 2>&1)
rc=$?
if ((rc != 1)) || [[ "$out" != *"FAIL: /nonexistent/pack/keel_gpu_tests missing (run tests/gpu/pack.sh"* ]]; then
  echo "FAIL: check.sh without a pack: exit $rc, output:"
  echo "$out"
  status=1
fi
exit $status
