"""Per-program run-time statistics without touching the host's setting.

The kernel counts run_cnt/run_time_ns of every BPF program only while stats
are enabled, and counting costs every program on the host (two clock reads
per run). The sysctl kernel.bpf_stats_enabled is global and outlives the agent
if it is killed; the bpf(2) command BPF_ENABLE_STATS instead returns an fd,
the kernel counts its holders, and stats go off when the last fd closes — on
SIGKILL too. The agent holds such an fd only while sampling (by default 1 s
every 60 s, or one window on SIGUSR1), so its self-cost counters move in
samples and the ratio run_seconds / events is the per-event cost. Needs
CAP_SYS_ADMIN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import time

from agent.errors import SlatraceError
from agent.workers import Worker, WorkerHandle

__all__ = ["BPF_ENABLE_STATS", "BpfStatsSampler", "StatsUnavailable", "enable_run_time_stats"]

log = logging.getLogger(__name__)

BPF_ENABLE_STATS = 32       # enum bpf_cmd (include/uapi/linux/bpf.h)
BPF_STATS_RUN_TIME = 0      # enum bpf_stats_type
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "armv7l": 386, "ppc64le": 361, "s390x": 351, "riscv64": 280}
MODES = ("sampled", "always", "off")


class StatsUnavailable(SlatraceError, OSError):
    """BPF_ENABLE_STATS failed; the message names why."""


class _EnableStatsAttr(ctypes.Structure):
    # union bpf_attr's enable_stats member; the rest of the union must be zero.
    _fields_ = [("type", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


def enable_run_time_stats() -> int:
    """An fd that keeps BPF run-time stats on until it is closed."""
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        raise StatsUnavailable(errno.ENOSYS, f"no bpf(2) syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    attr = _EnableStatsAttr(BPF_STATS_RUN_TIME, 0)
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(BPF_ENABLE_STATS), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        why = {errno.EPERM: "it needs CAP_SYS_ADMIN", errno.EINVAL: "the kernel is older than 5.8",
               errno.EBUSY: "another user holds it"}.get(err, os.strerror(err))
        raise StatsUnavailable(err, f"BPF_ENABLE_STATS failed: {why}")
    return fd


class BpfStatsSampler:
    """Holds a BPF_ENABLE_STATS fd for `window_s` every `period_s` ("sampled"),
    for the whole run ("always"), or only when asked ("off"; `request()`)."""

    def __init__(self, mode: str = "sampled", period_s: float = 60.0, window_s: float = 1.0,
                 enable=enable_run_time_stats) -> None:
        if mode not in MODES:
            raise ValueError(f"BPF stats mode {mode!r} is not one of {', '.join(MODES)}")
        if not 0 < window_s <= period_s:
            raise ValueError("the sampling window must be positive and at most the period")
        self.mode = mode
        self.period_s = period_s
        self.window_s = window_s
        self._enable = enable
        self._fd: int | None = None
        self.worker = Worker.loop("bpf-stats", "sampling BPF run-time stats", self._run)
        self.samples = 0
        self.failed: str | None = None

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def start(self) -> None:
        if self.mode == "always":
            self._open()
            return
        self.worker.start()

    def request(self) -> None:
        """One sampling window now, whatever the mode (SIGUSR1): sets a flag only."""
        self.worker.nudge()

    def _open(self) -> bool:
        try:
            self._fd = self._enable()
            return True
        except StatsUnavailable as e:
            if self.failed is None:  # said once, not every period
                log.warning("%s: the slatrace_bpf_* self-cost counters move only if the node enables "
                            "kernel.bpf_stats_enabled", e.strerror)
            self.failed = str(e)
            return False

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _sample(self, handle: WorkerHandle) -> None:
        if self._fd is None and self._open():
            self.samples += 1
            handle.succeeded()
            try:
                handle.wait(self.window_s)
            finally:
                self._close()

    def _run(self, handle: WorkerHandle) -> None:
        next_at = time.monotonic() if self.mode == "sampled" else float("inf")
        while not handle.stopping:
            if time.monotonic() >= next_at:
                self._sample(handle)
                next_at += self.period_s
            wait = None if next_at == float("inf") else max(0.0, next_at - time.monotonic())
            if handle.wait_nudge(wait):
                self._sample(handle)

    def stop(self) -> None:
        self.worker.stop(2.0)
        self._close()
