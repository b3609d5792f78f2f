"""Many services at once, and cgroup churn: the workloads of the scale tests
and of the bench's scale section.

Every service is a child cgroup v2 of one parent cgroup owned by this run,
holding one tiny C worker (busy_worker.c, compiled at run time with cc) that
loops "compute ~X us, sleep ~Y us". The parent is named like every test cgroup
(PREFIX + name + owner pid + hex), so a run that was killed is cleaned up by
the next one (workload.remove_stale_cgroups), children included.

- Services(n): n long-lived services, all started at once.
- Churn: new services at a fixed rate, each killed and removed after a fixed
  lifetime, from a background thread, for a bounded time.

Both are context managers: on exit (also on an exception or Ctrl-C) every
worker is killed and every cgroup removed.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from tests.support.workload import PREFIX, _require_mount, remove_stale_cgroups, remove_tree

WORKER_SOURCE = Path(__file__).with_name("busy_worker.c")


def compile_worker(directory: Path, source: Path = WORKER_SOURCE) -> Path:
    """Build a one-file C program (busy_worker.c by default) into directory
    with the host's C compiler; the executable is named after the source."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) found: run 'make setup-test', which installs gcc")
    exe = directory / source.stem
    res = subprocess.run([cc, "-O2", "-Wall", "-o", str(exe), str(source)], capture_output=True,
                         text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"cc could not build {source.name}: {res.stderr.strip()}")
    return exe


def sleep_for_load(services: int, load_cpus: float, work_us: float) -> float:
    """Sleep per round (us) so that `services` workers each computing `work_us`
    per round ask for `load_cpus` CPUs together, before any waiting."""
    if services <= 0 or load_cpus <= 0:
        raise ValueError("services and load_cpus must be positive")
    return max(0.0, work_us * (services / load_cpus - 1.0))


@dataclass(frozen=True)
class Duty:
    """One worker's loop: compute work_us, then sleep sleep_us (both +-50%)."""

    work_us: float
    sleep_us: float

    @classmethod
    def for_load(cls, services: int, load_cpus: float, work_us: float = 200.0) -> "Duty":
        return cls(work_us, sleep_for_load(services, load_cpus, work_us))


class _Tree:
    """A parent cgroup owned by this process and its service children."""

    def __init__(self, name: str, worker: Path | None) -> None:
        self.mount = _require_mount()
        self.dir = self.mount / f"{PREFIX}{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self._tmp: Path | None = None
        self._log = None   # the workers' shared stderr: one fd, not one pipe per worker
        self.worker = worker
        self._procs: dict[str, subprocess.Popen] = {}

    def open(self) -> None:
        remove_stale_cgroups(self.mount)
        self._tmp = Path(tempfile.mkdtemp(prefix="slatrace-worker-"))
        self._log = open(self._tmp / "workers.log", "wb")
        if self.worker is None:
            self.worker = compile_worker(self._tmp)
        self.dir.mkdir()

    def _log_tail(self) -> str:
        return (self._tmp / "workers.log").read_text(errors="replace").strip()[-500:] if self._tmp else ""

    def path_of(self, child: str) -> str:
        """The cgroup path (as the agent names an unconfigured service)."""
        return "/" + str((self.dir / child).relative_to(self.mount))

    def start(self, child: str, duty: Duty, seconds: float) -> int:
        """mkdir a child and start one worker in it; returns the cgroup id.

        The worker's PR_SET_PDEATHSIG fires when the *thread* that started it
        ends: the churn thread outlives every worker it starts."""
        d = self.dir / child
        d.mkdir()
        self._procs[child] = subprocess.Popen(
            [str(self.worker), f"{duty.work_us:g}", f"{duty.sleep_us:g}", f"{seconds:g}", str(d)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        return d.stat().st_ino

    def kill(self, child: str) -> None:
        """SIGKILL everything in the child cgroup (cgroup.kill); no waiting."""
        kill = self.dir / child / "cgroup.kill"
        if kill.exists():
            kill.write_text("1")
        else:
            p = self._procs.get(child)
            if p is not None and p.poll() is None:
                p.kill()

    def try_remove(self, child: str) -> bool:
        """Reap a killed child's worker and remove its cgroup, if it is gone
        already; False when it is still exiting (try again later)."""
        d = self.dir / child
        p = self._procs.get(child)
        if p is not None:
            if p.poll() is None:
                return False
            del self._procs[child]
            if p.returncode == 126:
                raise RuntimeError(f"a worker could not join {d}: {self._log_tail()}")
        try:
            d.rmdir()
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            self.kill(child)   # something else got in
            return False
        return True

    def alive(self) -> int:
        return sum(1 for p in self._procs.values() if p.poll() is None)

    def close(self) -> None:
        try:
            # the whole subtree at once (cgroup.kill), then reap: removing
            # the children one by one then finds them empty
            kill = self.dir / "cgroup.kill"
            if kill.exists():
                kill.write_text("1")
            for p in self._procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
            self._procs.clear()
        finally:
            if self.dir.exists():
                remove_tree(self.dir)
            if self._log is not None:
                self._log.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


class Services:
    """n busy services, one worker each, for at most `seconds`."""

    def __init__(self, n: int, duty: Duty, seconds: float, name: str = "scale",
                 worker: Path | None = None) -> None:
        self.n = n
        self.duty = duty
        self.seconds = seconds
        self._tree = _Tree(name, worker)
        self.ids: dict[str, int] = {}   # cgroup path -> cgroup id

    @property
    def dir(self) -> Path:
        return self._tree.dir

    def __enter__(self) -> "Services":
        try:
            self._tree.open()
            width = len(str(self.n))
            for i in range(self.n):
                child = f"svc-{i:0{width}d}"
                self.ids[self._tree.path_of(child)] = self._tree.start(child, self.duty, self.seconds)
        except BaseException:
            self._tree.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._tree.close()

    def alive(self) -> int:
        """Workers still running (each one exits by itself after `seconds`)."""
        return self._tree.alive()


@dataclass
class ChurnStats:
    created: int = 0
    removed: int = 0
    max_live: int = 0
    ids: dict[str, int] = field(default_factory=dict)   # cgroup path -> id, every one created
    removed_ids: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Churn:
    """`rate` new services a second for `duration` s, each killed and removed
    `lifetime` s after it started; runs in a background thread.

    join() waits for the last one to be removed. The thread stops at the first
    failure (kept in stats.errors and raised by join()).
    """

    def __init__(self, rate: float, lifetime: float, duration: float, duty: Duty, name: str = "churn",
                 worker: Path | None = None) -> None:
        if rate <= 0 or lifetime <= 0 or duration <= 0:
            raise ValueError("rate, lifetime and duration must be positive")
        self.rate = rate
        self.lifetime = lifetime
        self.duration = duration
        self.duty = duty
        self.stats = ChurnStats()
        self._tree = _Tree(name, worker)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self.started_at = 0.0
        self.finished_at: float | None = None

    @property
    def dir(self) -> Path:
        return self._tree.dir

    def __enter__(self) -> "Churn":
        self._tree.open()
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._tree.close()

    def join(self, timeout: float | None = None) -> ChurnStats:
        limit = self.duration + self.lifetime + 60 if timeout is None else timeout
        self._thread.join(timeout=limit)
        if self._thread.is_alive():
            self._stop.set()
            raise TimeoutError(f"the churn did not finish within {limit:.0f} s")
        if self.stats.errors:
            raise RuntimeError("churn failed: " + self.stats.errors[0])
        return self.stats

    def dead_ids(self) -> frozenset[int]:
        """Ids of the cgroups removed so far (safe while the churn runs)."""
        with self._lock:
            return frozenset(self.stats.removed_ids)

    def _run(self) -> None:
        live: deque[tuple[float, str]] = deque()   # (kill time, child), in start order
        dying: list[str] = []                      # killed, not yet removed
        t0 = self.started_at
        end_spawn = t0 + self.duration
        period = 1.0 / self.rate
        # seconds the worker may run: its lifetime plus slack; it is killed on time anyway
        seconds = self.lifetime + 30
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                while live and live[0][0] <= now:
                    _, child = live.popleft()
                    self._tree.kill(child)
                    dying.append(child)
                for child in [c for c in dying if self._tree.try_remove(c)]:
                    dying.remove(child)
                    with self._lock:
                        self.stats.removed_ids.add(self.stats.ids[self._tree.path_of(child)])
                        self.stats.removed += 1
                due = t0 + self.stats.created * period
                if due <= now and due < end_spawn:
                    child = f"c{self.stats.created:05d}"
                    cgid = self._tree.start(child, self.duty, seconds)
                    with self._lock:
                        self.stats.ids[self._tree.path_of(child)] = cgid
                    self.stats.created += 1
                    # killed `lifetime` after it was due, not after it started: a
                    # driver that fell behind (a busy host) catches up without the
                    # live set growing beyond rate x lifetime
                    live.append((due + self.lifetime, child))
                    self.stats.max_live = max(self.stats.max_live, len(live))
                    continue
                if not live and not dying and due >= end_spawn:
                    break
                wake = [t for t in (live[0][0] if live else None, due if due < end_spawn else None,
                                    now + 0.01 if dying else None) if t is not None]
                self._stop.wait(max(0.0, min(wake) - time.monotonic()))
        except Exception as e:  # noqa: BLE001  (reported by join())
            self.stats.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.finished_at = time.monotonic()
