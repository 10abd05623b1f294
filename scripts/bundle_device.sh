#!/usr/bin/env bash
# bundle_device.sh DEST BINARY... : copy binaries and the shared libraries they need, but which a
# bare GPU host lacks (gRPC, protobuf, abseil, prometheus-cpp, ...), into DEST/bin and DEST/lib.
# Run it on the build machine, then ship DEST with the working tree (docs/gpu-host.md) and run:
#   LD_LIBRARY_PATH=DEST/lib DEST/bin/your_binary
# glibc, libstdc++ and libgcc_s stay behind (the GPU host's own are newer and compatible);
# the CUDA driver (libcuda, libnvidia-*) always stays behind.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 DEST BINARY..." >&2; exit 2; }
dest=$1; shift
mkdir -p "$dest/bin" "$dest/lib"
for bin in "$@"; do
  cp -L "$bin" "$dest/bin/"
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case $(basename "$lib") in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libnvidia-*) ;;
      *) cp -Ln "$lib" "$dest/lib/" 2>/dev/null || true ;;
    esac
  done
done
du -sh "$dest" | awk '{print "bundle: " $1 " in " $2}'
