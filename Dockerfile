# slatrace node agent. Build from the repository root:
#   docker build -t slatrace:0.1.0 .
# The set-up is scripts/setup.sh, the same as `make setup` on a host, in its
# image mode (SLATRACE_SETUP_IMAGE=1): Debian's python3-bpfcc, a merged
# kernel-headers tree for nodes without headers, and the venv. Run it with the
# DaemonSet in deploy/ (read-only node mounts, CAP_BPF + CAP_PERFMON).
FROM debian:bookworm-slim

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
COPY . /opt/slatrace

# One RUN so the apt lists and pip cache never land in a layer.
RUN SLATRACE_SETUP_IMAGE=1 scripts/setup.sh \
    && install -m 0755 scripts/container-entrypoint.sh /usr/local/bin/slatrace \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /root/.cache

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
