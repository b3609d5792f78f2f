"""What this kernel offers, detected once at start-up.

Everything the BPF program must know about the running kernel comes from here
and reaches the C code as validated -D macros (never by editing C text).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.identity.cgroups import find_cgroup2_mount
from agent.probe.btf import BtfError, TaskLayout, task_layout

TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
TRACEPOINTS = (
    "sched_switch",
    "sched_wakeup",
    "sched_wakeup_new",
    "sched_migrate_task",
    "sched_process_fork",
    "sched_process_exit",
)

# Capability bits (linux/capability.h)
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


class FeatureError(Exception):
    """A prerequisite is missing; the message is one sentence with the fix."""


@dataclass(frozen=True)
class SwitchStates:
    """prev_state bits of sched_switch, read from its print fmt."""

    preempt: int   # TASK_REPORT_MAX (printed "+"): involuntary switch
    d: int         # uninterruptible sleep
    dead: int      # X | Z: the task is exiting


@dataclass(frozen=True)
class Features:
    tracefs: Path
    states: SwitchStates
    cgroup2: Path
    # task_struct offsets for the raw-tracepoint programs, from the kernel's
    # BTF; None (and the reason) when only classic tracepoints can be used.
    task_layout: TaskLayout | None = None
    raw_unavailable: str | None = None


def exists(path: Path) -> bool:
    """Path.exists() that answers False where the caller may not look (tracefs
    is root-only), instead of raising."""
    try:
        return path.exists()
    except OSError:
        return False


def find_tracefs(candidates: tuple[Path, ...] = TRACEFS_CANDIDATES) -> Path | None:
    for path in candidates:
        if exists(path / "events" / "sched" / "sched_switch" / "format"):
            return path
    return None


def _eval_int(expr: str) -> int:
    """Evaluate a C integer expression of literals, | + - << >> & and parens."""
    tree = ast.parse(expr.strip(), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.BitOr, ast.BitAnd,
               ast.Add, ast.Sub, ast.LShift, ast.RShift, ast.UnaryOp, ast.Invert)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or (isinstance(node, ast.Constant) and not isinstance(node.value, int)):
            raise ValueError(f"unexpected token in {expr!r}")
    return int(eval(compile(tree, "<format>", "eval"), {"__builtins__": {}}))


def parse_switch_states(format_text: str) -> SwitchStates:
    """Read the preempt bit and state flags from sched_switch's print fmt.

    The preempt bit is TASK_REPORT_MAX on current kernels and TASK_STATE_MAX on
    old ones; the format prints it as "+", so take it from there.
    """
    fmt = next((line for line in format_text.splitlines() if line.startswith("print fmt:")), "")
    plus = fmt.find('? "+"')
    start = fmt.rfind("REC->prev_state & ", 0, plus)
    if plus < 0 or start < 0:
        raise ValueError("sched_switch format has no preempt (\"+\") flag")
    preempt = _eval_int(fmt[start + len("REC->prev_state & "):plus])
    flags = {name: int(value, 0) for value, name in re.findall(r'\{ *(0x[0-9a-fA-F]+|\d+), *"(\w)" *\}', fmt)}
    if "D" not in flags:
        raise ValueError("sched_switch format names no D state")
    dead = flags.get("X", 0) | flags.get("Z", 0)
    if preempt <= 0 or preempt & (preempt - 1):
        raise ValueError(f"preempt flag {preempt:#x} is not a single bit")
    return SwitchStates(preempt=preempt, d=flags["D"], dead=dead)


def effective_caps(status_text: str) -> int:
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.M)
    return int(m.group(1), 16) if m else 0


def check_privileges(status_text: str | None = None) -> None:
    status_text = status_text if status_text is not None else Path("/proc/self/status").read_text()
    caps = effective_caps(status_text)

    def has(bit: int) -> bool:
        return bool(caps >> bit & 1)

    if has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON)):
        return
    raise FeatureError(
        "slatrace needs root or the capabilities CAP_BPF and CAP_PERFMON (CAP_SYS_ADMIN on "
        "older kernels) to load BPF programs: run it as root, or grant those capabilities to its process or container"
    )


def detect() -> Features:
    """Detect everything the probe needs, or raise FeatureError with the fix."""
    check_privileges()
    tracefs = find_tracefs()
    if tracefs is None:
        raise FeatureError(
            "tracefs is not mounted, so the scheduler tracepoints cannot be found: "
            "mount it with 'mount -t tracefs nodev /sys/kernel/tracing' (make setup does this)"
        )
    for tp in TRACEPOINTS:
        if not exists(tracefs / "events" / "sched" / tp / "format"):
            raise FeatureError(f"the kernel has no sched:{tp} tracepoint, which slatrace needs "
                               "(a kernel built with CONFIG_TRACEPOINTS and the scheduler events)")
    try:
        states = parse_switch_states((tracefs / "events/sched/sched_switch/format").read_text())
    except (OSError, ValueError) as e:
        raise FeatureError(f"cannot read the preemption flag from sched_switch's format ({e}); "
                           "this kernel's tracepoint layout is not supported") from None
    mount = find_cgroup2_mount(Path("/proc/mounts").read_text())
    if mount is None:
        raise FeatureError("no cgroup v2 hierarchy is mounted, and services are told apart by their "
                           "cgroup v2 id: mount one with 'mount -t cgroup2 none /sys/fs/cgroup/unified'")
    try:
        layout, why_not = task_layout(), None
    except BtfError as e:
        layout, why_not = None, str(e)
    return Features(tracefs=tracefs, states=states, cgroup2=Path(mount), task_layout=layout,
                    raw_unavailable=why_not)


def kernel_headers_present(release: str | None = None) -> bool:
    release = release or os.uname().release
    return bool(os.environ.get("BCC_KERNEL_SOURCE")) or exists(Path(f"/lib/modules/{release}/build/include"))
