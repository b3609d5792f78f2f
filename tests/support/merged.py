"""The agent's records of merged waits against the reference's waits.

The programs stream a thread's back-to-back short preempted waits as one
record (bpf/sched.bpf.c stream_wait(): `waits` of them, `wait_ns` in all,
between start_ns and end_ns). Tests that pair the agent's waits with the
reference's one by one set those records apart with the reference waits
they hold, and compare them in sum.
"""

from __future__ import annotations

from dataclasses import dataclass

# The programs' stamp and tracefs's stamp of one switch differ by a few µs.
EDGE_SLACK_NS = 20_000


@dataclass(frozen=True)
class Merged:
    records: int = 0
    waits: int = 0             # the agent's count of the waits the records hold
    wait_ns: int = 0
    reference_waits: int = 0   # the reference's waits inside the records' spans
    reference_ns: int = 0

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def set_apart(spans: list, events: list) -> tuple[list, list, Merged]:
    """(reference spans, agent events) left for pairing one by one, and the
    merged records with the reference spans they hold, in sum."""
    merged = [e for e in events if e.waits > 1]
    if not merged:
        return spans, events, Merged()
    by_tid: dict[int, list] = {}
    for e in merged:
        by_tid.setdefault(e.tid, []).append(e)
    held, rest = [], []
    for s in spans:
        inside = any(e.start_ns - EDGE_SLACK_NS <= s.start_ns and s.end_ns <= e.end_ns + EDGE_SLACK_NS
                     for e in by_tid.get(s.tid, ()))
        (held if inside else rest).append(s)
    summary = Merged(len(merged), sum(e.waits for e in merged), sum(e.wait_ns for e in merged),
                     len(held), sum(s.end_ns - s.start_ns for s in held))
    return rest, [e for e in events if e.waits == 1], summary
