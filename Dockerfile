# syntax=docker/dockerfile:1
# The attention server image. Built in NVIDIA's CUDA 13 devel image by the scripts CI runs
# (scripts/install_deps.sh, scripts/build.sh), run from the matching CUDA runtime image
# (Ubuntu 24.04) as a non-root user.
#
#   docker build -t attention-server:latest .
#   docker run --rm --gpus all -p 50051:50051 -p 9464:9464 attention-server:latest  # CUDA backend
#   docker run --rm -p 50051:50051 -p 9464:9464 attention-server:latest             # CPU backend
#
# The server's default --backend=auto picks CUDA when the container sees a GPU and the CPU backend
# otherwise. gRPC listens on 50051, Prometheus /metrics on 9464; arguments after the image name
# replace the default flags below (keep --port=50051, which the HEALTHCHECK calls). deploy/README.md
# covers compose and Kubernetes.
#
# Build arguments: CUDA_VERSION, the base images' CUDA release (13.x); CUDA_ARCHITECTURES, the
# GPUs the kernels are compiled for, as a CMake list (sm_80 and sm_90a by default).
ARG CUDA_VERSION=13.0.2

# Images by their full names (registry included): podman, and docker set to resolve no short
# names, refuse "nvidia/cuda".
FROM docker.io/nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ARG CUDA_ARCHITECTURES="80;90a"
ARG DEBIAN_FRONTEND=noninteractive
# A failing command anywhere in a pipe (ldd below) fails the step.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
# The server's dependencies (the image runs no tests) in a layer of their own, rebuilt only when
# the script changes. build.sh runs the script again and finds every package present.
COPY scripts/install_deps.sh scripts/
RUN ./scripts/install_deps.sh server && rm -rf /var/lib/apt/lists/*
COPY . .
RUN ./scripts/build.sh --server-only -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}"
# The binaries, and the Ubuntu packages owning each shared library they load (gRPC, protobuf,
# abseil, prometheus-cpp and what those load), for the runtime stage to install. Libraries under
# /usr/local (the CUDA runtime) come with the runtime image. With /usr merged, a library ldd finds
# in /lib may be registered under /usr/lib, hence the second lookup. A library ldd cannot find, or
# dpkg cannot place, fails the build here rather than the container at start.
RUN set -eu; \
    mkdir -p /out/bin; \
    cp build/server/attention_server build/client/attn_client /out/bin/; \
    if ldd /out/bin/* | grep 'not found'; then exit 1; fi; \
    libs=$(ldd /out/bin/* | awk '$2 == "=>" && $3 ~ /^\// && $3 !~ /^\/usr\/local\// {print $3}'); \
    for lib in $(echo "$libs" | sort -u); do \
      owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "/usr$lib" 2>/dev/null) \
        || { echo "no package owns $lib" >&2; exit 1; }; \
      echo "${owner%%:*}" >> /tmp/owners; \
    done; \
    sort -u /tmp/owners > /out/runtime-packages.txt; \
    cat /out/runtime-packages.txt

FROM docker.io/nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
ARG DEBIAN_FRONTEND=noninteractive
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update -qq \
    && xargs -a /tmp/runtime-packages.txt apt-get install -y -qq --no-install-recommends \
    && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt
# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it (deploy/k8s/statefulset.yaml).
RUN groupadd --system --gid 10001 attention \
    && useradd --system --uid 10001 --gid attention --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin attention
COPY --from=build /out/bin/ /usr/local/bin/
USER 10001:10001
EXPOSE 50051 9464
# grpc.health.v1 Check on the server as a whole: SERVING while it runs, NOT_SERVING once SIGTERM
# starts the drain.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attn_client", "--health", "--target=localhost:50051", "--deadline_ms=3000"]
# SIGTERM (docker stop's signal) drains: requests already accepted get --shutdown_grace_s (30 s
# by default) to finish, so give `docker stop` a longer -t than that.
ENTRYPOINT ["attention_server"]
CMD ["--host=0.0.0.0", "--port=50051", "--metrics_port=9464"]
