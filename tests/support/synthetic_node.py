"""A node of N busy services as the probe hands it to the store.

Drained snapshots (one interval of counts each, the first a baseline with
none) shaped like a recorded contention scene: per service a
run-queue histogram of a few hundred waits per interval (log-normal, medians
from 20 µs to 2 ms, so 20-40 occupied 1/16-octave slots), I/O waits for one
service in five, several neighbours that preempt it or hold the CPU it waits
for (and the idle CPU), migrations, untraced events (all three kinds) for one in
ten, and for the same one in ten waits its own CPU limit held.

The reference figures (totals per service, each neighbour's wait) are kept
here from the raw values, so tests check the store and exporters against
numbers that never went through them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, Bucket, CgroupCounters, PairCounters, ProbeSnapshot
from agent.store.histogram import Histogram

FIRST_CGID = 1000


@dataclass
class _Service:
    runq: dict[int, Bucket]
    iowait: dict[int, Bucket]
    preempted_by: dict[int, PairCounters]   # preemptor cgid -> per interval
    held_by: dict[int, PairCounters]        # holder cgid (0: idle) -> per interval
    migrations: int
    untraced: int
    limited_ns: int = 0                     # per interval, the part of its waits its CPU limit held


@dataclass
class SyntheticNode:
    """n services; each interval every live service adds the same figures."""

    n: int
    seed: int = 1
    waits_per_interval: int = 300
    neighbours: int = 6
    # Interval from which a service stops (never seen again), by index.
    stops: dict[int, int] = field(default_factory=dict)
    _services: list[_Service] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._services = []
        for i in range(self.n):
            median = 20_000 * 100 ** rng.random()
            runq = Histogram.from_ns(int(rng.lognormvariate(0, 0.8) * median)
                                     for _ in range(self.waits_per_interval))
            iowait = Histogram.from_ns(int(rng.lognormvariate(0, 1.0) * 300_000) for _ in range(50)) \
                if i % 5 == 0 else Histogram({})
            others = rng.sample([j for j in range(self.n) if j != i], min(self.neighbours, self.n - 1))
            # Some neighbours both preempt the service and hold the CPU it waits for.
            third = len(others) // 3
            pre = {self.cgid(j): PairCounters(rng.randint(1, 40), rng.randint(10_000, 5_000_000))
                   for j in others[: 2 * third]}
            held = {self.cgid(j): PairCounters(rng.randint(1, 40), rng.randint(10_000, 5_000_000))
                    for j in others[third:]}
            held[0] = PairCounters(rng.randint(1, 40), rng.randint(10_000, 2_000_000))
            self._services.append(_Service(dict(runq.items()), dict(iowait.items()), pre, held,
                                           rng.randint(0, 20), 1 if i % 10 == 0 else 0,
                                           rng.randint(1_000_000, 50_000_000) if i % 10 == 0 else 0))

    @staticmethod
    def cgid(i: int) -> int:
        return FIRST_CGID + i

    def name(self, cgid: int) -> str:
        """service_of for the store: each cgroup is its own service."""
        return f"/svc/{cgid - FIRST_CGID:04d}"

    def _intervals(self, i: int, t: int) -> int:
        """Intervals 1..t that service i was alive in (interval 0 is the baseline)."""
        return min(t, self.stops.get(i, t))

    def snapshot(self, t: int, start_wall: float = 1000.0, interval_s: float = 1.0) -> ProbeSnapshot:
        """The maps drained at the end of interval t (t = 0: the baseline, no counts)."""
        hists: dict[tuple[int, int], dict[int, Bucket]] = {}
        pairs: dict[tuple[int, int], PairCounters] = {}
        holders: dict[tuple[int, int], PairCounters] = {}
        cgroups: dict[int, CgroupCounters] = {}
        for i, s in enumerate(self._services):
            if t == 0 or t > self.stops.get(i, t):
                continue
            cg = self.cgid(i)
            hists[(cg, HIST_RUNQ)] = s.runq
            if s.iowait:
                hists[(cg, HIST_IOWAIT)] = s.iowait
            for by, p in s.preempted_by.items():
                pairs[(cg, by)] = p
            for by, p in s.held_by.items():
                holders[(cg, by)] = p
            cgroups[cg] = CgroupCounters(migrations=s.migrations, untraced_switch_in=s.untraced,
                                         untraced_switch_out=s.untraced, untraced_wakeup=s.untraced,
                                         limited_runq=1 if s.limited_ns else 0, limited_runq_ns=s.limited_ns)
        return ProbeSnapshot.from_dicts(mono_ns=int(t * interval_s * 1e9), wall=start_wall + t * interval_s,
                                        hists=hists, pairs=pairs, holders=holders, cgroups=cgroups)

    # The reference, from the raw per-interval figures.

    def runq_count(self, i: int, t: int) -> int:
        return sum(b.count for b in self._services[i].runq.values()) * self._intervals(i, t)

    def has_iowait(self, i: int) -> bool:
        return bool(self._services[i].iowait)

    def neighbour_wait_ns(self, i: int) -> dict[str, int]:
        """Wait each neighbour caused service i per interval (idle left out)."""
        s = self._services[i]
        out: dict[str, int] = {}
        for table in (s.preempted_by, s.held_by):
            for by, p in table.items():
                if by:
                    out[self.name(by)] = out.get(self.name(by), 0) + p.wait_ns
        return out

    def culprit_series(self, i: int, names: set[str]) -> int:
        """Counter series of the neighbours `names` and idle: two per preemptor
        (count, wait), one per holder (wait)."""
        s = self._services[i]
        pre = sum(2 for by in s.preempted_by if self.name(by) in names)
        held = sum(1 for by in s.held_by if by == 0 or self.name(by) in names)
        return pre + held

    def migrations(self, i: int) -> int:
        return self._services[i].migrations

    def untraced(self, i: int) -> int:
        return self._services[i].untraced

    def limited_ns(self, i: int) -> int:
        return self._services[i].limited_ns
