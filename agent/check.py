"""`slatrace check`: every prerequisite, each with how to fix it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from agent.probe.mounts import find_cgroup2_mount
from agent.probe import features as feat


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def run_checks(proc: Path = Path("/proc")) -> list[Check]:
    checks: list[Check] = []

    status = (proc / "self" / "status").read_text()
    try:
        feat.check_privileges(status)
        checks.append(Check("privileges", True, "CAP_SYS_ADMIN, or CAP_BPF and CAP_PERFMON"))
    except feat.FeatureError as e:
        checks.append(Check("privileges", False, str(e)))

    bcc = importlib.util.find_spec("bcc") is not None
    checks.append(Check("bcc", bcc, "Debian's python3-bpfcc is importable" if bcc else
                        "the bcc Python module is missing: apt-get install python3-bpfcc, and run slatrace "
                        "from a venv made with --system-site-packages (make setup does both)"))

    headers = feat.kernel_headers_present()
    checks.append(Check("kernel-headers", headers, "BCC can find kernel headers" if headers else
                        "no kernel headers at /lib/modules/$(uname -r)/build: run 'make setup' (links "
                        "Debian's linux-headers-amd64) or set BCC_KERNEL_SOURCE"))

    # The kernel is asked for real: a map is created and closed whatever the
    # capability check above concluded, so a seccomp filter or an LSM shows.
    err = feat.try_bpf_map()
    checks.append(Check("bpf-map", not err, "created and closed a BPF array map" if not err else
                        feat.refusal("creating a BPF map (bpf())", err, status)))

    tracefs = feat.find_tracefs()
    checks.append(Check("tracefs", tracefs is not None, f"mounted at {tracefs}" if tracefs else
                        feat.tracefs_problem(mounts_text=(proc / "mounts").read_text())))
    if tracefs is not None:
        err = feat.try_tracepoint_event(tracefs)
        checks.append(Check("perf-event", not err, "opened and closed a sched_switch tracepoint event" if not err
                            else feat.refusal("opening the sched_switch tracepoint (perf_event_open())", err,
                                              status)))
    if tracefs is not None:
        for tp in feat.TRACEPOINTS:
            present = feat.exists(tracefs / "events" / "sched" / tp / "format")
            checks.append(Check(f"tracepoint:sched:{tp}", present, "present" if present else
                                f"sched:{tp} is missing or unreadable: needs a kernel with scheduler "
                                "tracepoints, and root to read tracefs"))
        try:
            states = feat.parse_switch_states((tracefs / "events/sched/sched_switch/format").read_text())
            checks.append(Check("preempt-flag", True, f"sched_switch prev_state preempt bit {states.preempt:#x}"))
        except (OSError, ValueError) as e:
            checks.append(Check("preempt-flag", False, f"cannot read sched_switch's format: {e}"))

    mount = find_cgroup2_mount((proc / "mounts").read_text())
    checks.append(Check("cgroup2", mount is not None, f"mounted at {mount}" if mount else
                        "no cgroup v2 hierarchy: mount -t cgroup2 none /sys/fs/cgroup/unified"))
    return checks
