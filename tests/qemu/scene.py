"""One kernel's row of the matrix, run on the kernel under test (in a qemu
guest, or on the host for the first row): the documented set-up, then in
every attach mode the agent offers here, the real agent beside a hog and a
victim sharing one CPU, against an exact reference from the raw tracefs
events of the same run; then, on raw tracepoints, the recovery of waits after
wake-ups the programs miss (tests/support/missed_wakeups.py), which reads
kernel structs at this kernel's BTF offsets; then, on BTF-typed and raw
tracepoints, a service throttled by its own CPU limit, alone on a CPU and
beside a heavier neighbour (tests/support/cpu_limit.py), whose limit part the
programs read from this kernel's throttle bookkeeping; then two threads
spinning on one CPU, whose waits the programs stream merged
(tests/support/merged.py). Writes everything measured as JSON; the test on
the host judges it (tests/qemu/test_kernels.py).

usage: python -m tests.qemu.scene OUT.json [SECONDS]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tests.support import cpu_limit, merged, missed_wakeups
from tests.support.agent import REPO, SLATRACE, Agent
from tests.support.tracefs import TraceRecorder, percentile, reference
from tests.support.workload import (TestCgroup, held_for_go, hog_argv, victim_argv, wait_blocked_in,
                                    wait_zombie)

# The victim at nice 10 beside a nice-0 hog on one CPU waits milliseconds per
# wakeup, long against the emulator's noise (at nice 0 it preempts the hog
# at once and its waits are tens of microseconds).
VICTIM_NICE = 10
SHARED_CPU = 1
INTERVAL = 0.5
# The throttled service's quota and period: a throttle (0.4 s) outlasts a
# snapshot of the probe under the emulator (up to ~0.2 s there: an RCU grace
# period), which quiet_edge() must take inside one.
LIMIT_QUOTA_US = 100_000
LIMIT_PERIOD_US = 500_000
LIMIT_SECONDS = 3.0
# Three guests share two host CPUs under TCG: a snapshot there can take long
# enough to straddle a switch-in many times before one fits a throttle.
EDGE_TIMEOUT_S = 240.0


def _check() -> dict:
    done = subprocess.run(SLATRACE + ["check", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        doc = {"ok": False, "checks": [], "stdout": done.stdout[-2000:]}
    doc["exit"] = done.returncode
    doc["stderr"] = done.stderr[-2000:]
    return doc


def _setup() -> dict:
    done = subprocess.run([str(REPO / "scripts" / "setup.sh"), "--host"], capture_output=True, text=True,
                          timeout=600)
    return {"exit": done.returncode, "log": (done.stdout + done.stderr)[-3000:]}


def _offered_modes() -> list[str]:
    """The attach modes the agent offers on this kernel: BTF-typed where it has
    task-local storage, raw where the BTF gives what it needs, classic always."""
    from agent.probe.btf import BtfError, task_layout

    try:
        layout = task_layout()
    except BtfError:
        return ["classic"]
    return (["btf"] if layout.btf_trace_ids else []) + ["raw", "classic"]


def _metric_values(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def run_mode(mode: str, seconds: float) -> dict:
    row: dict = {"mode": mode}
    with TestCgroup("hog") as hog, TestCgroup("victim") as victim_cg:
        config = Path("/tmp") / f"slatrace-scene-{mode}.yaml"
        config.write_text("services:\n"
                          f"  - name: hog\n    cgroup: \"{hog.path}\"\n"
                          f"  - name: victim\n    cgroup: \"{victim_cg.path}\"\n")
        # BCC's compile takes 10-60 s under the emulator.
        agent = Agent("--attach-mode", mode, config=config, interval=INTERVAL, ready_timeout=240)
        try:
            agent.__enter__()
        except Exception as e:  # noqa: BLE001  (recorded for the host to judge)
            row["start_error"] = str(e)[-3000:]
            return row
        try:
            row["ready_seconds"] = agent.ready_after
            hog.spawn(hog_argv(cpu=SHARED_CPU))
            time.sleep(0.5)
            # The victim waits in its cgroup for the go, and the recording
            # starts then. Its shell's start-up waits (many in a guest, where
            # binaries are read over 9p) fall before or after its move into the
            # cgroup, so the agent charges some of them to the victim: they are
            # all collected before the go, and the victim's count and wait
            # total are what the agent's record of it grew by from then to the
            # end. (A window of intervals "since the go" could lose the interval
            # holding the go: it ends after the go, but may end before the
            # agent reads its clock for the query, which under the emulator
            # takes a good part of an interval.)
            victim = victim_cg.spawn(held_for_go(["nice", "-n", str(VICTIM_NICE), "taskset", "-c", str(SHARED_CPU),
                                                  *victim_argv(seconds, sleep_ms=2.0, work_ms=0.5)]),
                                     stdin=subprocess.PIPE)
            wait_blocked_in(victim_cg, victim.pid)
            _wait_collections(agent, 2)
            before = _everything_of(agent, "victim")
            with TraceRecorder() as rec:
                go = time.time()
                victim.stdin.write(b"go\n")
                victim.stdin.close()
                wait_zombie(victim.pid, timeout=seconds * 4 + 60)
                tids = {int(t) for t in os.listdir(f"/proc/{victim.pid}/task")}
                _wait_collections(agent, 2)  # the victim's last waits are collected
                since = time.time() - go
                records = agent.get_json(f"/api/v1/attribution?service=victim&since={since:.3f}")["attribution"]
                after = _everything_of(agent, "victim")
                status, body = agent_get(agent, "/metrics")
                readyz = agent_get(agent, "/readyz")
            victim.wait()
        finally:
            row["stop_exit"] = agent.stop(timeout=60)
            row["log_tail"] = agent.output()[-4000:]
    ref = reference(rec.events, tids)
    row["agent"] = records[0] if records else None
    if row["agent"] is not None:
        # Count and total exactly from the go (above); quantiles and blame from
        # the intervals since it.
        row["agent"]["runq"]["count"] = after["count"] - before["count"]
        row["agent"]["runq"]["wait_seconds"] = after["wait_seconds"] - before["wait_seconds"]
    row["reference"] = {"count": len(ref.runq_waits_ns), "wait_seconds": ref.total_wait_s,
                        "p50": percentile(ref.runq_waits_ns, 0.5) / 1e9 if ref.runq_waits_ns else None,
                        "p99": percentile(ref.runq_waits_ns, 0.99) / 1e9 if ref.runq_waits_ns else None,
                        "p985": percentile(ref.runq_waits_ns, 0.985) / 1e9 if ref.runq_waits_ns else None,
                        "p995": percentile(ref.runq_waits_ns, 0.995) / 1e9 if ref.runq_waits_ns else None,
                        "preemptions": len(ref.preemptions), "gaps": ref.gaps}
    metrics = body.decode(errors="replace") if status == 200 else ""
    row["map_errors"] = _metric_values(metrics, "slatrace_bpf_map_errors_total")
    row["waits_missing"] = _metric_values(metrics, "slatrace_waits_missing_total")
    row["waits_seen"] = _metric_values(metrics, "slatrace_waits_seen_total")
    row["program_misses"] = _metric_values(metrics, "slatrace_bpf_program_misses_total")
    row["readyz"] = {"status": readyz[0], "body": readyz[1].decode(errors="replace")[-2000:]}
    return row


def cpu_limit_scenes(modes: list[str]) -> dict:
    """The throttled service in each mode that can tell the limit's part
    alone, and beside the neighbour in the first (the one `auto` takes); and
    the kernel's BTF evidence of the bookkeeping the programs read."""
    from agent.probe import features
    from agent.probe.loader import MapSizes, Probe

    out: dict = {"bookkeeping": cpu_limit.btf_bookkeeping(), "rows": []}
    f = features.detect()
    telling = [m for m in modes if m != "classic"]   # classic cannot tell (tests/kernel/test_cpu_limit.py)
    for mode in telling:
        try:
            probe = Probe.load(f, MapSizes(event_rate=10_000_000), tracepoints=mode)
        except Exception:  # noqa: BLE001  (recorded for the host to judge)
            out["rows"].append({"mode": mode, "neighbour": False, "error": traceback.format_exc()[-3000:]})
            continue
        try:
            for neighbour in (False, True) if mode == telling[0] else (False,):
                try:
                    out["rows"].append(cpu_limit.measure(probe, LIMIT_SECONDS, neighbour, quota_us=LIMIT_QUOTA_US,
                                                         period_us=LIMIT_PERIOD_US, edge_timeout=EDGE_TIMEOUT_S))
                except Exception:  # noqa: BLE001
                    out["rows"].append({"mode": mode, "neighbour": neighbour, "error": traceback.format_exc()[-3000:]})
        finally:
            probe.close()
    return out


def spinning_scene() -> dict:
    """The spinning threads under the mode `auto` takes, the stream not rate-limited."""
    from agent.probe import features
    from agent.probe.loader import MapSizes, Probe

    probe = Probe.load(features.detect(), MapSizes(event_rate=10_000_000))
    try:
        # A guest has 2 GiB: a smaller trace buffer than the host's.
        return merged.measure(probe, seconds=1.0, cpu=SHARED_CPU, buffer_kb=65536)
    except Exception:  # noqa: BLE001  (recorded for the host to judge)
        return {"error": traceback.format_exc()[-3000:]}
    finally:
        probe.close()


def _everything_of(agent: Agent, service: str) -> dict:
    """The agent's run-queue count and wait total of a service over all it holds."""
    records = agent.get_json(f"/api/v1/attribution?service={service}&since=86400")["attribution"]
    runq = records[0]["runq"] if records else {"count": 0, "wait_seconds": 0.0}
    return {"count": runq["count"], "wait_seconds": runq["wait_seconds"]}


def _wait_collections(agent: Agent, n: int, timeout: float = 120.0) -> None:
    """Until the agent has collected n more intervals: under the emulator a
    collection can fall a few intervals behind the clock."""
    def collected() -> float:
        status, body = agent_get(agent, "/metrics")
        values = _metric_values(body.decode(errors="replace"), "slatrace_intervals_collected_total")
        return next(iter(values.values()), 0.0) if status == 200 else 0.0

    start, deadline = collected(), time.monotonic() + timeout
    while collected() < start + n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent collected no {n} intervals in {timeout:.0f} s")
        time.sleep(INTERVAL / 2)


def agent_get(agent: Agent, path: str) -> tuple[int, bytes]:
    from tests.support.agent import http_get

    return http_get(agent.url + path, timeout=30)


def main(argv: list[str]) -> int:
    # This process, its trace readers and the agent (which inherits it) stay
    # off the shared CPU: there the victim waits behind the hog alone.
    os.sched_setaffinity(0, {cpu for cpu in os.sched_getaffinity(0) if cpu != SHARED_CPU})
    out = Path(argv[1])
    seconds = float(argv[2]) if len(argv) > 2 else 8.0
    doc: dict = {"kernel": platform.release(), "cpus": os.cpu_count(), "rows": []}
    t0 = time.monotonic()
    try:
        doc["check_before"] = _check()
        doc["setup"] = _setup()
        doc["check_after"] = _check()
        doc["modes"] = _offered_modes()
        for mode in doc["modes"]:
            doc["rows"].append(run_mode(mode, seconds))
        if "raw" in doc["modes"]:
            doc["recovery"] = missed_wakeups.measure()
        doc["cpu_limit"] = cpu_limit_scenes(doc["modes"])
        doc["spinning"] = spinning_scene()
    except Exception:  # noqa: BLE001  (the host reports it)
        doc["error"] = traceback.format_exc()[-4000:]
    doc["seconds"] = time.monotonic() - t0
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
