#!/usr/bin/env bash
# Formats the C++ and CUDA sources with the repository's .clang-format (clang-format 14).
#   scripts/format.sh          rewrite the files in place
#   scripts/format.sh --check  list the files that differ and exit 1 when any does (the test command)
set -euo pipefail
cd "$(dirname "$0")/.."
formatter="$(command -v clang-format-14 || command -v clang-format || true)"
if [ -z "$formatter" ]; then
  echo "format.sh: clang-format 14 not found (apt-get install clang-format-14)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  differ=()
  for f in "${files[@]}"; do
    if ! "$formatter" --style=file "$f" | cmp -s - "$f"; then differ+=("$f"); fi
  done
  if [ "${#differ[@]}" -gt 0 ]; then
    echo "format.sh: ${#differ[@]} file(s) differ from .clang-format (run scripts/format.sh):" >&2
    printf '  %s\n' "${differ[@]}" >&2
    exit 1
  fi
  echo "format.sh: ${#files[@]} files match .clang-format"
  exit 0
fi
"$formatter" --style=file -i "${files[@]}"
