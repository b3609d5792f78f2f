"""Raw scheduler events from a private tracefs instance, and the exact reference.

The BPF program sees the same tracepoints as tracefs, so replaying the raw
events through the same state machine in Python gives every single wait, not
a histogram: the reference the agent's counts, sums and quantiles are checked
against. A private instance keeps the global buffer (and other users of it)
untouched, and `mono` is the clock of bpf_ktime_get_ns, so timestamps compare.

Resolution: events read from the binary ring buffer (the default) carry
nanosecond timestamps; the text output of tracefs rounds to microseconds.
"""

from __future__ import annotations

import heapq
import math
import os
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

from tests.support import TRACEFS_CANDIDATES, pid_alive, rmdir_when_free

INSTANCE_PREFIX = "slatrace-ref-"
# INSTANCE_PREFIX + owner pid + "-" + random hex
_OWNED_INSTANCE = re.compile(re.escape(INSTANCE_PREFIX) + r"(\d+)-[0-9a-f]{6}$")
DEFAULT_EVENTS = ("sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_migrate_task")


class TraceLost(RuntimeError):
    """The ring buffer dropped events: any reference computed from it would be wrong."""


# --- events -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceEvent:
    ts_ns: int   # CLOCK_MONOTONIC (bpf_ktime_get_ns); text mode rounds to microseconds
    cpu: int
    name: str


@dataclass(frozen=True, slots=True)
class SchedSwitch(TraceEvent):
    prev_comm: str
    prev_pid: int
    prev_state: str   # as printed: "R", "R+", "S", "D", "I", "X", "Z", "S|D", ...
    next_comm: str
    next_pid: int


@dataclass(frozen=True, slots=True)
class SchedWakeup(TraceEvent):
    """sched_wakeup or sched_wakeup_new (name tells which)."""

    comm: str
    pid: int
    target_cpu: int


@dataclass(frozen=True, slots=True)
class SchedMigrate(TraceEvent):
    comm: str
    pid: int
    orig_cpu: int
    dest_cpu: int


@dataclass(frozen=True, slots=True)
class SchedFork(TraceEvent):
    pid: int
    child_pid: int


@dataclass(frozen=True, slots=True)
class SchedExit(TraceEvent):
    pid: int


@dataclass(frozen=True, slots=True)
class OtherEvent(TraceEvent):
    body: str


# The task column ("comm-pid") may contain spaces and dashes; anchor on the
# "[cpu] flags sec.usec: event: " part instead. Flags and tgid columns are optional.
_LINE = re.compile(
    r"^\s*.*?-\d+\s+(?:\(\s*[-\d]+\)\s+)?\[(?P<cpu>\d+)\]\s+(?:\S+\s+)?"
    r"(?P<sec>\d+)\.(?P<frac>\d+): (?P<event>\w+): (?P<body>.*)$")
_LOST = re.compile(r"^CPU:(\d+) \[LOST (\d+) EVENTS\]")
# comm values may contain spaces and even "key=" text: greedy comm groups make
# the match anchor on the last, real occurrence of the fixed keys after them.
_SWITCH = re.compile(
    r"^prev_comm=(?P<pc>.*) prev_pid=(?P<pp>-?\d+) prev_prio=-?\d+ prev_state=(?P<ps>\S+)"
    r" ==> next_comm=(?P<nc>.*) next_pid=(?P<np>-?\d+) next_prio=-?\d+$")
_WAKEUP = re.compile(r"^comm=(?P<c>.*) pid=(?P<p>-?\d+) prio=-?\d+ target_cpu=(?P<t>\d+)$")
_MIGRATE = re.compile(
    r"^comm=(?P<c>.*) pid=(?P<p>-?\d+) prio=-?\d+ orig_cpu=(?P<o>\d+) dest_cpu=(?P<d>\d+)$")
_FORK = re.compile(r"^comm=.* pid=(?P<p>-?\d+) child_comm=.* child_pid=(?P<c>-?\d+)$")
_EXIT = re.compile(r"^comm=.* pid=(?P<p>-?\d+) prio=-?\d+(?: group_dead=\w+)?$")


def parse_line(line: str) -> TraceEvent | None:
    """One line of a tracefs `trace` / `trace_pipe` into an event; None for comments.

    Raises TraceLost on the "[LOST n EVENTS]" marker and ValueError on a line
    of a known event that does not parse, so a format change cannot go unseen.
    """
    if not line or line.startswith("#"):
        return None
    if m := _LOST.match(line):
        raise TraceLost(f"tracefs lost {m.group(2)} events on CPU {m.group(1)}")
    m = _LINE.match(line)
    if not m:
        raise ValueError(f"unparsable trace line: {line!r}")
    ts = int(m["sec"]) * 1_000_000_000 + int(m["frac"].ljust(9, "0")[:9])
    cpu = int(m["cpu"])
    name = m["event"]
    body = m["body"]
    if name == "sched_switch":
        b = _SWITCH.match(body)
        if b:
            return SchedSwitch(ts, cpu, name, b["pc"], int(b["pp"]), b["ps"], b["nc"], int(b["np"]))
    elif name in ("sched_wakeup", "sched_wakeup_new", "sched_waking"):
        b = _WAKEUP.match(body)
        if b:
            return SchedWakeup(ts, cpu, name, b["c"], int(b["p"]), int(b["t"]))
    elif name == "sched_migrate_task":
        b = _MIGRATE.match(body)
        if b:
            return SchedMigrate(ts, cpu, name, b["c"], int(b["p"]), int(b["o"]), int(b["d"]))
    elif name == "sched_process_fork":
        b = _FORK.match(body)
        if b:
            return SchedFork(ts, cpu, name, int(b["p"]), int(b["c"]))
    elif name == "sched_process_exit":
        b = _EXIT.match(body)
        if b:
            return SchedExit(ts, cpu, name, int(b["p"]))
    else:
        return OtherEvent(ts, cpu, name, body)
    raise ValueError(f"unparsable {name} fields: {body!r}")


def parse_lines(lines: Iterable[str]) -> list[TraceEvent]:
    """Every event of a trace, in the order tracefs merged them (timestamp order)."""
    out = []
    for line in lines:
        ev = parse_line(line.rstrip("\n"))
        if ev is not None:
            out.append(ev)
    return out


# --- recording --------------------------------------------------------------

def find_tracefs() -> Path:
    """The tracefs mount; instances need the real tracefs, not the debugfs alias."""
    for path in TRACEFS_CANDIDATES:
        if (path / "instances").is_dir():
            return path
    raise RuntimeError("tracefs is not mounted (mount -t tracefs nodev /sys/kernel/tracing)")


def remove_stale_instances(tracefs: Path | None = None) -> list[Path]:
    """Remove instances left by runs whose process is gone (they pin kernel memory)."""
    tracefs = tracefs or find_tracefs()
    removed = []
    for inst in (tracefs / "instances").glob(INSTANCE_PREFIX + "*"):
        m = _OWNED_INSTANCE.match(inst.name)
        if not m or pid_alive(int(m[1])):
            continue  # not one of ours, or its run is still going
        rmdir_when_free(inst)
        removed.append(inst)
    return removed


def read_stats(inst: Path) -> dict[int, dict[str, int]]:
    """The integer counters of each CPU's ring buffer (per_cpu/cpuN/stats)."""
    out = {}
    for stats in sorted((inst / "per_cpu").glob("cpu*/stats")):
        counters = {}
        for line in stats.read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().isdigit():
                counters[key.strip()] = int(value)
        out[int(stats.parent.name[3:])] = counters
    return out


def read_lost(inst: Path) -> dict[int, int]:
    """Events lost per CPU (overwritten, dropped, or overrun while committing)."""
    return {cpu: sum(c.get(k, 0) for k in ("overrun", "commit overrun", "dropped events"))
            for cpu, c in read_stats(inst).items()}


class RawDecoder:
    """Decodes binary ring-buffer pages (trace_pipe_raw) into events.

    Field layouts come from the live format files, as BCC builds `args`, so
    the decoder follows the running kernel. Raw pages carry nanosecond
    timestamps, where the text output rounds to microseconds.
    """

    def __init__(self, instance: Path, names: Sequence[str]) -> None:
        self.data_offset, self.commit_size = _header_page(instance / "events" / "header_page")
        self.by_id: dict[int, tuple[str, dict[str, _Field]]] = {}
        for name in names:
            sub = name if "/" in name else f"sched/{name}"
            text = (instance / "events" / sub / "format").read_text()
            event_id = int(re.search(r"^ID: (\d+)", text, re.M).group(1))  # type: ignore[union-attr]
            self.by_id[event_id] = (sub.split("/")[-1], _parse_fields(text))
            if sub.endswith("/sched_switch"):
                self.states = _SwitchStateNames.from_format(text)

    def page_events(self, page: bytes) -> Iterator[tuple[int, bytes]]:
        """(timestamp ns, payload) of each event in one ring-buffer page.

        Follows the kernel's reader (rb_update_read_stamp): data events add
        their 27-bit delta, time-extend events a long delta, time-stamp events
        set the absolute time; padding adds nothing.
        """
        (ts,) = struct.unpack_from("<Q", page, 0)
        commit = int.from_bytes(page[8:8 + self.commit_size], "little")
        if commit & _RB_MISSED_EVENTS:
            raise TraceLost("the ring buffer overwrote events before they were read")
        end = self.data_offset + (commit & _RB_COMMIT_MASK)
        off = self.data_offset
        while off < end:
            (hdr,) = struct.unpack_from("<I", page, off)
            type_len, delta = hdr & 0x1F, hdr >> 5
            if type_len == _RB_PADDING:
                if delta == 0:
                    return  # null event: the rest of the page is unused
                (length,) = struct.unpack_from("<I", page, off + 4)
                off += 4 + length
            elif type_len == _RB_TIME_EXTEND:
                (hi,) = struct.unpack_from("<I", page, off + 4)
                ts += (hi << 27) + delta
                off += 8
            elif type_len == _RB_TIME_STAMP:
                (hi,) = struct.unpack_from("<I", page, off + 4)
                ts = (ts & _TS_MSB) | (hi << 27) + delta
                off += 8
            else:
                ts += delta
                if type_len == 0:
                    (length,) = struct.unpack_from("<I", page, off + 4)
                    yield ts, page[off + 8:off + 4 + length]
                    off += 4 + length
                else:
                    yield ts, page[off + 4:off + 4 + type_len * 4]
                    off += 4 + type_len * 4

    def decode(self, ts: int, cpu: int, payload: bytes) -> TraceEvent | None:
        """One event's payload into the same typed event the text parser makes."""
        (event_id,) = struct.unpack_from("<H", payload, 0)
        known = self.by_id.get(event_id)
        if known is None:
            return None
        name, f = known

        def get(field_name: str) -> Any:
            return f[field_name].read(payload)

        if name == "sched_switch":
            return SchedSwitch(ts, cpu, name, get("prev_comm"), get("prev_pid"),
                               self.states.name(get("prev_state")), get("next_comm"),
                               get("next_pid"))
        if name in ("sched_wakeup", "sched_wakeup_new", "sched_waking"):
            return SchedWakeup(ts, cpu, name, get("comm"), get("pid"), get("target_cpu"))
        if name == "sched_migrate_task":
            return SchedMigrate(ts, cpu, name, get("comm"), get("pid"), get("orig_cpu"),
                                get("dest_cpu"))
        if name == "sched_process_fork":
            return SchedFork(ts, cpu, name, get("parent_pid"), get("child_pid"))
        if name == "sched_process_exit":
            return SchedExit(ts, cpu, name, get("pid"))
        return OtherEvent(ts, cpu, name, payload.hex())

    def events(self, pages_by_cpu: dict[int, list[bytes]],
               expected: dict[int, int] | None = None) -> list[TraceEvent]:
        """All events, merged across CPUs by timestamp as the `trace` file does.

        expected: events per CPU the kernel says were read ("read events" in
        the CPU's stats); a different count means pages were misparsed.
        """
        per_cpu = []
        for cpu, pages in sorted(pages_by_cpu.items()):
            evs = [self.decode(ts, cpu, payload)
                   for page in pages for ts, payload in self.page_events(page)]
            if expected is not None and len(evs) != expected.get(cpu, 0):
                raise TraceLost(f"decoded {len(evs)} events on CPU {cpu}, "
                                f"the kernel handed out {expected.get(cpu, 0)}")
            per_cpu.append([e for e in evs if e is not None])
        # heapq.merge is stable: on equal timestamps the lower CPU comes first,
        # as in the kernel's own merge.
        return list(heapq.merge(*per_cpu, key=lambda e: e.ts_ns))


# Ring buffer encoding (kernel/trace/ring_buffer.c); events/header_event lists them.
_RB_PADDING, _RB_TIME_EXTEND, _RB_TIME_STAMP = 29, 30, 31
_RB_MISSED_EVENTS = 1 << 31
_RB_COMMIT_MASK = (1 << 30) - 1
_TS_MSB = 0xF8 << 56


def _header_page(path: Path) -> tuple[int, int]:
    """(offset of data, size of commit) of a ring-buffer page, from header_page."""
    offsets = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(
        r"field: *[\w ]+? (\w+);\s*offset:(\d+);\s*size:(\d+);", path.read_text())}
    return offsets["data"][0], offsets["commit"][1]


@dataclass(frozen=True)
class _Field:
    offset: int
    size: int
    signed: bool
    kind: str  # "int", "str" (char array) or "loc" (__data_loc string)

    def read(self, payload: bytes) -> Any:
        if self.kind == "str":
            raw = payload[self.offset:self.offset + self.size]
            return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        if self.kind == "loc":
            (loc,) = struct.unpack_from("<I", payload, self.offset)
            start, length = loc & 0xFFFF, loc >> 16
            return payload[start:start + length].split(b"\0", 1)[0].decode("utf-8", "replace")
        return int.from_bytes(payload[self.offset:self.offset + self.size], "little",
                              signed=self.signed)


def _parse_fields(format_text: str) -> dict[str, _Field]:
    fields = {}
    for m in re.finditer(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);"
                         r"\s*signed:(?P<signed>\d+);", format_text):
        decl = m["decl"].strip()
        name = re.search(r"(\w+)(?:\[\d*\])?$", decl).group(1)  # type: ignore[union-attr]
        if decl.startswith("__data_loc"):
            kind = "loc"
        elif decl.startswith("char ") and decl.endswith("]"):
            kind = "str"
        else:
            kind = "int"
        fields[name] = _Field(int(m["off"]), int(m["size"]), m["signed"] == "1", kind)
    return fields


@dataclass(frozen=True)
class _SwitchStateNames:
    """Prints a numeric prev_state the way sched_switch's print fmt does."""

    flags: tuple[tuple[int, str], ...]
    preempt: int

    @classmethod
    def from_format(cls, format_text: str) -> "_SwitchStateNames":
        fmt = next(line for line in format_text.splitlines() if line.startswith("print fmt:"))
        flags = tuple((int(v, 16), n) for v, n in
                      re.findall(r'\{ *(0x[0-9a-fA-F]+), *"(\w)" *\}', fmt))
        # The last flag is TASK_REPORT_IDLE; the "+" bit, TASK_REPORT_MAX, is
        # the next one up (include/linux/sched.h).
        return cls(flags, max(v for v, _ in flags) << 1)

    def name(self, state: int) -> str:
        masked = state & (self.preempt - 1)
        text = "|".join(n for v, n in self.flags if masked & v) if masked else "R"
        return text + ("+" if state & self.preempt else "")


class TraceRecorder:
    """Records scheduler tracepoints, unfiltered, into a private tracefs instance.

    Use as a context manager; after the block, `events` holds every event in
    timestamp order. mode "raw" (default) drains each CPU's binary
    trace_pipe_raw from a thread: cheap (page copies, no formatting), keeps up
    with a whole busy machine, and keeps nanosecond timestamps. mode "text"
    reads the formatted `trace` file once at the end: no activity during
    recording, microsecond timestamps, limited to what fits in the buffer.
    mode "both" records like "text", then reads the same buffer twice: the
    kernel's text into `text_events`, then the binary pages into `events`,
    so the decoder can be checked against the kernel's own formatting.
    Either way a lost event raises TraceLost instead of yielding a quietly
    wrong reference.
    """

    def __init__(self, events: Sequence[str] = DEFAULT_EVENTS, buffer_kb: int = 16384,
                 mode: str = "raw", tracefs: Path | None = None, stream: bool = False) -> None:
        # stream=True asks for reading while recording, which is what "raw" does.
        mode = "raw" if stream else mode
        if mode not in ("raw", "text", "both"):
            raise ValueError(f"mode must be 'raw', 'text' or 'both', not {mode!r}")
        self.event_names = tuple(events)
        self.buffer_kb = int(buffer_kb)
        self.mode = mode
        self.tracefs = tracefs or find_tracefs()
        self.instance = (self.tracefs / "instances"
                         / f"{INSTANCE_PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
        self.events: list[TraceEvent] = []
        self.text_events: list[TraceEvent] = []
        self.lost: dict[int, int] = {}
        self._pages: dict[int, list[bytes]] = {}
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self._reader_errors: list[BaseException] = []

    def _event_dir(self, name: str) -> Path:
        sub = name if "/" in name else f"sched/{name}"
        return self.instance / "events" / sub

    def _write(self, rel: str | Path, value: str) -> None:
        (self.instance / rel).write_text(value)

    def __enter__(self) -> "TraceRecorder":
        remove_stale_instances(self.tracefs)
        self.instance.mkdir()
        try:
            self._write("tracing_on", "0")
            self._write("trace_clock", "mono")
            self._write("buffer_size_kb", str(self.buffer_kb))
            for name in self.event_names:
                d = self._event_dir(name)
                if not d.is_dir():
                    raise RuntimeError(f"no tracepoint {name} in {self.tracefs}")
                (d / "filter").write_text("0")  # "0" clears any filter
                (d / "enable").write_text("1")
            if self.mode == "raw":
                for cpu_dir in sorted((self.instance / "per_cpu").glob("cpu*")):
                    cpu = int(cpu_dir.name[3:])
                    self._pages[cpu] = []
                    t = threading.Thread(target=self._drain,
                                         args=(cpu_dir / "trace_pipe_raw", cpu, self._subbuf_size()),
                                         name=f"trace-raw-{cpu}", daemon=True)
                    t.start()
                    self._readers.append(t)
            # All events start at the same instant.
            self._write("tracing_on", "1")
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            # Nothing of ours turns it off while recording: if it is off, another
            # process did, and the recording has a hole that no counter shows.
            was_on = (self.instance / "tracing_on").read_text().strip() == "1"
            disabled = [name for name in self.event_names
                        if (self._event_dir(name) / "enable").read_text().strip() != "1"]
            self._write("tracing_on", "0")
            for name in self.event_names:
                (self._event_dir(name) / "enable").write_text("0")
            if exc_type is not None:
                return  # the block's own error matters more than the trace
            if not was_on or disabled:
                raise TraceLost(f"tracing was switched off in {self.instance.name} while recording "
                                f"({'tracing_on' if not was_on else ', '.join(disabled)}): another process "
                                "reset the tracefs instances")
            if self.mode in ("text", "both"):
                self.lost = read_lost(self.instance)
                text = (self.instance / "trace").read_bytes().decode("utf-8", "replace")
                self._check_lost()
                self.text_events = parse_lines(text.splitlines())
                if self.mode == "text":
                    self.events = self.text_events
                    return
            decoder = RawDecoder(self.instance, self.event_names)
            self._stop.set()
            if self.mode == "both":
                # `trace` does not consume; now take the same events as pages.
                for cpu_dir in sorted((self.instance / "per_cpu").glob("cpu*")):
                    cpu = int(cpu_dir.name[3:])
                    self._pages[cpu] = []
                    self._drain(cpu_dir / "trace_pipe_raw", cpu, self._subbuf_size())
            for t in self._readers:
                t.join(timeout=60)
            if self._reader_errors:
                raise self._reader_errors[0]
            self.lost = read_lost(self.instance)
            self._check_lost()
            stats = read_stats(self.instance)
            unread = {cpu: c.get("entries", 0) for cpu, c in stats.items()}
            if any(unread.values()):
                raise TraceLost(f"events left unread per CPU {unread}")
            self.events = decoder.events(
                self._pages, {cpu: c.get("read events", 0) for cpu, c in stats.items()})
            self._pages.clear()
        finally:
            self._teardown()

    def _check_lost(self) -> None:
        if any(self.lost.values()):
            raise TraceLost(f"tracefs lost events per CPU {self.lost}: use a larger buffer_kb"
                            + (" or mode='raw'" if self.mode != "raw" else ""))

    def _teardown(self) -> None:
        self._stop.set()
        for t in self._readers:
            t.join(timeout=10)
        try:
            self._write("tracing_on", "0")
            (self.instance / "events" / "enable").write_text("0")
        except OSError:
            pass  # the instance may not exist yet; rmdir below reports real trouble
        rmdir_when_free(self.instance)

    def _subbuf_size(self) -> int:
        """Bytes per ring-buffer page: one read of trace_pipe_raw returns one."""
        f = self.instance / "buffer_subbuf_size_kb"
        return int(f.read_text()) * 1024 if f.exists() else os.sysconf("SC_PAGE_SIZE")

    def _drain(self, path: Path, cpu: int, page_size: int) -> None:
        """Copy one CPU's pages until stopped and empty (reading frees them)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            self._reader_errors.append(e)
            return
        pages = self._pages[cpu]
        try:
            while True:
                try:
                    page = os.read(fd, page_size)
                except BlockingIOError:
                    page = b""
                if page:
                    pages.append(page)
                    continue
                if self._stop.is_set():
                    return
                # 16 MiB per CPU hold far more than 20 ms of events.
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001  (surfaced by __exit__)
            self._reader_errors.append(e)
        finally:
            os.close(fd)


# --- the reference ----------------------------------------------------------

# Per-task states, as in bpf/sched.h.
RUNNING, RUNNABLE, PREEMPTED, SLEEPING, BLOCKED = "running", "runnable", "preempted", "sleeping", "blocked"
DEAD = "dead"


def switch_out_state(prev_state: str) -> str:
    """What a switch-out's printed prev_state means, in the BPF program's order.

    "+" is the preempt bit (TASK_REPORT_MAX); plain "R" is a yield; X/Z an
    exiting task; D uninterruptible sleep; anything else a sleep.
    """
    if prev_state.endswith("+"):
        return PREEMPTED
    if prev_state == "R":
        return RUNNABLE
    flags = prev_state.split("|")
    if "X" in flags or "Z" in flags:
        return DEAD
    if "D" in flags:
        return BLOCKED
    return SLEEPING


class WaitSpan(NamedTuple):
    """One run-queue wait with where it happened, for per-wait comparisons."""

    tid: int
    start_ns: int    # the wakeup (or switch-out) that made it runnable
    end_ns: int      # its switch-in
    wake_cpu: int    # the CPU that traced the wakeup / switch-out
    cpu: int         # the CPU it was switched in on
    prev_pid: int    # who held that CPU until then (0: the CPU was idle)
    preemptor: int = -1  # who took the CPU when it was preempted (-1: it woke up instead)


class Preemption(NamedTuple):
    """A wait that followed an involuntary switch-out, and who took the CPU."""

    victim: int      # tid
    preemptor: int   # tid: the caller maps it to its cgroup
    wait_ns: int


@dataclass
class Reference:
    """Every wait of the chosen tids, by the same rules as bpf/sched.bpf.c."""

    runq_waits_ns: list[int] = field(default_factory=list)
    # (victim_tid, preemptor_tid, wait_ns) for every wait that followed a preemption
    preemptions: list[Preemption] = field(default_factory=list)
    # (victim_tid, holder_tid, wait_ns) for every wait that followed a wakeup:
    # the holder is the task switched out when the victim got the CPU (0: idle)
    wakeup_waits: list[Preemption] = field(default_factory=list)
    iowait_ns: list[int] = field(default_factory=list)
    # the same I/O waits with where they were: start is the D-state
    # switch-out, end the wakeup (cpu: the wakeup's, wake_cpu: the switch-out's)
    iowait_spans: list[WaitSpan] = field(default_factory=list)
    migrations: int = 0
    untraced_switch_in: int = 0    # switch-out of a task still marked runnable
    untraced_switch_out: int = 0   # switch-in of a task already marked running
    untraced_wakeup: int = 0       # switch-in of a task still marked asleep
    # preemptions whose preemptor BPF had not seen yet (it attributes them to cgroup 0)
    unknown_preemptor: int = 0
    # Switch-outs as the kernel counts them in /proc/PID/status: involuntary
    # (prev_state R or R+) and voluntary (any other state), whatever the state
    # machine made of them.
    involuntary_switches: int = 0
    voluntary_switches: int = 0
    waits_by_tid: dict[int, list[int]] = field(default_factory=dict)
    spans: list[WaitSpan] = field(default_factory=list)   # every wait of runq_waits_ns, in order
    tids: set[int] = field(default_factory=set)   # the tids followed, forks included
    first_ts: int = 0
    last_ts: int = 0

    @property
    def total_wait_ns(self) -> int:
        return sum(self.runq_waits_ns)

    @property
    def total_wait_s(self) -> float:
        return self.total_wait_ns / 1e9

    @property
    def gaps(self) -> int:
        return self.untraced_switch_in + self.untraced_switch_out + self.untraced_wakeup

    def preemptions_by(self, preemptor_tids: Iterable[int]) -> list[Preemption]:
        """The preemptions whose preemptor is one of preemptor_tids (e.g. a cgroup's)."""
        wanted = set(preemptor_tids)
        return [p for p in self.preemptions if p[1] in wanted]


class _Task:
    __slots__ = ("state", "ts", "preemptor", "preemptor_known", "cpu")

    def __init__(self, state: str, ts: int, cpu: int = -1) -> None:
        self.state = state
        self.ts = ts
        self.preemptor = 0
        self.preemptor_known = False
        self.cpu = cpu   # where the last state change was traced


def reference(events: Sequence[TraceEvent], pids: Iterable[int] | None,
              follow_forks: bool = False, r_is_preemption: bool = True) -> Reference:
    """Replay events through the BPF state machine; collect the results for pids.

    pids are thread ids (what tracepoints call pid); None means every task.
    follow_forks adds children and threads of followed tids as they are
    created (needs sched_process_fork in the recording).

    r_is_preemption: like BPF, every switch-out of a still-runnable task is a
    preemption by next_pid, as the kernel's nonvoluntary_ctxt_switches counts
    it: "R+" marks only preemption inside the kernel, while a task preempted
    on its way back to user space (or yielding) is switched out as plain "R".
    False counts "R+" alone, to show how little that bit covers.

    As in BPF, a task is unknown until a switch-out, a fork or a
    sched_wakeup_new; a plain wakeup of an unknown task changes nothing, since
    the task may have been running. Every task is tracked, not only pids, so
    that a preemptor's "known" status is the one BPF would see.
    """
    wanted: set[int] | None = None if pids is None else set(pids)
    ref = Reference()
    if events:
        ref.first_ts = events[0].ts_ns
        ref.last_ts = events[-1].ts_ns
    exits_recorded = any(isinstance(e, SchedExit) for e in events)
    tasks: dict[int, _Task] = {}

    def followed(tid: int) -> bool:
        return wanted is None or tid in wanted

    def on_wakeup(pid: int, now: int, cpu: int) -> None:
        t = tasks.get(pid)
        if t is None:
            return
        # A wakeup of a running or queued task keeps the first enqueue time.
        if t.state in (RUNNING, RUNNABLE, PREEMPTED):
            return
        if t.state == BLOCKED and followed(pid):
            ref.iowait_ns.append(now - t.ts)
            ref.iowait_spans.append(WaitSpan(pid, t.ts, now, t.cpu, cpu, 0))
        t.state = RUNNABLE
        t.ts = now
        t.cpu = cpu

    for ev in events:
        now = ev.ts_ns
        if isinstance(ev, SchedSwitch):
            nxt, prev = ev.next_pid, ev.prev_pid
            next_known = False
            if nxt:
                n = tasks.get(nxt)
                if n is not None:
                    next_known = True
                    if followed(nxt):
                        if n.state in (RUNNABLE, PREEMPTED):
                            wait = now - n.ts
                            ref.runq_waits_ns.append(wait)
                            ref.waits_by_tid.setdefault(nxt, []).append(wait)
                            ref.spans.append(WaitSpan(nxt, n.ts, now, n.cpu, ev.cpu, prev,
                                                      n.preemptor if n.state == PREEMPTED else -1))
                            if n.state == PREEMPTED:
                                ref.preemptions.append(Preemption(nxt, n.preemptor, wait))
                                ref.unknown_preemptor += not n.preemptor_known
                            else:
                                ref.wakeup_waits.append(Preemption(nxt, prev, wait))
                        elif n.state == RUNNING:
                            ref.untraced_switch_out += 1
                        elif n.state in (SLEEPING, BLOCKED):
                            ref.untraced_wakeup += 1
                    n.state = RUNNING
                    n.ts = now
            if not prev:
                continue
            st = switch_out_state(ev.prev_state)
            if followed(prev):
                if st in (RUNNABLE, PREEMPTED):
                    ref.involuntary_switches += 1
                else:
                    ref.voluntary_switches += 1
            if st == RUNNABLE and r_is_preemption:
                st = PREEMPTED
            if st == DEAD:
                # BPF drops the entry at sched_process_exit; without that
                # event in the recording, the final switch-out stands in for it.
                if not exits_recorded:
                    tasks.pop(prev, None)
                continue
            p = tasks.get(prev)
            if p is None:
                p = tasks[prev] = _Task(st, now)
            elif p.state in (RUNNABLE, PREEMPTED) and followed(prev):
                ref.untraced_switch_in += 1
            p.state = st
            p.ts = now
            p.cpu = ev.cpu
            p.preemptor = nxt
            p.preemptor_known = next_known
        elif isinstance(ev, SchedWakeup):
            if ev.name == "sched_wakeup_new":
                # What sched_process_fork does in BPF, for recordings without it.
                tasks[ev.pid] = _Task(SLEEPING, now)
                on_wakeup(ev.pid, now, ev.cpu)
            elif ev.name == "sched_wakeup":
                on_wakeup(ev.pid, now, ev.cpu)
        elif isinstance(ev, SchedMigrate):
            if ev.pid in tasks and followed(ev.pid):
                ref.migrations += 1
        elif isinstance(ev, SchedFork):
            tasks[ev.child_pid] = _Task(SLEEPING, now)
            if follow_forks and wanted is not None and ev.pid in wanted:
                wanted.add(ev.child_pid)
        elif isinstance(ev, SchedExit):
            tasks.pop(ev.pid, None)
    ref.tids = set(ref.waits_by_tid) if wanted is None else wanted
    return ref


def percentile(values: Sequence[int], q: float) -> int:
    """Nearest-rank quantile: sorted(values)[ceil(q*n) - 1].

    q goes through its decimal text so that e.g. 0.07 * 100 is exactly 7.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} outside [0, 1]")
    s = sorted(values)
    rank = math.ceil(Fraction(str(q)) * len(s))
    return s[max(rank, 1) - 1]

