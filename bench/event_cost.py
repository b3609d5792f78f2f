"""`python -m bench.event_cost`: the agent's CPU per exact wait event.

For the services whose requests it attributes, the agent streams every wait
of their threads through the ring buffer and keeps them in the event store; a
real engine's ~60 threads make thousands a second. This loads the probe, puts
a hog on every CPU and a few victims that sleep 0.2 ms and work 0.05 ms in a
watched cgroup, and drains the ring buffer into an EventLog every 0.1 s, as the
daemon does, timing the draining thread's CPU: µs per event and % of a core.

--spinners N puts instead N threads that spin on sched_yield() on one CPU in
the watched cgroup, as the shared-memory readers of an engine with several
cores do: a flood of short waits, the rate the stream and the agent sustain
(no rate limit, unless --event-rate sets one; dropped events are counted).

--against REV measures the same in a checkout of REV too (a git worktree),
alternating the two round by round: each measurement runs in a process of its
own with that checkout's `agent` and `tests` first on the path.

usage: sudo .venv/bin/python -m bench.event_cost [--against REV] [--rounds N] [--seconds S]
                                                 [--spinners N] [--event-rate PER_CPU_PER_S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SPIN = "import os, time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    os.sched_yield()\n"


def measure(seconds: float, victims: int, spinners: int = 0, event_rate: int = 10_000_000) -> dict:
    """One measurement with whichever `agent` is first on the path."""
    from agent.daemon import EVENT_DRAIN_S
    from agent.probe import features
    from agent.probe.loader import MapSizes, Probe
    from agent.store.events import EventLog
    from tests.support.workload import TestCgroup, hog_argv, victim_argv

    probe = Probe.load(features.detect(), MapSizes(event_rate=round(event_rate * (1 << 30) / 1e9)))
    # Checkouts before the bulk decode have only drain_events().
    drain = getattr(probe, "drain_event_rows", probe.drain_events)
    dropped = getattr(probe, "dropped_events", lambda: 0)
    try:
        with TestCgroup("bench-noisy") as noisy, TestCgroup("bench-watched") as watched:
            if spinners:
                for _ in range(spinners):
                    watched.spawn(["taskset", "-c", "0", sys.executable, "-c", SPIN.format(seconds=seconds + 3)])
            else:
                for cpu in range(os.cpu_count() or 1):
                    noisy.spawn(hog_argv(cpu=cpu))
                for _ in range(victims):
                    watched.spawn(victim_argv(seconds + 3, sleep_ms=0.2, work_ms=0.05))
            probe.watch({watched.id})
            log = EventLog(retention_ns=60 * 10**9)
            time.sleep(1)
            drain()
            probe.snapshot()   # the kernel's count of waits starts here
            dropped_before = dropped()
            cpu = 0.0
            events = waits = drains = 0
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                time.sleep(EVENT_DRAIN_S)
                t0 = time.thread_time()
                batch = drain()
                log.add(batch)
                cpu += time.thread_time() - t0
                events += len(batch)
                # A record may hold several waits of a spinning loop (checkouts before that: one each).
                names = getattr(getattr(batch, "dtype", None), "names", None) or ()
                waits += int(batch["waits"].sum()) if "waits" in names else len(batch)
                drains += 1
            lost = dropped() - dropped_before
            made = sum(b.count for b in probe.snapshot().hists.get((watched.id, 0), {}).values())
    finally:
        probe.close()
    return {"events": events, "waits": waits, "kernel_waits": made, "drains": drains, "seconds": seconds,
            "cpu_s": cpu, "dropped": lost,
            "us_per_event": cpu * 1e6 / max(events, 1), "us_per_wait": cpu * 1e6 / max(waits, 1),
            "core_pct": 100 * cpu / seconds}


def run_in(checkout: Path, seconds: float, victims: int, spinners: int = 0, event_rate: int = 10_000_000) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", str(seconds), str(victims),
                           str(spinners), str(event_rate)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement in {checkout} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.event_cost", description=__doc__.splitlines()[0])
    p.add_argument("--against", metavar="REV", help="also measure this git revision, alternating with this checkout")
    p.add_argument("--rounds", type=int, default=3, help="measurements per checkout (default 3)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each measurement (default 10)")
    p.add_argument("--victims", type=int, default=4, help="waking tasks in the watched cgroup (default 4)")
    p.add_argument("--spinners", type=int, default=0,
                   help="instead, threads spinning on sched_yield() on CPU 0 in the watched cgroup: a flood")
    p.add_argument("--event-rate", type=int, default=10_000_000,
                   help="the stream's rate limit, events per CPU per second (default: none reached)")
    args = p.parse_args(argv)
    from bench.run import ROOT   # here: a measurement's process has another checkout's packages first
    if os.geteuid() != 0:
        print("bench.event_cost: loading BPF programs needs root: run it with sudo", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="slatrace-event-cost-") as tmp:
        arms = {"this checkout": ROOT}
        if args.against:
            other = Path(tmp) / "against"
            done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"bench.event_cost: cannot check out {args.against}: {done.stderr.strip()}", file=sys.stderr)
                return 1
            arms = {args.against: other, **arms}
        try:
            results: dict[str, list[dict]] = {name: [] for name in arms}
            for i in range(args.rounds):
                order = list(arms) if i % 2 == 0 else list(arms)[::-1]
                for name in order:
                    r = run_in(arms[name], args.seconds, args.victims, args.spinners, args.event_rate)
                    results[name].append(r)
                    print(f"round {i + 1}/{args.rounds} {name}: {r['events'] / r['seconds']:,.0f} records/s "
                          f"holding {r.get('waits', r['events']) / r['seconds']:,.0f} waits/s "
                          f"(the kernel counted {r.get('kernel_waits', 0) / r['seconds']:,.0f}/s), "
                          f"{r.get('dropped', 0):,} dropped, {r['us_per_event']:.2f} µs CPU per record, "
                          f"{r['core_pct']:.2f}% of a core", flush=True)
        except RuntimeError as e:
            print(f"bench.event_cost: {e}", file=sys.stderr)
            return 1
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                               capture_output=True)
    for name, rs in results.items():
        print(f"{name}: median {statistics.median(r['us_per_event'] for r in rs):.2f} µs per record, "
              f"{statistics.median(r['events'] / r['seconds'] for r in rs):,.0f} records/s, "
              f"{statistics.median(r.get('waits', r['events']) / r['seconds'] for r in rs):,.0f} waits/s, "
              f"{statistics.median(r.get('dropped', 0) for r in rs):,.0f} dropped, "
              f"{statistics.median(r['core_pct'] for r in rs):.2f}% of a core")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        here = Path(__file__).resolve().parent   # the checkout's packages, not bench/'s files
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
        extra = [int(a) for a in sys.argv[4:6]]   # spinners and the event rate
        print(json.dumps(measure(float(sys.argv[2]), int(sys.argv[3]), *extra)))
        sys.exit(0)
    sys.exit(main())
