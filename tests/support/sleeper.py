"""One thread that sleeps, wakes, and notes its own schedstat after every wake.

The kernel's run-queue accounting per wait, to set beside the tracepoints:
after each nanosleep it reads /proc/thread-self/schedstat (run_delay and the
run count) and the CLOCK_MONOTONIC time (the clock of tracefs' "mono" and of
bpf_ktime_get_ns), so each wait can be paired with the switch-in tracefs saw
between two notes. The notes go to OUT as JSON when the loop ends.

usage: sleeper.py ROUNDS SLEEP_US OUT
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    rounds, sleep_s, out = int(argv[1]), float(argv[2]) / 1e6, argv[3]
    fd = os.open(f"/proc/self/task/{os.getpid()}/schedstat", os.O_RDONLY)
    notes = []
    for _ in range(rounds):
        time.sleep(sleep_s)
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        _, run_delay, runs = (int(f) for f in os.pread(fd, 128, 0).split())
        notes.append((now, run_delay, runs))
    with open(out, "w") as f:
        json.dump({"tid": os.getpid(), "notes": notes}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
