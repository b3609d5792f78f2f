# slatrace node agent. Build from the repository root:
#   docker build -t slatrace:0.1.0 .
# The set-up is scripts/setup.sh, the same as `make setup` on a host, in its
# image mode (SLATRACE_SETUP_IMAGE=1): Debian's python3-bpfcc, a merged
# kernel-headers tree for nodes without headers, and the venv. Run it with the
# DaemonSet in deploy/ (read-only node mounts, CAP_BPF + CAP_PERFMON).
#
# Layers go from the least to the most often changed: Debian packages and the
# headers tree (scripts/setup.sh), the Python dependencies (pyproject.toml),
# then the code, so a change to the code alone reruns only the last two steps.
# tests/container builds this file and runs the image under deploy/daemonset.yaml.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="slatrace" \
      org.opencontainers.image.description="eBPF agent that explains why a latency-sensitive service misses its SLA: run-queue latency, preemptions, I/O wait and migrations per service and per request" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SLATRACE_VENV=/opt/slatrace/.venv \
    SLATRACE_IMAGE_HEADERS=/opt/slatrace/kernel-headers

WORKDIR /opt/slatrace

# Debian packages and the kernel-headers tree; the step removes the compiler
# the headers package pulls in, and apt's lists and caches, in the same layer.
COPY scripts/setup.sh scripts/setup.sh
RUN SLATRACE_SETUP_IMAGE=1 scripts/setup.sh --host

# The venv, from pyproject.toml alone: the pinned dependencies, and slatrace
# installed editable (its packages are found in /opt/slatrace at run time).
COPY pyproject.toml pyproject.toml
RUN SLATRACE_SETUP_IMAGE=1 scripts/setup.sh --deps \
    && rm -rf /root/.cache

# The code (.dockerignore keeps the rest of the checkout out): nothing to
# install but the entrypoint.
COPY . /opt/slatrace
RUN install -m 0755 scripts/container-entrypoint.sh /usr/local/bin/slatrace

# HTTP (metrics, API, probes), OTLP/gRPC, OTLP/HTTP.
EXPOSE 9477 4317 4318

# /livez answers while the process is healthy, before the BPF programs are up;
# the start period covers the BPF compile on a slow node.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["/opt/slatrace/.venv/bin/python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9477/livez', timeout=4).status != 200)"]

# Listen on every address of the pod: the DaemonSet's Service and PodMonitor
# reach it there. Extra arguments (the DaemonSet passes --config) are appended.
ENTRYPOINT ["/usr/local/bin/slatrace", "run", "--listen", "0.0.0.0:9477", "--otlp-grpc-listen", "0.0.0.0:4317", "--otlp-http-listen", "0.0.0.0:4318"]
CMD []
