"""`slatrace check`: every prerequisite, each with how to fix it."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from agent.probe import features as feat
from agent.probe.btf import BtfError, task_layout


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def run_checks(proc: Path = Path("/proc")) -> list[Check]:
    """The probe's own prerequisites (agent/probe/features.py, the list the
    agent stops at when it starts), and what BCC needs besides."""
    probe, _ = feat.prerequisites(proc)
    checks = [Check(p.name, p.ok, p.detail) for p in probe]
    bcc = importlib.util.find_spec("bcc") is not None
    checks.insert(1, Check("bcc", bcc, "Debian's python3-bpfcc is importable" if bcc else
                           "the bcc Python module is missing: apt-get install python3-bpfcc, and run slatrace "
                           "from a venv made with --system-site-packages (make setup does both)"))
    headers = feat.kernel_headers_present()
    checks.insert(2, Check("kernel-headers", headers, "BCC can find kernel headers" if headers else
                           "no kernel headers at /lib/modules/$(uname -r)/build: run 'make setup' (links "
                           "Debian's linux-headers-amd64) or set BCC_KERNEL_SOURCE"))
    checks.append(attachment())
    return checks


# What each attach mode adds per context switch on a switch-dense workload
# (a pinned `perf bench sched pipe`), all measured side by side in one run:
# BENCHMARKS.md, "Attach modes and the floor". The order is the agent's
# preference.
MODE_COST_NS = {"btf": 334, "raw": 437, "classic": 540}


def _cost(mode: str) -> str:
    best = min(MODE_COST_NS.values())
    if MODE_COST_NS[mode] == best:
        return f"the cheapest mode, ~{best} ns per context switch on a switch-dense workload (BENCHMARKS.md)"
    return (f"~{MODE_COST_NS[mode]} ns per context switch on a switch-dense workload, "
            f"{MODE_COST_NS[mode] / best:.2f}x the cheapest mode's (BENCHMARKS.md)")


def attachment(release: str | None = None) -> Check:
    """Which tracepoints the programs will attach to on this kernel, why, and
    what that costs against the cheapest mode. Classic ones work anywhere, so
    this never fails."""
    release = release or os.uname().release
    try:
        layout = task_layout()
    except BtfError as e:
        return Check("attachment", True, f"kernel {release}: classic tracepoints, because raw ones are not usable "
                     f"({e}): {_cost('classic')}, the kernel filling each tracepoint's record before the "
                     "program runs; the part of a wait the service's own CPU limit held cannot be told on them "
                     "(it counts as unknown, and cpu.stat's throttled time stands in per service)")
    where = (f"sched_switch passes no prev_state (kernels before 5.18), so it is read from "
             f"task_struct.{layout.state_field} at byte {layout.state_offset}"
             if layout.state_offset is not None else "sched_switch passes prev_state")
    recovery = ("a wait after a wake-up the kernel kept from the programs is recovered from "
                "task_struct.sched_info.last_queued and the run queue's clock"
                if layout.queue_clock is not None else
                f"a wait after a wake-up the kernel kept from the programs is lost, only counted "
                f"({layout.queue_clock_missing})")
    limit = (f"the part of each wait the service's own CPU limit held is read from cfs_rq."
             f"throttled_clock_{layout.limit_clock.kind}_time (cause cpu_limit)"
             if layout.limit_clock is not None else
             f"the part of a wait the service's own CPU limit held cannot be told from other waits "
             f"({layout.limit_clock_missing}): it counts as unknown, and cpu.stat's throttled time stands in "
             "per service")
    polls = ("a wait that began with the thread yielding (a loop polling for work) is told from a preemption "
             "by the system call saved on its kernel stack"
             if layout.syscall_site is not None else
             f"a wait that began with the thread yielding reads as a preemption ({layout.syscall_site_missing})")
    served = ("a request is followed to the processes that served it (an engine core of several) by the "
              "wake-ups across a service's processes (task_struct.tgid; the waker named at sched_waking)"
              if layout.tgid_offset is not None else
              "a request's delay counts every process of its service (task_struct has no tgid in the kernel's BTF)")
    details = (f"{where}; task_struct.pid at byte {layout.pid_offset} and .flags at {layout.flags_offset}, from "
               f"the kernel's BTF; {recovery}; {limit} (on classic tracepoints, which pass no task, it cannot be "
               f"told: --attach-mode classic counts it as unknown); {polls}; {served} (not on classic "
               f"tracepoints)")
    if not layout.btf_trace_ids:
        return Check("attachment", True, f"kernel {release}: raw tracepoints, because BTF-typed ones are not "
                     f"usable ({layout.btf_tracing_missing}): {_cost('raw')}; --attach-mode classic also works "
                     f"here; {details}")
    return Check("attachment", True, f"kernel {release}: btf tracepoints (BTF-typed, each task's state in "
                 f"task-local storage): {_cost('btf')}; raw ({MODE_COST_NS['raw'] / MODE_COST_NS['btf']:.2f}x) and "
                 f"classic ({MODE_COST_NS['classic'] / MODE_COST_NS['btf']:.2f}x) also work here (--attach-mode), "
                 f"and the agent takes raw ones, saying why, if the kernel refuses the BTF-typed programs; {details}")
