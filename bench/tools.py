"""Processes the bench starts: workloads, the slatrace agent, bcc's runqlat.

Every process gets its own session (so a timeout can kill the whole group,
hackbench's children included) and PR_SET_PDEATHSIG, so nothing outlives the
bench even if the bench itself is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import floor
from bench.bpfstats import ProgramCounters, attached_programs

PR_SET_PDEATHSIG = 1
RUNQLAT = "runqlat-bpfcc"
RUNQLAT_PROGRAMS = {"sched_switch", "sched_wakeup", "sched_wakeup_new"}


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=die_with_parent)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group the bench created for proc (its pid)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop(proc: subprocess.Popen, sig: int, timeout: float = 10.0) -> None:
    """Ask politely (so the tool detaches and restores what it changed), then kill."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc)


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str
    seconds: float


def run_bounded(cmd: list[str], timeout: float) -> Finished:
    """Run to completion or kill the whole group after `timeout` seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s") from None
    except BaseException:
        kill_group(proc)
        raise
    return Finished(proc.returncode, out.decode(errors="replace"), time.monotonic() - t0)


def pinned(cpu: int | None) -> list[str]:
    """A command prefix that keeps a process and all its threads on one CPU
    (taskset execs the command: the pid stays the tool's)."""
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def attach_seconds_in(log_text: str) -> float | None:
    """X of the agent's "BPF programs attached to <mode> tracepoints in X s":
    the compile and attach, the part of start-up a busy host stretches most."""
    for line in log_text.splitlines():
        if "BPF programs attached" in line and " in " in line:
            try:
                return float(line.rsplit(" in ", 1)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


class Tool:
    """A running tracing tool; subclasses know how to start, detect attachment
    and stop it."""

    name = "tool"
    stop_signal = signal.SIGTERM

    def __init__(self, proc: subprocess.Popen, log: Path, t_spawn: float) -> None:
        self.proc = proc
        self.log = log
        self.t_spawn = t_spawn
        self.ready_seconds: float | None = None
        self.counters: ProgramCounters | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n{log_tail(self.log)}")

    def stop(self) -> None:
        stop(self.proc, self.stop_signal)

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def memory(self) -> tuple[int, int]:
        """(RSS, USS): RSS counts the shared LLVM that BCC maps in, USS only
        what this process alone holds."""
        info = psutil.Process(self.pid).memory_full_info()
        return info.rss, info.uss


class Slatrace(Tool):
    """`slatrace run` on a free loopback port with the OTLP receivers off;
    ready when /readyz answers 200 (programs attached and one interval read)."""

    name = "slatrace"

    def __init__(self, proc: subprocess.Popen, log: Path, t_spawn: float, port: int) -> None:
        super().__init__(proc, log, t_spawn)
        self.port = port

    @classmethod
    def start(cls, log: Path, cpu: int | None = None) -> "Slatrace":
        exe = Path(sys.executable).parent / "slatrace"
        if not exe.exists():
            raise RuntimeError(f"{exe} is missing: run 'make setup' to install slatrace into the venv")
        port = free_port()
        cmd = [*pinned(cpu), str(exe), "run", "--listen", f"127.0.0.1:{port}",
               "--otlp-grpc-listen", "off", "--otlp-http-listen", "off"]
        t0 = time.monotonic()
        return cls(spawn(cmd, log), log, t0, port)

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, ""

    def wait_ready(self, timeout: float = 60.0) -> float:
        deadline = self.t_spawn + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                status, _ = self.get("/readyz", timeout=0.5)
            except (urllib.error.URLError, OSError):
                status = 0  # not listening yet
            if status == 200:
                self.ready_seconds = time.monotonic() - self.t_spawn
                self.counters = ProgramCounters.of(self.pid)
                return self.ready_seconds
            time.sleep(0.02)
        raise RuntimeError(f"slatrace not ready {timeout:.0f} s after start:\n{log_tail(self.log)}")

    def metric(self, name: str) -> float | None:
        """One unlabelled sample from /metrics."""
        status, body = self.get("/metrics")
        if status != 200:
            return None
        for line in body.splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return float(value)
        return None

    def attach_seconds(self) -> float | None:
        """The agent's own "BPF programs attached to ... in X s" log line."""
        return attach_seconds_in(log_tail(self.log, 200))


class _PrintsTracing(Tool):
    """A tool that prints "Tracing" once it is attached; ready when it has and
    its programs show in bpftool."""

    programs: frozenset[str] = frozenset()

    def wait_ready(self, timeout: float = 60.0) -> float:
        deadline = self.t_spawn + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if "Tracing" in log_tail(self.log, 50):
                programs = attached_programs(self.pid)
                if self.programs <= set(programs):
                    self.ready_seconds = time.monotonic() - self.t_spawn
                    self.counters = ProgramCounters(self.pid, programs)
                    return self.ready_seconds
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not attached {timeout:.0f} s after start:\n{log_tail(self.log)}")


class Runqlat(_PrintsTracing):
    """bcc's runqlat-bpfcc, the peer to compare with; attached once it printed
    "Tracing" and its three programs show in bpftool. SIGINT makes it print
    its histogram and detach."""

    name = "runqlat"
    stop_signal = signal.SIGINT
    programs = frozenset(RUNQLAT_PROGRAMS)

    @classmethod
    def start(cls, log: Path, cpu: int | None = None) -> "Runqlat":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        return cls(spawn([*pinned(cpu), RUNQLAT], log, env), log, t0)


class Floor(_PrintsTracing):
    """The floor (bench/floor.py): empty programs on slatrace's six
    tracepoints, attached as the agent attaches them here."""

    name = "floor"
    programs = frozenset(floor.TRACEPOINTS)

    @classmethod
    def start(cls, log: Path, cpu: int | None = None) -> "Floor":
        t0 = time.monotonic()
        return cls(spawn([*pinned(cpu), sys.executable, "-m", "bench.floor"], log), log, t0)
