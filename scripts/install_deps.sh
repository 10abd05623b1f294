#!/usr/bin/env bash
# Installs the build and test dependencies from Debian 12 packages (the same names exist on
# Ubuntu 24.04, which the Dockerfile's build stage uses). Idempotent: packages already present are
# skipped, so the README's commands, .ci/run and the Dockerfile can all call it every time.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  python3 python3-numpy python3-yaml python3-grpcio python3-protobuf
  openssl clang-14 libclang-rt-14-dev clang-format-14
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
