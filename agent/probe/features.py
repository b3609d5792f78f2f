"""What this kernel offers, detected once at start-up.

Everything the BPF program must know about the running kernel comes from here
and reaches the C code as validated -D macros (never by editing C text).
"""

from __future__ import annotations

import ast
import ctypes
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.errors import SlatraceError
from agent.probe.btf import TRACEPOINTS, BtfError, TaskLayout, task_layout
from agent.probe.mounts import find_cgroup2_mount

TRACEFS_CANDIDATES = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

# Which tracepoints the programs attach to: "btf" (BTF-typed tracepoints with
# task-local storage, 5.11+) where the kernel has them, else "raw" where the
# kernel's BTF gives task_struct's layout, "classic" anywhere; cheapest per
# event first. "auto" picks.
ATTACH_MODES = ("auto", "btf", "raw", "classic")

# Capability bits (linux/capability.h)
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
CAP_NAMES = {CAP_DAC_OVERRIDE: "CAP_DAC_OVERRIDE", CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH",
             CAP_SYS_ADMIN: "CAP_SYS_ADMIN", CAP_PERFMON: "CAP_PERFMON", CAP_BPF: "CAP_BPF"}

# bpf(2) and perf_event_open(2) numbers, for the real access probes below.
_SYSCALLS = {"x86_64": {"bpf": 321, "perf_event_open": 298}, "aarch64": {"bpf": 280, "perf_event_open": 241}}
BPF_MAP_CREATE = 0
BPF_MAP_TYPE_ARRAY = 2
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 8


class FeatureError(SlatraceError):
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
    # Every node was checked above to be a number, a name replaced by its value
    # or arithmetic: nothing else can run.
    return int(eval(compile(tree, "<format>", "eval"), {"__builtins__": {}}))  # noqa: S307


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


def missing_caps(caps: int) -> list[str]:
    """The capabilities missing to load and attach the programs (none with CAP_SYS_ADMIN)."""
    if caps >> CAP_SYS_ADMIN & 1:
        return []
    return [CAP_NAMES[bit] for bit in (CAP_BPF, CAP_PERFMON) if not caps >> bit & 1]


def check_privileges(status_text: str | None = None, euid: int | None = None) -> None:
    status_text = status_text if status_text is not None else Path("/proc/self/status").read_text()
    missing = missing_caps(effective_caps(status_text))
    if not missing:
        return
    names = " and ".join(missing)
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        raise FeatureError(
            f"slatrace runs as uid 0 but without {names}, which loading BPF programs needs (a container "
            f"drops them by default): add {names} to the container's capabilities (CAP_SYS_ADMIN also "
            "works, and is needed on kernels before 5.8)")
    raise FeatureError(
        f"slatrace runs as uid {euid} without {names}, which loading BPF programs needs: grant {names} "
        "(and CAP_DAC_READ_SEARCH to read tracefs), e.g. with systemd's AmbientCapabilities=, or run it as root")


def seccomp_mode(status_text: str) -> int:
    m = re.search(r"^Seccomp:\s*(\d)", status_text, re.M)
    return int(m.group(1)) if m else 0


def tracefs_problem(candidates: tuple[Path, ...] = TRACEFS_CANDIDATES,
                    mounts_text: str | None = None) -> str | None:
    """Why no tracefs is usable, in one sentence (None when one is)."""
    if find_tracefs(candidates) is not None:
        return None
    mounts_text = mounts_text if mounts_text is not None else Path("/proc/mounts").read_text()
    mounted = [Path(line.split()[1]) for line in mounts_text.splitlines()
               if len(line.split()) > 2 and line.split()[2] == "tracefs"]
    for path in mounted:
        try:
            (path / "events" / "sched" / "sched_switch" / "format").open().close()
        except PermissionError:
            try:
                mode = f"mode {path.stat().st_mode & 0o777:04o}"
            except OSError:
                mode = "not readable"
            return (f"tracefs is mounted at {path} but this process may not read it ({mode}): a non-root uid "
                    "needs CAP_DAC_READ_SEARCH besides CAP_BPF and CAP_PERFMON to read the tracepoint formats")
        except OSError:
            continue
    if mounted:
        return (f"tracefs is mounted at {mounted[0]} but has no sched:sched_switch event: the kernel lacks "
                "scheduler tracepoints (CONFIG_TRACEPOINTS)")
    return ("tracefs is not mounted, so the scheduler tracepoints cannot be found: mount it with "
            "'mount -t tracefs nodev /sys/kernel/tracing' (make setup does this)")


def syscall(name: str, *args) -> int:
    """The syscall's result, or -errno."""
    nr = _SYSCALLS.get(os.uname().machine, {}).get(name)
    if nr is None:
        return -errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    res = libc.syscall(ctypes.c_long(nr), *args)
    return res if res >= 0 else -ctypes.get_errno()


def try_bpf_map() -> int:
    """Create (and close) a one-slot BPF array map: 0, or the errno that refused it.

    Before 5.11 the kernel charges map memory to the user's locked memory
    against RLIMIT_MEMLOCK and answers EPERM past it: the programs' maps
    (tens of MiB, charged to root whichever process made them) are past the
    default limit, so a refusal is retried once with the limit lifted, as
    BCC and libbpf do (CAP_SYS_RESOURCE, which the agent holds, allows it)."""
    attr = (ctypes.c_uint32 * 32)(BPF_MAP_TYPE_ARRAY, 4, 4, 1)  # type, key size, value size, entries
    for attempt in range(2):
        fd = syscall("bpf", ctypes.c_int(BPF_MAP_CREATE), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
        if fd >= 0:
            os.close(fd)
            return 0
        if -fd != errno.EPERM or attempt or not lift_memlock_limit():
            return -fd
    return errno.EPERM


def lift_memlock_limit() -> bool:
    """RLIMIT_MEMLOCK raised to unlimited; False if it was already, or may not be."""
    import resource  # noqa: PLC0415  (only where a map was refused)

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == hard == resource.RLIM_INFINITY:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        return False
    return True


def try_tracepoint_event(tracefs: Path, event: str = "sched/sched_switch") -> int:
    """Open (and close) a perf event on a tracepoint on CPU 0, as attaching a
    program to it does: 0, or the errno that refused it."""
    try:
        tp_id = int((tracefs / "events" / event / "id").read_text())
    except PermissionError:
        return errno.EACCES
    except (OSError, ValueError):
        return errno.ENOENT
    attr = (ctypes.c_uint64 * 16)()
    attr[0] = PERF_TYPE_TRACEPOINT | (ctypes.sizeof(attr) << 32)  # type, size
    attr[1] = tp_id                                                # config
    attr[5] = 1                                                    # flags: disabled
    fd = syscall("perf_event_open", ctypes.byref(attr), ctypes.c_int(-1), ctypes.c_int(0), ctypes.c_int(-1),
                  ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        return -fd
    os.close(fd)
    return 0


def refusal(what: str, err: int, status_text: str) -> str:
    """Name what blocked `what` (a failed bpf() or perf_event_open()) in one sentence."""
    caps = effective_caps(status_text)
    missing = missing_caps(caps)
    if err in (errno.EPERM, errno.EACCES):
        if missing:
            return f"{what} was refused: this process lacks {' and '.join(missing)}"
        if seccomp_mode(status_text) == 2:
            return (f"{what} was refused although the process holds the capabilities: a seccomp filter blocks it "
                    "(the containers-common profile of CRI-O and podman allows bpf() only with CAP_SYS_ADMIN); "
                    "run under a profile that allows bpf and perf_event_open: containerd's RuntimeDefault, or the "
                    "Localhost profile deploy/seccomp/slatrace.json")
        return (f"{what} was refused although the process holds the capabilities: check "
                "kernel.unprivileged_bpf_disabled, kernel.perf_event_paranoid and any LSM (SELinux, AppArmor) policy")
    if err == errno.ENOSYS:
        return f"{what} is not available: the kernel lacks it or a seccomp filter answers ENOSYS"
    return f"{what} failed: {os.strerror(err)}"


@dataclass(frozen=True)
class Prerequisite:
    """One thing the probe needs: whether it holds here, and what it found or how to fix it."""

    name: str
    ok: bool
    detail: str


def prerequisites(proc: Path = Path("/proc")) -> tuple[list[Prerequisite], dict]:
    """Every prerequisite of the probe, in the order a fix should go, each
    asked of the kernel for real (a map is created, a tracepoint opened); and
    what was found on the way (tracefs, the switch states, the cgroup2 mount)
    for detect(). `slatrace check` lists them all; detect() stops at the
    first that fails."""
    out: list[Prerequisite] = [kernel_version()]
    found: dict = {}
    status = (proc / "self" / "status").read_text()
    try:
        check_privileges(status)
        out.append(Prerequisite("privileges", True, "CAP_SYS_ADMIN, or CAP_BPF and CAP_PERFMON"))
    except FeatureError as e:
        out.append(Prerequisite("privileges", False, str(e)))
    # Asked of the kernel whatever the capability check concluded, so that a
    # seccomp filter or an LSM shows.
    err = try_bpf_map()
    out.append(Prerequisite("bpf-map", not err, "created and closed a BPF array map" if not err else
                            refusal("creating a BPF map (bpf())", err, status)))
    tracefs = find_tracefs()
    out.append(Prerequisite("tracefs", tracefs is not None, f"mounted at {tracefs}" if tracefs else
                            tracefs_problem(mounts_text=(proc / "mounts").read_text())))
    if tracefs is not None:
        found["tracefs"] = tracefs
        err = try_tracepoint_event(tracefs)
        out.append(Prerequisite("perf-event", not err, "opened and closed a sched_switch tracepoint event"
                                if not err else refusal("opening the sched_switch tracepoint (perf_event_open())",
                                                        err, status)))
        for tp in TRACEPOINTS:
            present = exists(tracefs / "events" / "sched" / tp / "format")
            out.append(Prerequisite(f"tracepoint:sched:{tp}", present, "present" if present else
                                    f"the kernel has no sched:{tp} tracepoint, which slatrace needs (a kernel "
                                    "built with CONFIG_TRACEPOINTS and the scheduler events)"))
        try:
            states = parse_switch_states((tracefs / "events/sched/sched_switch/format").read_text())
            found["states"] = states
            out.append(Prerequisite("preempt-flag", True, f"sched_switch prev_state preempt bit {states.preempt:#x}"))
        except (OSError, ValueError) as e:
            out.append(Prerequisite("preempt-flag", False, f"cannot read the preemption flag from sched_switch's "
                                    f"format ({e}); this kernel's tracepoint layout is not supported"))
    mounts = (proc / "mounts").read_text()
    mount = find_cgroup2_mount(mounts)
    if mount is not None:
        found["cgroup2"] = Path(mount)
    out.append(Prerequisite("cgroup2", mount is not None, f"mounted at {mount}" if mount else
                            cgroup_v1_only_problem(mounts)))
    return out, found


# The oldest kernel the programs load on: the BPF ring buffer (5.8) carries
# the per-request event stream; bpf_probe_read_kernel is 5.5.
MIN_KERNEL = (5, 8)


def kernel_version(release: str | None = None) -> Prerequisite:
    release = release or os.uname().release
    m = re.match(r"(\d+)\.(\d+)", release)
    if m is None or (int(m.group(1)), int(m.group(2))) >= MIN_KERNEL:
        return Prerequisite("kernel", True, f"{release} (5.8 or later)")
    return Prerequisite("kernel", False, f"kernel {release} is older than 5.8, which slatrace's BPF programs need "
                        "(the BPF ring buffer): run it on a node with kernel 5.8 or later (docs/kernels.md)")


def cgroup_v1_only_problem(mounts_text: str) -> str:
    """Why a host without a cgroup v2 hierarchy cannot be served, and the fix.

    The programs tell services apart by the cgroup v2 id of the running task
    (bpf_get_current_cgroup_id). On a host whose init system places processes
    in cgroup v1 hierarchies only, every process sits in the v2 root, so the
    id is the same for all of them: mounting cgroup2 by hand would not change
    that, and per-service figures would silently all read "host"."""
    v1 = sorted({opt for line in mounts_text.splitlines() if len(line.split()) > 3 and line.split()[2] == "cgroup"
                 for opt in line.split()[3].split(",") if opt in V1_CONTROLLERS})
    where = f"this host places processes in cgroup v1 hierarchies only ({', '.join(v1)})" if v1 else \
        "no cgroup hierarchy is mounted"
    return (f"no cgroup v2 hierarchy is mounted: {where}, where every process has the same cgroup v2 id and "
            "slatrace could not tell services apart; boot the node with cgroup v2 (kernel command line "
            "systemd.unified_cgroup_hierarchy=1, the default of current distributions and what Kubernetes "
            "recommends) or systemd's hybrid layout, which places processes in a cgroup v2 hierarchy too")


# cgroup v1 controllers, to name the hierarchies a v1-only host mounts.
V1_CONTROLLERS = frozenset({"cpu", "cpuacct", "cpuset", "memory", "blkio", "pids", "devices", "freezer", "net_cls",
                            "net_prio", "perf_event", "hugetlb", "rdma", "misc"})


def detect() -> Features:
    """Detect everything the probe needs, or raise FeatureError with the fix
    of the first prerequisite that fails."""
    checks, found = prerequisites()
    for c in checks:
        if not c.ok:
            raise FeatureError(c.detail)
    try:
        layout, why_not = task_layout(), None
    except BtfError as e:
        layout, why_not = None, str(e)
    return Features(tracefs=found["tracefs"], states=found["states"], cgroup2=found["cgroup2"],
                    task_layout=layout, raw_unavailable=why_not)


def kernel_headers_present(release: str | None = None) -> bool:
    release = release or os.uname().release
    return bool(os.environ.get("BCC_KERNEL_SOURCE")) or exists(Path(f"/lib/modules/{release}/build/include"))
