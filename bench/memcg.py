"""What the agent charges to its memory cgroup: what a pod's memory request and
limit are held against.

    sudo .venv/bin/python -m bench.memcg [--services 1000] [--limit 320Mi ...] [--idle-limit 112Mi ...]
                                         [--no-write-md]

A container's limit is enforced on its memory cgroup's charge, which holds more
than the agent's RSS: the page cache its reads bring in (the compiler
libraries, the kernel headers BCC parses) and kernel memory, the BPF maps
among it (charged to the cgroup that creates them since Linux 5.11). Each run
starts `slatrace run` in a fresh child cgroup (a shell joins it and execs the
agent, so nothing of the agent runs outside it) and reads the cgroup's own
files: cgroup v2 where its memory controller is on (memory.current,
memory.peak, memory.stat, memory.events), else the v1 memory controller
(usage_in_bytes, max_usage_in_bytes, kmem.usage_in_bytes, memory.stat,
oom_control). Both count the same charge.

Runs, one agent at a time: at idle, and at idle under each --idle-limit;
beside N busy services (tests/support/scale.py) with /metrics scraped, and
the same under each --limit. A limit holds when the agent starts, answers
/readyz and every scrape, and its cgroup counts no OOM kill.

The agents load private copies of the compiler libraries whose page cache is
dropped before every start, so each run is charged for reading them, as on a
node where the image was just pulled.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from agent.probe import footprint
from bench import report
from bench.compiler_libraries import COMPILER_LIBRARIES, private_compiler_libraries
from bench.tools import free_port, log_tail, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
UNLIMITED = 1 << 62
READY_TIMEOUT_S = 90.0
WARMUP_S = 10.0      # intervals collected before the first scrape: every service seen
SCRAPES = 3
SCRAPE_EVERY_S = 5.0
IDLE_STEADY_S = 5.0
BEGIN = "<!-- BEGIN memcg results: written by `python -m bench.memcg`; edits inside are overwritten -->"
END = "<!-- END memcg results -->"
HEADING = "Memory cgroup charge: the pod's request and limit"


@dataclass(frozen=True)
class Charge:
    """One reading of a memory cgroup, in bytes. `kernel` holds the BPF maps;
    `working_set` is current minus inactive file pages, what the kubelet
    reports and evicts on; `file` pages are reclaimed under the limit before
    the OOM killer is called."""

    current: int
    peak: int
    anon: int
    file: int
    kernel: int
    working_set: int
    percpu: int | None      # v2 only: per-CPU allocations (the per-CPU maps)
    kernel_peak: int | None  # v1 only: kmem.max_usage_in_bytes
    oom_kills: int


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def memory_hierarchy(mounts_text: str | None = None) -> tuple[Path, int]:
    """(mount, version) of the hierarchy that holds the memory controller:
    cgroup v2 when its root offers it, else v1's memory hierarchy."""
    if mounts_text is None:
        mounts_text = Path("/proc/mounts").read_text()
    v1 = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount = Path(fields[1].replace("\\040", " "))
        if fields[2] == "cgroup2":
            try:
                if "memory" in (mount / "cgroup.controllers").read_text().split():
                    return mount, 2
            except OSError:
                continue
        elif fields[2] == "cgroup" and "memory" in fields[3].split(","):
            v1 = mount
    if v1 is None:
        raise RuntimeError("no memory cgroup controller is mounted (v2 or v1)")
    return v1, 1


class MemoryCgroup:
    """A child memory cgroup owned by this run; removed by close()."""

    def __init__(self, name: str, limit: int | None = None) -> None:
        mount, self.version = memory_hierarchy()
        if self.version == 2:
            control = mount / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        self.dir = mount / f"slatrace-{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self.dir.mkdir()
        if limit is not None:
            self.set_limit(limit)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_limit(self, limit: int) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        (self.dir / name).write_text(str(limit))

    def joined(self, cmd: list[str]) -> list[str]:
        """cmd run inside this cgroup: a shell moves itself in, then execs cmd
        (same pid), so every page the command touches is charged here."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.dir), *cmd]

    def read(self) -> Charge:
        d, f = self.dir, lambda name: int((self.dir / name).read_text())
        stat = _stat(d / "memory.stat")
        if self.version == 2:
            current = f("memory.current")
            peak = f("memory.peak") if (d / "memory.peak").exists() else current
            kernel = stat.get("kernel", sum(stat.get(k, 0) for k in (
                "kernel_stack", "pagetables", "percpu", "sock", "slab", "vmalloc")))
            events = _stat(d / "memory.events")
            return Charge(current, peak, stat.get("anon", 0), stat.get("file", 0), kernel,
                          current - stat.get("inactive_file", 0), stat.get("percpu"), None, events.get("oom_kill", 0))
        current = f("memory.usage_in_bytes")
        oom = dict(line.split() for line in (d / "memory.oom_control").read_text().splitlines())
        return Charge(current, f("memory.max_usage_in_bytes"), stat.get("rss", 0), stat.get("cache", 0),
                      f("memory.kmem.usage_in_bytes"), current - stat.get("total_inactive_file", 0), None,
                      f("memory.kmem.max_usage_in_bytes"), int(oom.get("oom_kill", 0)))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dir / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages from the page cache (those no process maps),
    so the next reader is charged for them as a first reader on a node is."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a fresh copy's) are not dropped
        finally:
            os.close(fd)
    _, error = footprint.drop_page_cache([str(p) for p in paths])
    if error:
        raise RuntimeError(error)


def parse_quantity(text: str) -> int:
    """A Kubernetes memory quantity (Ki, Mi, Gi or plain bytes) in bytes."""
    for suffix, mult in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)):
        if text.endswith(suffix):
            return int(float(text[:-2]) * mult)
    return int(text)


def vm_status(pid: int) -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of a live process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def http_get(port: int, path: str, timeout: float) -> tuple[int, int]:
    """(status, body bytes); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status, len(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, 0
    except (urllib.error.URLError, OSError):
        return 0, 0


@dataclass
class AgentRun:
    """One agent started in its own memory cgroup and what became of it."""

    label: str
    services: int
    limit: int | None
    ready_s: float | None = None
    outcome: str = ""
    exit_status: int | None = None
    at_ready: Charge | None = None
    steady: Charge | None = None
    max_current: int = 0
    process: dict[str, int] | None = None
    scrapes: list[tuple[int, int, float]] | None = None   # (status, bytes, seconds)
    log_tail: str = ""


def run_agent(label: str, services: int, limit: int | None, logdir: Path, env: dict[str, str],
              libraries: list[Path], scrapes: int, warmup_s: float) -> AgentRun:
    """Start the agent in a fresh cgroup (under `limit`), wait for /readyz,
    then `scrapes` /metrics scrapes after `warmup_s`; read the charge."""
    run = AgentRun(label, services, limit)
    port = free_port()
    log = logdir / f"agent-{label.replace(' ', '-').replace(',', '')}.log"
    cmd = [str(Path(sys.executable).parent / "slatrace"), "run", "--listen", f"127.0.0.1:{port}",
           "--otlp-grpc-listen", "off", "--otlp-http-listen", "off"]
    drop_page_cache(libraries)
    with MemoryCgroup("memcg", limit) as cg:
        t0 = time.monotonic()
        proc = spawn(cg.joined(cmd), log, {**os.environ, **env})
        try:
            while True:
                if proc.poll() is not None:
                    run.exit_status = proc.returncode
                    break
                if http_get(port, "/readyz", 0.5)[0] == 200:
                    run.ready_s = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > READY_TIMEOUT_S:
                    run.outcome = f"not ready after {READY_TIMEOUT_S:.0f} s"
                    break
                time.sleep(0.02)
            if run.ready_s is not None:
                run.at_ready = cg.read()
                run.max_current = run.at_ready.current
                run.scrapes = []
                time.sleep(warmup_s)
                for i in range(scrapes):
                    if i:
                        time.sleep(SCRAPE_EVERY_S)
                    t = time.monotonic()
                    status, size = http_get(port, "/metrics", 30.0)
                    run.scrapes.append((status, size, time.monotonic() - t))
                    run.max_current = max(run.max_current, cg.read().current)
                if proc.poll() is None:
                    run.process = vm_status(proc.pid)
                    run.steady = cg.read()
                else:
                    run.exit_status = proc.returncode
        finally:
            stop(proc, signal.SIGTERM)
            final = cg.read()
        run.steady = run.steady or final
        run.log_tail = log_tail(log, 8)
    if run.exit_status is not None:
        run.outcome = (f"killed by signal {-run.exit_status}" if run.exit_status < 0
                       else f"exited with status {run.exit_status}")
        run.outcome += f", {run.steady.oom_kills} OOM kill(s) in its cgroup"
    elif run.ready_s is not None:
        ok = run.scrapes and all(s == 200 for s, _, _ in run.scrapes)
        run.outcome = (f"ready, {len(run.scrapes)} scrapes answered" if ok else "ready, a scrape failed") + \
            f", {run.steady.oom_kills} OOM kill(s)"
    return run


@dataclass(frozen=True)
class Plan:
    label: str
    services: int
    limit: int | None
    scrapes: int
    warmup_s: float


def plans(services: int, limits: list[int], idle_limits: list[int]) -> list[Plan]:
    out = [Plan("idle", 0, None, 1, IDLE_STEADY_S)]
    out += [Plan(f"idle, limit {q // MIB} MiB", 0, q, 1, IDLE_STEADY_S) for q in idle_limits]
    if services:
        out.append(Plan(f"{services} services", services, None, SCRAPES, WARMUP_S))
        out += [Plan(f"{services} services, limit {q // MIB} MiB", services, q, SCRAPES, WARMUP_S) for q in limits]
    return out


@contextlib.contextmanager
def with_services(n: int, logdir: Path) -> Iterator[None]:
    """n busy services (tests/support/scale.py) for the runs that want them."""
    from tests.support.scale import Duty, Services, compile_worker

    from bench.scale import WORK_US

    with Services(n, Duty.for_load(n, 0.6, WORK_US), seconds=3600, worker=compile_worker(logdir)):
        yield


def measure(args: argparse.Namespace, logdir: Path, env: dict[str, str], libraries: list[Path],
            progress: Callable[[str], None]) -> list[AgentRun]:
    runs = []
    todo = plans(args.services, args.limit, args.idle_limit)
    for services in sorted({p.services for p in todo}):
        group = [p for p in todo if p.services == services]
        with with_services(services, logdir) if services else contextlib.nullcontext():
            if services:
                progress(f"{services} services started")
            for p in group:
                r = run_agent(p.label, p.services, p.limit, logdir, env, libraries, p.scrapes, p.warmup_s)
                progress(f"{p.label}: {r.outcome}; cgroup peak {r.steady.peak / MIB:.0f} MiB, now "
                         f"{r.steady.current / MIB:.0f} MiB (kernel {r.steady.kernel / MIB:.0f}, file "
                         f"{r.steady.file / MIB:.0f}, working set {r.steady.working_set / MIB:.0f})")
                runs.append(r)
    return runs


def _mib(v: int | None) -> str:
    return "–" if v is None else f"{v / MIB:.0f}"


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"Measured {m['date']} on {m['nproc']} CPUs, kernel {m['kernel']}, cgroup v{m['cgroup_version']} "
             f"memory controller, commit {m['commit']}; command `{m['command']}`. One start per row; the peak "
             "covers the compile and the scrapes; \"steady\" is read after the last scrape. Load average "
             f"(1 min) {m['load_average'][0]:.1f} before, {m['load_average'][1]:.1f} after.", "",
             "| run | limit MiB | outcome | ready s | cgroup peak MiB | max after ready MiB | steady MiB | "
             "of which anon | file | kernel (BPF maps) | working set MiB | process VmHWM / RSS MiB | /metrics MB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        s, p = r["steady"], r["process"] or {}
        size = max((b for _, b, _ in r["scrapes"] or []), default=0)
        ready = "–" if r["ready_s"] is None else f"{r['ready_s']:.2f}"
        lines.append(f"| {r['label']} | {_mib(r['limit'])} | {r['outcome']} | {ready} | {_mib(s['peak'])} | "
                     f"{_mib(r['max_current'] or None)} | {_mib(s['current'])} | {_mib(s['anon'])} | "
                     f"{_mib(s['file'])} | {_mib(s['kernel'])} | "
                     f"{_mib(s['working_set'])} | {_mib(p.get('VmHWM'))} / {_mib(p.get('VmRSS'))} | "
                     f"{size / 1e6:.2f} |")
    failed = [r for r in res["runs"] if r["exit_status"] is not None]
    for r in failed:
        lines += ["", f"{r['label']}, the agent's last lines:", "", "```", r["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.memcg", description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=1000, help="busy services beside the agent (0: idle only)")
    p.add_argument("--limit", type=parse_quantity, action="append", default=[],
                   help="start once more at the services point under this limit, e.g. 320Mi (repeatable)")
    p.add_argument("--idle-limit", type=parse_quantity, action="append", default=[],
                   help="start once more at idle under this limit, e.g. 112Mi (repeatable)")
    p.add_argument("--no-write-md", dest="write_md", action="store_false", default=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (BPF and cgroups need it)")
    logdir = Path(tempfile.mkdtemp(prefix="slatrace-memcg-"))
    t0 = time.monotonic()
    try:
        env = private_compiler_libraries(logdir)
        libraries = [logdir / name for name in COMPILER_LIBRARIES]
        load_before = os.getloadavg()[0]
        runs = measure(args, logdir, env, libraries,
                       lambda msg: print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res = {"machine": {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "kernel": platform.release(), "nproc": os.cpu_count(), "commit": commit,
                       "cgroup_version": memory_hierarchy()[1],
                       "command": " ".join([".venv/bin/python", "-m", "bench.memcg", *argv]),
                       "load_average": [load_before, os.getloadavg()[0]]},
           "runs": [asdict(r) for r in runs]}
    report.publish(ROOT, "memcg", res, render(res), write_md=args.write_md, begin=BEGIN, end=END, heading=HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
