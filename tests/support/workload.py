"""Bounded workloads, each started inside its own cgroup v2 "service".

The agent keys everything by cgroup v2 id, so tests make throw-away child
cgroups, start processes directly inside them and compare what the agent says
about each cgroup with what the kernel says (schedstat, tracefs).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, Sequence

from tests.support import pid_alive, rmdir_when_free

PREFIX = "slatrace-test-"
# PREFIX + name + "-" + owner pid + "-" + random hex
_OWNED_NAME = re.compile(re.escape(PREFIX) + r".+-(\d+)-[0-9a-f]{6}$")
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
VICTIM_SCRIPT = Path(__file__).with_name("victim.py")


def cgroup2_mount(mounts_text: str | None = None) -> Path | None:
    """The cgroup v2 mount point from /proc/mounts (hybrid hosts mount it aside)."""
    if mounts_text is None:
        mounts_text = Path("/proc/mounts").read_text()
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            # /proc/mounts escapes spaces as \040.
            return Path(fields[1].replace("\\040", " "))
    return None


def _require_mount() -> Path:
    mount = cgroup2_mount()
    if mount is None:
        raise RuntimeError("no cgroup v2 hierarchy is mounted")
    return mount


def _read_ids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except FileNotFoundError:
        return []


def _kill_all(cg_dir: Path, timeout: float = 10.0) -> None:
    """SIGKILL everything in cg_dir and wait until it is empty.

    cgroup.kill (5.14+) kills atomically, so a forking workload cannot escape;
    older kernels get a kill loop over cgroup.procs.
    """
    kill_file = cg_dir / "cgroup.kill"
    deadline = time.monotonic() + timeout
    while True:
        procs = _read_ids(cg_dir / "cgroup.procs")
        if not procs:
            return
        if kill_file.exists():
            kill_file.write_text("1")
        else:
            for pid in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {procs} survive SIGKILL in {cg_dir}")
        time.sleep(0.02)


def remove_stale_cgroups(mount: Path | None = None) -> list[Path]:
    """Remove test cgroups left behind by runs whose process is gone.

    Names carry the creating pid, so a parallel run's live cgroups are spared.
    """
    mount = mount or _require_mount()
    removed = []
    for d in mount.glob(PREFIX + "*"):
        m = _OWNED_NAME.match(d.name)
        if not m or pid_alive(int(m[1])):
            continue  # not one of ours, or its run is still going
        remove_tree(d)
        removed.append(d)
    return removed


def remove_tree(top: Path) -> None:
    """Kill everything in a cgroup and its descendants, then remove them all,
    deepest first (a cgroup with children cannot be removed)."""
    dirs = [top] + [Path(root) / name for root, names, _ in os.walk(top) for name in names]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _kill_all(d)
        rmdir_when_free(d)


class TestCgroup:
    """A throw-away cgroup v2 child: a "service" for one test.

    Everything started in it is killed and the directory removed on exit, also
    when the test fails.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, name: str) -> None:
        self.name = name
        self.mount = _require_mount()
        self.dir = self.mount / f"{PREFIX}{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self.path = "/" + str(self.dir.relative_to(self.mount))
        self.id = 0
        self._popens: list[subprocess.Popen] = []

    def __enter__(self) -> "TestCgroup":
        remove_stale_cgroups(self.mount)
        self.dir.mkdir()
        # The cgroup id BPF reports (bpf_get_current_cgroup_id) is this inode number.
        self.id = self.dir.stat().st_ino
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Kill what is left, reap our children, remove the directory."""
        try:
            if self.dir.exists():
                _kill_all(self.dir)
        finally:
            for p in self._popens:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
            remove_tree(self.dir)  # with any child cgroups a test made inside

    def spawn(self, argv: Sequence[str], *, child: str = "", **popen_kwargs: object) -> subprocess.Popen:
        """Start argv inside this cgroup (or its descendant `child`, a relative
        path, made if missing); it never runs a single instruction outside.

        The shell moves itself in and then execs argv, so the pid is the
        program's pid and all its threads and children are born inside.
        """
        target = self.dir / child if child else self.dir
        target.mkdir(parents=True, exist_ok=True)
        script = 'echo $$ > "$1/cgroup.procs" || exit 126; shift; exec "$@"'
        p = subprocess.Popen(["/bin/sh", "-c", script, "sh", str(target), *argv],
                             **popen_kwargs)  # type: ignore[arg-type]
        self._popens.append(p)
        return p

    def pids(self) -> list[int]:
        """Processes (thread-group ids) currently in the cgroup."""
        return _read_ids(self.dir / "cgroup.procs")

    def tids(self) -> list[int]:
        """Threads currently in the cgroup (the ids tracepoints report)."""
        return _read_ids(self.dir / "cgroup.threads")


def hog_argv(cpu: int | None = None) -> list[str]:
    """A busy loop, optionally pinned, so tests can put a fixed load on each CPU."""
    pin = f"import os; os.sched_setaffinity(0, {{{int(cpu)}}})\n" if cpu is not None else ""
    return [PYTHON, "-c", pin + "while True: pass"]


def victim_argv(seconds: float, sleep_ms: float = 1.0, work_ms: float = 0.3) -> list[str]:
    """A latency-sensitive-looking task: short sleeps and short bursts of CPU."""
    return [PYTHON, str(VICTIM_SCRIPT), repr(float(seconds)), repr(float(sleep_ms)),
            repr(float(work_ms))]


# O_DIRECT|O_SYNC writes wait for the device in io_schedule(), i.e. in D state.
# The file is unlinked at once so a killed run leaves nothing on disk.
_IOWAIT_CODE = """
import mmap, os, sys, time
end = time.monotonic() + float(sys.argv[1])
path = os.path.join(sys.argv[2], "slatrace-iowait-%d" % os.getpid())
flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_SYNC
try:
    fd = os.open(path, flags | os.O_DIRECT, 0o600)
except OSError:
    fd = os.open(path, flags, 0o600)
os.unlink(path)
buf = mmap.mmap(-1, 4096)
buf.write(b"x" * 4096)
i = 0
while time.monotonic() < end:
    os.pwrite(fd, buf, (i % 16) * 4096)
    os.fsync(fd)
    i += 1
os.close(fd)
"""


def block_backed_dir(candidates: Sequence[str] = ("/var/tmp", "/tmp")) -> Path:
    """A writable directory on a real block device (tmpfs never blocks in D state)."""
    mounts = []
    for line in Path("/proc/mounts").read_text().splitlines():
        f = line.split()
        if len(f) >= 3:
            mounts.append((f[1], f[0], f[2]))
    # Longest mount point first: the mount a path lives on.
    mounts.sort(key=lambda m: len(m[0]), reverse=True)
    for cand in candidates:
        real = os.path.realpath(cand)
        for point, source, fstype in mounts:
            if real == point or real.startswith(point.rstrip("/") + "/"):
                if source.startswith("/dev/") and os.access(real, os.W_OK):
                    return Path(real)
                break
    raise RuntimeError(f"none of {list(candidates)} is on a block device")


def iowait_argv(seconds: float, directory: Path | None = None) -> list[str]:
    """A single thread that keeps blocking in uninterruptible sleep (D state)."""
    directory = directory or block_backed_dir()
    return [PYTHON, "-c", _IOWAIT_CODE, repr(float(seconds)), str(directory)]


class Schedstat(NamedTuple):
    """One line of /proc/PID/task/TID/schedstat (kernel accounting, not tracepoints)."""

    run_ns: int
    wait_ns: int      # total time runnable but waiting for a CPU
    timeslices: int   # number of times the task got a CPU

    @property
    def run_count(self) -> int:
        """The kernel's name for timeslices (sched_info.pcount)."""
        return self.timeslices


def read_schedstat(pid: int, proc: Path = Path("/proc")) -> dict[int, Schedstat]:
    """schedstat of every thread of pid; threads that exit meanwhile are skipped.

    Also works on an unreaped zombie, which keeps its final totals: reading
    then gives the whole life of a process.
    """
    out: dict[int, Schedstat] = {}
    task_dir = proc / str(pid) / "task"
    for entry in task_dir.iterdir():
        try:
            fields = (entry / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[int(entry.name)] = Schedstat(int(fields[0]), int(fields[1]), int(fields[2]))
    return out


class CtxtSwitches(NamedTuple):
    """Context switch counters of a thread, from /proc/PID/task/TID/status."""

    voluntary: int
    nonvoluntary: int   # switched out while still runnable (preempted or yielded)


def read_ctxt_switches(pid: int, proc: Path = Path("/proc")) -> dict[int, CtxtSwitches]:
    """Kernel counters of voluntary and involuntary switches, per thread of pid."""
    out: dict[int, CtxtSwitches] = {}
    for entry in (proc / str(pid) / "task").iterdir():
        try:
            text = (entry / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        out[int(entry.name)] = CtxtSwitches(int(fields["voluntary_ctxt_switches"]),
                                            int(fields["nonvoluntary_ctxt_switches"]))
    return out


def process_state(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The one-letter state from /proc/PID/stat, None when the pid is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may contain spaces and parentheses: the state follows the last ')'.
    return stat[stat.rindex(")") + 2]


def wait_blocked_in(cgroup: TestCgroup, pid: int, timeout: float = 60.0) -> None:
    """Until pid is in the cgroup and asleep: switched out since it moved in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid in cgroup.pids() and process_state(pid) == "S":
            time.sleep(0.2)
            return
        time.sleep(0.05)
    raise TimeoutError(f"{pid} did not block in {cgroup.path}")


def held_for_go(argv: Sequence[str]) -> list[str]:
    """argv behind a shell that first reads a line from stdin: spawned with
    stdin=PIPE, the process starts up (in its cgroup) and runs argv at the go."""
    return ["/bin/sh", "-c", 'read go; exec "$@"', "sh", *argv]


def wait_zombie(pid: int, timeout: float) -> None:
    """Wait until our child pid has exited but is not yet reaped.

    Its schedstat then holds the totals of its whole life, which is what a
    reference recorded over its whole life is compared with.
    """
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) not in ("Z", "X", None):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} still running (state {state}) after {timeout}s")
        time.sleep(0.02)
    if state != "Z":
        raise RuntimeError(f"pid {pid} was reaped before its schedstat could be read")


def spinner_argv(seconds: float, cpu: int) -> list[str]:
    """A thread polling with sched_yield() between polls, pinned: with
    another one on its CPU, hundreds of thousands of short preempted waits a
    second (the shared-memory readers of a data-parallel engine)."""
    return [PYTHON, "-c", f"import os, time\nos.sched_setaffinity(0, {{{int(cpu)}}})\n"
            f"end = time.monotonic() + {float(seconds)!r}\nwhile time.monotonic() < end:\n    os.sched_yield()\n"]
