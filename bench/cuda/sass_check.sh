#!/usr/bin/env bash
# Tensor-core, TMA and local-memory instructions per kernel in the sm_90a SASS of CUDA programs
# and libraries:
#   bench/cuda/sass_check.sh [--require-hgmma PATTERN]... [--require-qgmma PATTERN]...
#                            [--require-no-local PATTERN]... FILE...
# For each FILE (an executable, a shared library or a static archive such as
# build/kernels/cuda/libattention_cuda.a), every kernel function of its sm_90a cubins with its
# counts of HGMMA (wgmma on 16-bit inputs), QGMMA (wgmma on fp8), HMMA (mma.sync), UTMALDG and
# UTMASTG (TMA tile loads and stores), LDL and STL (local memory: register spills); names
# demangled and shortened (no namespaces, no return type or parameters). A FILE without sm_90a
# code is said so. Then one line "sm_90a kernels: ..." with how many kernels of all FILEs have
# each instruction.
# --require-hgmma PATTERN: exit 1 unless at least one kernel's name contains PATTERN and every
# such kernel has HGMMA and UTMALDG (the Hopper forward kernel's point); --require-qgmma likewise
# with QGMMA (its fp8 kernels); --require-no-local PATTERN: every such kernel has neither LDL nor
# STL (no spills). Each may be given several times. ctest runs it on the library (sm90_sass).
# cuobjdump: $CUOBJDUMP, else on PATH, else /usr/local/cuda/bin/cuobjdump, else the one the pip
# package nvidia-cuda-cuobjdump brings to python3 (scripts/python-requirements.txt pins it, and
# nvidia-cuda-nvdisasm which it runs, for .python-env); without any, exit 77 (ctest: skipped).
set -euo pipefail
requires=()
files=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --require-hgmma|--require-qgmma|--require-no-local)
      [[ $# -ge 2 ]] || { echo "sass_check.sh: $1 needs a PATTERN" >&2; exit 2; }
      requires+=("${1#--require-}=$2"); shift 2 ;;
    -*) echo "sass_check.sh: unknown option $1" >&2; exit 2 ;;
    *) files+=("$1"); shift ;;
  esac
done
if [[ ${#files[@]} -eq 0 ]]; then
  echo "usage: bench/cuda/sass_check.sh [--require-hgmma PATTERN]... [--require-qgmma PATTERN]..." \
    "[--require-no-local PATTERN]... FILE..." >&2
  exit 2
fi

cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || true)}
[[ -z $cuobjdump && -x /usr/local/cuda/bin/cuobjdump ]] && cuobjdump=/usr/local/cuda/bin/cuobjdump
if [[ -z $cuobjdump ]]; then
  cuobjdump=$(python3 - <<'PY' 2>/dev/null || true
import importlib.metadata as m
for f in m.distribution("nvidia-cuda-cuobjdump").files or []:
    if str(f).endswith("bin/cuobjdump"):
        print(f.locate())
        break
PY
)
fi
if [[ -z $cuobjdump || ! -x $cuobjdump ]]; then
  echo "sass_check.sh: cuobjdump not found (set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump)" >&2
  exit 77
fi

# cuobjdump disassembles with nvdisasm: the one beside it (the pip packages put both in one bin/)
# unless NVDISASM_PATH or PATH already has one.
if [[ -z ${NVDISASM_PATH:-} && -x $(dirname "$cuobjdump")/nvdisasm ]]; then
  NVDISASM_PATH=$(dirname "$cuobjdump")
  export NVDISASM_PATH
fi

dumps=$(mktemp -d)
trap 'rm -rf "$dumps"' EXIT
for i in "${!files[@]}"; do
  f=${files[$i]}
  [[ -r $f ]] || { echo "sass_check.sh: cannot read $f" >&2; exit 2; }
  # cuobjdump fails on a file with no device code at all; that is reported as "no sm_90a code".
  "$cuobjdump" --dump-sass --gpu-architecture sm_90a "$f" >"$dumps/$i.sass" 2>"$dumps/$i.err" || true
done

python3 - "$dumps" "${#files[@]}" "${files[@]}" -- "${requires[@]}" <<'PY'
import re
import subprocess
import sys

dumps, count = sys.argv[1], int(sys.argv[2])
files = sys.argv[3:3 + count]
requires = [r.split("=", 1) for r in sys.argv[4 + count:]]
COUNTED = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDL", "STL")
# An instruction line: /*0a10*/  [@P0 ]OPCODE.MODIFIERS operands ;
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)")
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        return out if len(out) == len(names) else names
    except (OSError, subprocess.CalledProcessError):
        return names


def shorten(name):
    """'void attention::cuda::K<attention::cuda::T<__half, 64> >(attention::cuda::P)'
    -> 'K<T<__half, 64>>'"""
    name = re.sub(r"^void ", "", name)
    depth = 0
    for i, c in enumerate(name):  # drop the parameter list: the first '(' outside < >
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0 and not name.startswith("(anonymous", i):
            name = name[:i]
            break
    name = re.sub(r"\(anonymous namespace\)::|_GLOBAL__N_\w+::|\b\w+::", "", name)
    return name.replace("> >", ">>")


kernels = []  # (file, short name, counts)
for i, f in enumerate(files):
    current = None
    found = []
    for line in open(f"{dumps}/{i}.sass", errors="replace"):
        m = FUNCTION.match(line)
        if m:
            current = {"mangled": m.group(1), "counts": dict.fromkeys(COUNTED, 0)}
            found.append(current)
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None and m.group(1) in COUNTED:
            current["counts"][m.group(1)] += 1
    print(f"== {f}: {len(found)} sm_90a kernel functions")
    if not found:
        err = open(f"{dumps}/{i}.err", errors="replace").read().strip().splitlines()
        print(f"   no sm_90a code{': ' + err[0] if err else ''}")
        continue
    names = [shorten(n) for n in demangle([k["mangled"] for k in found])]
    print("| kernel | " + " | ".join(COUNTED) + " |")
    print("|---" * (1 + len(COUNTED)) + "|")
    for name, k in zip(names, found):
        print(f"| {name} | " + " | ".join(str(k["counts"][c]) for c in COUNTED) + " |")
        kernels.append((f, name, k["counts"]))

print(f"sm_90a kernels: {len(kernels)}; with " +
      ", ".join(f"{c} {sum(1 for k in kernels if k[2][c] > 0)}" for c in COUNTED))


def check(kind, pattern):
    """One --require-KIND PATTERN: prints ok or FAIL with the kernels that miss it; True if ok."""
    matching = [k for k in kernels if pattern in k[1]]
    if kind == "no-local":
        bad = [k for k in matching if k[2]["LDL"] or k[2]["STL"]]
        fails, holds = "use local memory (spills)", "use no local memory"
        detail = lambda c: f"LDL {c['LDL']}, STL {c['STL']}"
    else:
        gemm = kind.upper()  # HGMMA or QGMMA
        bad = [k for k in matching if k[2][gemm] == 0 or k[2]["UTMALDG"] == 0]
        fails, holds = f"lack {gemm} or UTMALDG", f"have {gemm} and UTMALDG"
        detail = lambda c: f"{gemm} {c[gemm]}, UTMALDG {c['UTMALDG']}"
    if not matching:
        print(f"require-{kind} {pattern}: FAIL: no sm_90a kernel's name contains {pattern!r}")
        return False
    if bad:
        print(f"require-{kind} {pattern}: FAIL: {len(bad)} of {len(matching)} matching kernels "
              f"{fails}:")
        for f, name, counts in bad:
            print(f"   {name} ({f}): {detail(counts)}")
        return False
    print(f"require-{kind} {pattern}: ok: all {len(matching)} matching kernels {holds}")
    return True


failed = not all([check(kind, pattern) for kind, pattern in requires])
sys.exit(1 if failed else 0)
PY
