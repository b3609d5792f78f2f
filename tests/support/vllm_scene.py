"""The pieces of a scene around a real vLLM engine (tests/inference): who its
threads are, a heavier neighbour on its CPUs, and waiting for the agent to
have attributed its requests.

The engine itself is tests/support/vllm_engine.py; the tracefs reference of
a request's window is tests/support/request_reference.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import needs_kernel
from tests.support.agent import Agent, free_port, http_get
from tests.support.cpu_weight import CpuWeight
from tests.support.vllm_engine import Engine, build_model, needs_engine
from tests.support.workload import TestCgroup, hog_argv

WORKER = "VLLM::Worker"   # the model worker's process name (pinned to its CPUs)
HOG_SPUN_S = 0.1          # a neighbour's hog has started once it has used this much CPU
HOG_START_S = 10.0


def scene_config(path: Path, service: str, noisy: str, extra: str = "") -> Path:
    """The agent's config for a vLLM scene: this run's cgroups of the engine
    and its neighbour by name (other runs on a shared machine make cgroups of
    the same names), then `extra` YAML."""
    path.write_text("services:\n"
                    f"  - name: {service}\n    cgroup: \"/slatrace-test-vllm-{os.getpid()}-*\"\n"
                    f"  - name: {noisy}\n    cgroup: \"/slatrace-test-noisy-{os.getpid()}-*\"\n" + extra)
    return path


SERVICE = "vllm-test"      # the engine's service in the agent's config
NOISY = "noisy-test"       # its neighbour's
MAX_TOKENS = 32
PROMPTS = ["Hello, how are you today?", "Tell me a story about a scheduler.",
           "The quick brown fox jumps over the lazy dog.", "one two three four five"]


@dataclass
class Stage:
    """The agent, vLLM's cgroup and its neighbour's, each in a CPU group of its
    own (as pods are), and the tiny model: what every vLLM scene stands on."""

    tmp: Path
    model: Path
    agent: Agent
    grpc_port: int
    infer: TestCgroup          # vLLM's processes
    noisy: TestCgroup          # the neighbour's
    weight: CpuWeight          # the neighbour's CPU weight
    own: CpuWeight             # vLLM's CPU group (weight 100: the default), where its limit is set

    def engine(self, **kwargs: Any) -> Engine:
        """vLLM in its cgroup and CPU group, sending its spans to the agent."""
        return Engine(self.infer, self.model, f"http://127.0.0.1:{self.grpc_port}", self.tmp / "vllm.log",
                      on_spawn=self.own.add, **kwargs)


@contextmanager
def stage(tmp: Path, neighbour_weight: int, config: str = "", heads: int = 1) -> Iterator[Stage]:
    """A Stage under `tmp`: the neighbour's CPU group weighs `neighbour_weight`
    (vLLM's the default 100), `config` is added to the agent's config file and
    the model has `heads` attention heads. Skips (fails in CI) without the
    kernel's prerequisites or the vLLM venv."""
    needs_kernel()
    needs_engine()
    model = build_model(tmp / "model", heads)
    path = scene_config(tmp / "slatrace.yaml", SERVICE, NOISY, config)
    grpc_port = free_port()
    with Agent("--otlp-grpc-listen", f"127.0.0.1:{grpc_port}", config=path, interval=0.5) as agent, \
            TestCgroup("vllm") as infer, TestCgroup("noisy") as noisy, \
            CpuWeight("noisy", neighbour_weight, noisy.dir) as weight, \
            CpuWeight("vllm", 100, infer.dir) as own:
        yield Stage(tmp, model, agent, grpc_port, infer, noisy, weight, own)


def thread_names(cgroup: TestCgroup) -> dict[int, tuple[int, str, str]]:
    """tid -> (pid, process name, thread name) of every thread in the cgroup now."""
    out = {}
    for pid in cgroup.pids():
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                out[int(tid)] = (pid, process, Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip())
            except OSError:
                pass
    return out


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_titles(cgroup: TestCgroup) -> dict[int, str]:
    """pid -> the title a process gave itself (vLLM's `VLLM::EngineCore_DP1`,
    `VLLM::Worker_TP0`): the comm keeps only 15 characters, so the ranks of
    one layout share a comm, and the full title is in the command line."""
    out = {}
    for pid in cgroup.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out[pid] = argv[0].decode(errors="replace").strip() if argv else ""
    return out


def process_cpus(pid: int) -> list[int]:
    """The CPUs a process's main thread may run on (vLLM's CPU build pins a
    rank's OpenMP threads, the main one among them, with VLLM_CPU_OMP_THREADS_BIND)."""
    return sorted(os.sched_getaffinity(pid))


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process so far, in ns, from the
    scheduler's own accounting (each thread's schedstat; 0 once it is gone):
    exact where /proc/PID/stat counts in clock ticks."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def worker_cpus(cgroup: TestCgroup) -> list[int]:
    """The CPUs vLLM pins its model worker to: where a neighbour delays it."""
    worker = next(tid for tid, (_, process, _) in thread_names(cgroup).items() if process == WORKER)
    return sorted(os.sched_getaffinity(worker))


class ThreadCensus:
    """tid -> (pid, process name, thread name) of every thread seen in the
    cgroup while the context lasts (every 50 ms): threads come and go, and
    rename themselves (a pool's thread starts under its creator's name), so
    every name a tid was seen under is kept beside the latest."""

    def __init__(self, cgroup: TestCgroup) -> None:
        self.cgroup = cgroup
        self.names: dict[int, tuple[int, str, str]] = {}
        self.every_name: dict[int, set[tuple[int, str, str]]] = defaultdict(set)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            # The latest names: a process takes its title (VLLM::EngineCore) after it starts.
            now = thread_names(self.cgroup)
            self.names.update(now)
            for tid, key in now.items():
                self.every_name[tid].add(key)
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> "ThreadCensus":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


class Neighbour:
    """CPU hogs, one on each of `cpus`, in their own service with more CPU
    weight than vLLM (as a pod with larger requests has)."""

    tids: set[int] = set()   # every hog ever started, for the references

    def __init__(self, cgroup: TestCgroup, weight: CpuWeight, cpus: list[int], settle_s: float = 0.3) -> None:
        self.cgroup, self.weight, self.cpus, self.settle_s, self.procs = cgroup, weight, cpus, settle_s, []

    def __enter__(self) -> "Neighbour":
        for cpu in self.cpus:
            p = self.cgroup.spawn(hog_argv(cpu), stdout=subprocess.DEVNULL)
            self.weight.add(p.pid)
            Neighbour.tids.add(p.pid)
            self.procs.append(p)
        # Each hog spinning on its CPU (an interpreter takes a while to start
        # on a busy machine), then settled there.
        deadline = time.monotonic() + HOG_START_S
        while time.monotonic() < deadline and any(cpu_seconds(p.pid) < HOG_SPUN_S for p in self.procs):
            time.sleep(0.02)
        time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)
        time.sleep(0.2)


def interleaved(blocks: int, neighbour: Callable[[], Neighbour],
                send: Callable[[str, int], list[dict]]) -> list[dict]:
    """The same requests without and with the neighbour, block after block;
    which comes first alternates, so a drift of the machine's load favours neither."""
    out: list[dict] = []
    for block in range(blocks):
        for mode in (("without", "with") if block % 2 == 0 else ("with", "without")):
            with neighbour() if mode == "with" else nullcontext():
                out += send(mode, block)
    return out


def wait_for_requests(agent: Agent, service: str, wanted: set[str], timeout: float = 60.0) -> dict[str, dict]:
    """The agent's request documents of `service` by id, once every wanted
    one is in (vLLM exports its spans in batches every 5 s) or the time is up."""
    deadline = time.monotonic() + timeout
    got: dict[str, dict] = {}
    while not wanted <= set(got) and time.monotonic() < deadline:
        status, body = http_get(agent.url + f"/api/v1/requests?service={service}", timeout=30)
        if status == 200:
            got = {r["request_id"]: r for r in json.loads(body)["requests"]}
        time.sleep(0.5)
    return got


def wait_for_engine(agent: Agent, service: str, requests: int, after: float = 0.0, timeout: float = 30.0) -> dict:
    """/api/v1/engines once the engine's histograms hold every request sent,
    from a scrape taken after `after` (Unix seconds; it is scraped every 5 s)."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = agent.get_json(f"/api/v1/engines?service={service}&since=3600")
        counts = [e["latency"].get("e2e", {}).get("count") for e in doc["engines"]]
        if counts and counts[0] is not None and counts[0] >= requests and doc["engines"][0]["end"] > after:
            break
        time.sleep(1.0)
    return doc
