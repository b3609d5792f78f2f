"""Start the real `slatrace run` as a subprocess and talk to its HTTP API."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

SLATRACE = [sys.executable, "-m", "agent.cli.main"]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_traces(port: int, body: bytes, content_type: str, encoding: str | None = None) -> tuple[int, bytes]:
    """POST an OTLP/HTTP trace export to /v1/traces: (status, body)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/traces", data=body, method="POST")
    req.add_header("Content-Type", content_type)
    if encoding:
        req.add_header("Content-Encoding", encoding)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Agent:
    """A running `slatrace run`; use as a context manager."""

    def __init__(self, *args: str, config: Path | None = None, interval: float = 0.5,
                 ready_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.ready_timeout = ready_timeout
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = SLATRACE + ["run", "--listen", f"127.0.0.1:{self.port}", "--otlp-grpc-listen", "off",
                          "--otlp-http-listen", "off", "--interval", str(interval), *args]
        if config is not None:
            cmd += ["--config", str(config)]
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after = 0.0

    def __enter__(self) -> "Agent":
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # Read the log as it comes: a pipe nobody drains fills (64 KiB), and the
        # agent's next log line then blocks whichever thread writes it.
        self._log: list[bytes] = []
        self._reader = threading.Thread(target=lambda: self._log.extend(iter(self.proc.stdout.readline, b"")),
                                        daemon=True)
        self._reader.start()
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:  # not ready: __exit__ will not run, so stop it here
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"slatrace exited with {self.proc.returncode}: {self.output()}")
            try:
                if self.ready_now():
                    self.ready_after = time.monotonic() - self.started_at
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"slatrace not ready after {timeout} s")

    def ready_now(self) -> bool:
        return http_get(self.url + "/readyz", timeout=1.0)[0] == 200

    def get_json(self, path: str) -> dict:
        status, body = http_get(self.url + path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def output(self) -> str:
        """The agent's log so far (all of it once the agent has exited)."""
        if self.proc and self.proc.poll() is not None:
            self._reader.join(timeout=5)
        return b"".join(self._log).decode(errors="replace") if self.proc else ""

    def __exit__(self, *exc) -> None:
        self.stop()


def bpf_prog_ids(pid: int) -> set[int]:
    """IDs of the BPF programs a process holds open (from its fdinfo)."""
    ids = set()
    for fdinfo in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = fdinfo.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


def loaded_prog_ids() -> set[int]:
    """IDs of every BPF program loaded in the kernel (BPF_PROG_GET_NEXT_ID via bpftool)."""
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True, check=True)
    return {p["id"] for p in json.loads(out.stdout)}


def wait_for_requests(agent: Agent, wanted: set[str], timeout: float = 40.0) -> dict[str, dict]:
    """/api/v1/requests by id once every wanted request is in (or the time is up)."""
    deadline = time.monotonic() + timeout
    got: dict[str, dict] = {}
    while not wanted <= set(got) and time.monotonic() < deadline:
        status, body = http_get(agent.url + "/api/v1/requests", timeout=30)
        if status == 200:
            got = {r["request_id"]: r for r in json.loads(body)["requests"]}
        time.sleep(0.2)
    return got
