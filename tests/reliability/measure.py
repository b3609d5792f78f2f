"""Run the reliability attacks against a real `slatrace run` and print the
figures RELIABILITY.md quotes (served/failed, latency, RSS, threads, CPU).

    .venv/bin/python -m tests.reliability.measure [--root DIR] [--repeat N] [ATTACK ...]

`--root` starts the agent from another checkout (to compare with an older
version); the attackers always come from this one. Root is needed (BPF).
Everything talks to 127.0.0.1 only and is bounded in count and time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from tests.support.agent import REPO, free_port, http_get, post_traces

MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_figures(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "cpu_s": (int(stat[11]) + int(stat[12])) / CLK_TCK, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def terminate(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `wait_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Daemon:
    """`slatrace run` from `root`, API and OTLP/HTTP on free loopback ports."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.port = free_port()
        self.otlp_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "agent.cli.main", "run", "--listen", f"127.0.0.1:{self.port}",
               "--otlp-grpc-listen", "off", "--otlp-http-listen", f"127.0.0.1:{self.otlp_port}",
               "--interval", "0.5", *extra]
        self.log = open(f"/tmp/slatrace-measure-{os.getpid()}-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output()
                self.stop()
                raise RuntimeError(f"the agent exited: {out}")
            try:
                if http_get(self.url + "/readyz", timeout=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the agent did not become ready in 60 s")

    def figures(self) -> dict:
        return proc_figures(self.proc.pid)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int | None:
        terminate(self.proc, 20.0)
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode


def attack(*args: str, timeout: float = 300.0) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.reliability.attacks", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout)


class Sampler:
    """Peak RSS/threads/fds of a process while something runs, every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                f = proc_figures(self.pid)
            except OSError:
                return
            for k in ("rss_mib", "threads", "fds"):
                self.peak[k] = max(self.peak.get(k, 0), f[k])

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def crowd(root: Path, clients: int = 1000) -> dict:
    d = Daemon(root)
    try:
        before = d.figures()
        with Sampler(d.proc.pid) as s:
            fig = attack("crowd", "--port", str(d.port), "--clients", str(clients), "--timeout", "60")
        after = d.figures()
        fig.update(peak=s.peak, cpu_s=after["cpu_s"] - before["cpu_s"], alive=d.proc.poll() is None)
    finally:
        d.stop()
    return fig


def slowloris(root: Path, conns: int = 1000, hold: float = 5.0, close_within: float = 15.0) -> dict:
    d = Daemon(root)
    try:
        before = d.figures()
        with Sampler(d.proc.pid) as s:
            fig = attack("slowloris", "--port", str(d.port), "--clients", str(conns), "--hold", str(hold),
                         "--probes", "50", "--close-within", str(close_within))
        after = d.figures()
        fig.update(peak=s.peak, before=before, cpu_s=after["cpu_s"] - before["cpu_s"],
                   alive=d.proc.poll() is None)
    finally:
        d.stop()
    return fig


def resets(root: Path, count: int = 200) -> dict:
    d = Daemon(root)
    try:
        lines_before = len(d.output().splitlines())
        for port in (d.port, d.otlp_port):
            attack("resets", "--port", str(port), "--clients", str(count // 2))
        time.sleep(1.0)
        out = d.output().splitlines()[lines_before:]
    finally:
        d.stop()
    return {"attack": "resets", "count": count, "log_lines": len(out),
            "tracebacks": sum("Traceback" in line for line in out)}


def _span_export(rid: str, blob: str) -> bytes:
    now = time.time_ns()
    span = Span(name="llm_request", trace_id=os.urandom(16), span_id=os.urandom(8),
                start_time_unix_nano=now - 10**9, end_time_unix_nano=now)
    span.attributes.append(KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=rid)))
    span.attributes.append(KeyValue(key="gen_ai.prompt", value=AnyValue(string_value=blob)))
    req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])])
    return gzip.compress(req.SerializeToString())


def big_spans(root: Path, spans: int = 150, size: int = MiB) -> dict:
    """`spans` request spans, each with a `size` attribute, with the collector
    blackholed (a socket that never answers), so everything is kept as long as it can be."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1)
    d = Daemon(root, "--otlp-endpoint", f"http://127.0.0.1:{hole.getsockname()[1]}")
    try:
        time.sleep(1.0)
        before = d.figures()
        blob = "p" * size
        statuses = []
        with Sampler(d.proc.pid) as s:
            for i in range(spans):
                statuses.append(post_traces(d.otlp_port, _span_export(f"big-{i}", blob), "application/x-protobuf",
                                            "gzip")[0])
            time.sleep(3.0)
        after = d.figures()
        _, body = http_get(d.url + "/metrics")
        truncated = [line for line in body.decode().splitlines()
                     if line.startswith("slatrace_otlp_truncated_attributes_total")]
    finally:
        d.stop()
        hole.close()
    return {"attack": "big_spans", "spans": spans, "attribute_bytes": size,
            "accepted": statuses.count(200), "rss_growth_mib": after["rss_mib"] - before["rss_mib"],
            "peak_rss_growth_mib": s.peak.get("rss_mib", 0) - before["rss_mib"], "truncated": truncated}


def nan_spans(root: Path) -> dict:
    d = Daemon(root)
    try:
        now = time.time_ns()
        span = Span(name="llm_request", trace_id=os.urandom(16), span_id=os.urandom(8),
                    start_time_unix_nano=now - 10**9, end_time_unix_nano=2**64 - 1)
        span.attributes.append(KeyValue(key="gen_ai.request.id", value=AnyValue(string_value="nan-1")))
        span.attributes.append(KeyValue(key="gen_ai.latency.e2e", value=AnyValue(double_value=float("inf"))))
        span.attributes.append(KeyValue(key="gen_ai.latency.time_to_first_token",
                                        value=AnyValue(double_value=float("nan"))))
        req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])])
        code = post_traces(d.otlp_port, req.SerializeToString(), "application/x-protobuf")[0]
        deadline = time.monotonic() + 30
        while True:
            status, body = http_get(d.url + "/api/v1/requests/nan-1")
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        try:
            json.loads(body, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            valid = True
        except ValueError:
            valid = False
        explain = subprocess.run([sys.executable, "-m", "agent.cli.main", "explain", "nan-1", "--agent", d.url],
                                 cwd=REPO, capture_output=True, text=True, timeout=30)
    finally:
        d.stop()
    return {"attack": "nan_spans", "post": code, "status": status, "valid_json": valid,
            "explain_exit": explain.returncode, "explain_traceback": "Traceback" in explain.stderr,
            "end": json.loads(body).get("end") if valid and status == 200 else None}


def sighup(root: Path) -> dict:
    d = Daemon(root)
    try:
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        alive = d.proc.poll() is None
        ready = http_get(d.url + "/readyz")[0] if alive else None
        code = d.proc.returncode
        out = d.output()
    finally:
        d.stop()
    return {"attack": "sighup", "alive": alive, "readyz": ready, "exit": code,
            "log": [line.split(": ", 1)[-1] for line in out.splitlines() if "SIGHUP" in line or "reload" in line]}


def grpc_flood(root: Path, senders: int = 8, exports: int = 15, per_export: int = 500) -> dict:
    """`senders` threads each send `exports` OTLP/gRPC exports of `per_export`
    request spans ending 5 s ahead (the most the agent accepts), so they pile
    up in the pending heap: 60,000 by default, past its 50,000."""
    import grpc

    grpc_port = free_port()
    d = Daemon(root, "--otlp-grpc-listen", f"127.0.0.1:{grpc_port}")
    results: list[str] = []
    lock = threading.Lock()

    def body(sender: int, n: int) -> bytes:
        end = time.time_ns() + 5 * 10**9
        spans = []
        for i in range(per_export):
            span = Span(name="llm_request", trace_id=os.urandom(16), span_id=os.urandom(8),
                        start_time_unix_nano=end - 10**9, end_time_unix_nano=end)
            span.attributes.append(KeyValue(key="gen_ai.request.id",
                                            value=AnyValue(string_value=f"g{sender}-{n}-{i}")))
            spans.append(span)
        return ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])]) \
            .SerializeToString()

    def send(sender: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            for n in range(exports):
                try:
                    call(body(sender, n), timeout=10.0)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                with lock:
                    results.append(code)

    try:
        before = d.figures()
        t0 = time.monotonic()
        with Sampler(d.proc.pid) as s:
            threads = [threading.Thread(target=send, args=(i,)) for i in range(senders)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        wall = time.monotonic() - t0
        after = d.figures()
        _, text = http_get(d.url + "/metrics")
        counters = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.decode().splitlines()
                    if line.startswith(("slatrace_requests_pending_overflow_total", "slatrace_otlp_rejected",
                                        "slatrace_otlp_spans_received_total"))}
    finally:
        d.stop()
    return {"attack": "grpc_flood", "exports": senders * exports, "spans": senders * exports * per_export,
            "codes": {c: results.count(c) for c in sorted(set(results))}, "wall_s": wall,
            "cpu_s": after["cpu_s"] - before["cpu_s"], "peak_threads": s.peak.get("threads"),
            "peak_rss_growth_mib": s.peak.get("rss_mib", 0) - before["rss_mib"], "counters": counters}


ATTACKS = {"crowd": crowd, "slowloris": slowloris, "resets": resets, "big_spans": big_spans,
           "nan_spans": nan_spans, "sighup": sighup, "grpc_flood": grpc_flood}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="measure")
    p.add_argument("attacks", nargs="*", help=f"some of {', '.join(ATTACKS)} (default: all)")
    p.add_argument("--root", type=Path, default=REPO)
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args(argv)
    unknown = set(a.attacks) - ATTACKS.keys()
    if unknown:
        p.error(f"unknown attack(s) {', '.join(sorted(unknown))}; choose from {', '.join(ATTACKS)}")
    for name in a.attacks or ATTACKS:
        for _ in range(max(1, min(a.repeat, 5))):
            try:
                fig = ATTACKS[name](a.root.resolve())
            except Exception as e:  # noqa: BLE001  (an older version may not survive an attack)
                fig = {"attack": name, "error": str(e)[-500:]}
            print(json.dumps(fig), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

