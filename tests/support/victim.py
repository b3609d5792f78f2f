"""A latency-sensitive-looking task: sleep a little, compute a little, repeat.

Each wakeup puts it on the run queue, so beside CPU hogs it collects many
short run-queue waits and preemptions. Single-threaded on purpose: its one tid
is the whole service.

usage: victim.py SECONDS [SLEEP_MS [WORK_MS]]
"""

from __future__ import annotations

import sys
import time


def run(seconds: float, sleep_ms: float, work_ms: float) -> int:
    """Loop until seconds of wall time have passed; returns the number of rounds."""
    end = time.monotonic() + seconds
    sleep_s = sleep_ms / 1000.0
    work_ns = int(work_ms * 1e6)
    rounds = 0
    while time.monotonic() < end:
        time.sleep(sleep_s)
        # CPU time, not wall time: the work per round stays the same however
        # long the task waits on the run queue in between.
        stop = time.thread_time_ns() + work_ns
        while time.thread_time_ns() < stop:
            pass
        rounds += 1
    return rounds


def main(argv: list[str]) -> int:
    seconds = float(argv[1])
    sleep_ms = float(argv[2]) if len(argv) > 2 else 1.0
    work_ms = float(argv[3]) if len(argv) > 3 else 0.3
    run(seconds, sleep_ms, work_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
