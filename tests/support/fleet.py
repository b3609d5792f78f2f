"""A fleet of nodes, each with a node state of its own, for the fleet scene.

Every node runs `services_per_node` of a catalog of services named as the
agent names Kubernetes workloads (NAMESPACE/WORKLOAD), with its own load: run-queue
waits per service (log-normal, a median of its own per node), I/O waits for
some, neighbours on the node that preempt it or hold the CPU it waits for,
migrations, and for the services that send request spans, requests whose
scheduling delay is split by cause. The services with an SLO (and the
`llm/*` ones, by a `histograms` entry) get their buckets (the series budget);
on a share of the nodes (`breach_share`) one SLO service runs several times
slower, so that node breaks its SLO.

Each node's figures are the same every tick (a tick stands for one agent
interval), so over any window a node adds `ticks x` its per-tick figures.
`LiveNode` feeds them through the agent's own store, SLO judge, trace
counters and exporter (agent.export.prometheus.Registry): the exposition a
node serves is written by the agent's code, never by hand. The reference
figures (the exact samples, culprits and causes) are kept here from the raw
values, so tests compare what Prometheus answers with numbers that never went
through the store, the exporter or Prometheus.

Everything is derived from (spec, node index) by a seeded generator, so the
server process and the test build the same fleet independently.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.attribution.breaches import SloBreaches
from agent.config import Slo
from agent.export.figures import Sources
from agent.export.prometheus import Registry, SlatraceCollector
from agent.export.traces import TraceCollector
from agent.probe.snapshot import HIST_IOWAIT, HIST_RUNQ, Bucket, CgroupCounters, PairCounters, ProbeSnapshot
from agent.store.histogram import Histogram, classic_bounds
from agent.store.store import Store
from agent.traces.metrics import TraceCounters

# The catalog: the first SLO_SERVICES have a run-queue SLO; the SPAN_SERVICES
# send request spans. Names as the agent gives Kubernetes workloads.
_NAMESPACES = ("llm", "shop", "search", "payments", "ads", "media", "batch", "infra")
_WORKLOADS = ("api", "worker", "cache", "db", "indexer", "gateway", "scheduler", "exporter")
CATALOG: tuple[str, ...] = ("llm/vllm", "llm/router", "shop/api", "search/api", "payments/api", "ads/api") + tuple(
    f"{ns}/{wl}" for ns in _NAMESPACES for wl in _WORKLOADS if f"{ns}/{wl}" not in
    ("llm/api", "shop/api", "search/api", "payments/api", "ads/api"))
SLO_SERVICES = 6
SPAN_SERVICES = ("llm/vllm", "llm/router")
HISTOGRAM_GLOBS = ("llm/*",)
FIRST_CGID = 1000
IDLE_CGID = 0
# Causes of a request's scheduling delay (agent/attribution/causes.py), who each names.
_CAUSES = ("neighbour", "cpu_limit", "own_threads", "kernel", "idle")
_NORMAL = statistics.NormalDist()
SLOW = 10.0  # load of an SLO service on a node where it is made to break its SLO


@dataclass(frozen=True)
class FleetSpec:
    nodes: int
    services_per_node: int = 20
    seed: int = 1
    breach_share: float = 0.2
    tick_s: float = 0.25          # one agent interval
    waits_per_tick: int = 60      # run-queue waits of a service per tick, on average
    requests_per_tick: int = 2    # request spans of a span service per tick

    def __post_init__(self) -> None:
        if not 1 <= self.services_per_node <= len(CATALOG):
            raise ValueError(f"services_per_node must be 1..{len(CATALOG)}")

    @property
    def slos(self) -> tuple[Slo, ...]:
        return tuple(Slo(service=s, runq_p99=t) for s, t in slo_targets(_nominal(self)).items())

    def instance(self, i: int) -> str:
        return f"node-{i:05d}:9477"


@dataclass
class ServiceState:
    """One service on one node, per tick."""

    runq_ns: list[int]
    iowait_ns: list[int]
    preempted_by: dict[str, PairCounters]      # culprit service -> per tick
    held_by: dict[str, PairCounters]           # holder service ("idle" too) -> per tick
    migrations: int
    # (delay seconds, [(cause, who, seconds)]) of each request span per tick
    requests: list[tuple[float, list[tuple[str, str, float]]]] = field(default_factory=list)

    def caused(self) -> dict[str, int]:
        """Wait each neighbour caused per tick (idle left out): the top-culprit ranking."""
        out: dict[str, int] = {}
        for table in (self.preempted_by, self.held_by):
            for by, p in table.items():
                if by != "idle":
                    out[by] = out.get(by, 0) + p.wait_ns
        return out


@dataclass
class NodeState:
    index: int
    services: dict[str, ServiceState]
    breaching: frozenset[str]                  # SLO services made slow on this node


def _base_median_ns(service: str) -> float:
    """Every service has a median of its own (20 µs .. 2 ms), the same on every node."""
    r = random.Random(f"median:{service}").random()
    return 20_000 * 100 ** r


def node_state(spec: FleetSpec, i: int) -> NodeState:
    rng = random.Random(f"{spec.seed}:{i}")
    slo_names = CATALOG[:SLO_SERVICES]
    # A node runs most SLO services and fills the rest from the catalog.
    running = [s for s in slo_names if rng.random() < 0.85][: spec.services_per_node]
    rest = [s for s in CATALOG if s not in running]
    running += rng.sample(rest, spec.services_per_node - len(running))
    breaching = frozenset()
    candidates = [s for s in running if s in slo_names]
    if candidates and rng.random() < spec.breach_share:
        breaching = frozenset({rng.choice(candidates)})
    services: dict[str, ServiceState] = {}
    for name in running:
        load = rng.lognormvariate(0, 0.25) * (SLOW if name in breaching else 1.0)
        median = _base_median_ns(name) * load
        n = max(10, int(spec.waits_per_tick * rng.uniform(0.5, 1.5)))
        # Evenly spread over the log-normal's quantiles, so a node's P99 is set
        # by its load, not by which few samples fell in its tail.
        runq = [max(1, int(median * math.exp(0.7 * _NORMAL.inv_cdf((k + 0.5) / n)))) for k in range(n)]
        iowait = [max(1, int(rng.lognormvariate(0, 1.0) * 300_000 * load)) for _ in range(8)] \
            if hash_share(name, 4) else []
        others = rng.sample([s for s in running if s != name], min(5, len(running) - 1))
        pre = {by: PairCounters(rng.randint(1, 20), int(rng.uniform(0.2, 3.0) * median * load))
               for by in others[:3]}
        held = {by: PairCounters(rng.randint(1, 20), int(rng.uniform(0.2, 3.0) * median * load))
                for by in others[2:]}
        held["idle"] = PairCounters(rng.randint(1, 20), int(rng.uniform(0.1, 1.0) * median))
        requests = []
        if name in SPAN_SERVICES:
            neighbours = others[:3]   # at most DELAY_CULPRITS: each keeps a label of its own
            for _ in range(spec.requests_per_tick):
                parts = []
                for cause in _CAUSES:
                    if rng.random() < 0.6:
                        who = {"neighbour": rng.choice(neighbours), "cpu_limit": name, "own_threads": name,
                               "kernel": "kernel", "idle": "idle"}[cause]
                        parts.append((cause, who, rng.lognormvariate(0, 0.8) * median * 4 / 1e9))
                requests.append((sum(p[2] for p in parts), parts))
        services[name] = ServiceState(runq, iowait, pre, held, rng.randint(0, 10), requests)
    return NodeState(i, services, breaching)


def hash_share(name: str, one_in: int) -> bool:
    """One service in `one_in` of the catalog, the same on every node (I/O waits)."""
    return random.Random(f"share:{name}").randrange(one_in) == 0


def exact_quantile(values: list[int], q: float) -> float:
    """The q quantile of raw ns values, in seconds: the smallest value with at
    least q of the samples at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1e9


@functools.lru_cache(maxsize=8)
def slo_targets(spec: FleetSpec) -> dict[str, float]:
    """service -> runq_p99 target: between the slowest P99 of a node where it
    runs normally and the fastest of a node where it runs slow, by a margin, so
    each node's verdict is clear-cut (judged on 200 nodes' states, whatever the
    fleet's size)."""
    ok: dict[str, float] = {}
    slow: dict[str, float] = {}
    for i in range(200):
        st = node_state(spec, i)
        for name in CATALOG[:SLO_SERVICES]:
            if name in st.services:
                p99 = exact_quantile(st.services[name].runq_ns, 0.99)
                table = slow if name in st.breaching else ok
                table[name] = (max if table is ok else min)(table.get(name, p99), p99)
    targets = {}
    for name in CATALOG[:SLO_SERVICES]:
        hi = ok.get(name, _base_median_ns(name) * 3e-9)
        targets[name] = round(max(hi * 1.3, math.sqrt(hi * slow[name]) if name in slow else 0.0), 9)
    return targets


def _nominal(spec: FleetSpec) -> FleetSpec:
    # Node states do not depend on the node count: targets are the same at any N.
    return FleetSpec(nodes=1, services_per_node=spec.services_per_node, seed=spec.seed,
                     breach_share=spec.breach_share, tick_s=spec.tick_s, waits_per_tick=spec.waits_per_tick,
                     requests_per_tick=spec.requests_per_tick)


class LiveNode:
    """One node's agent: its own store, SLO judge and trace counters, read by the
    agent's exporter. advance() adds the ticks since the last call as one
    drained interval (counts x ticks), as a poll after a longer interval would."""

    def __init__(self, spec: FleetSpec, state: NodeState, start_wall: float, preload_ticks: int = 600,
                 retention_s: float = 120.0) -> None:
        self.spec = spec
        self.state = state
        self.start_wall = start_wall
        names = list(CATALOG)
        self._cgid = {s: FIRST_CGID + names.index(s) for s in state.services}
        self._name = {cg: s for s, cg in self._cgid.items()} | {IDLE_CGID: "idle"}
        self.store = Store(retention_s)
        self.breaches = SloBreaches(spec.slos, retention_s)
        self.traces = TraceCounters()
        self.registry = Registry()
        self.registry.register(SlatraceCollector(self.store, sources=Sources(
            slos=spec.slos, histograms=tuple(s.service for s in spec.slos) + HISTOGRAM_GLOBS,
            slo_breaches=self.breaches.totals, request_sched_delay=self.traces.delay_points)))
        self.registry.register(TraceCollector(self.traces))
        self._per_tick = self._tick_figures()
        # The agent has been running `preload_ticks` before the scene starts:
        # counters far from zero, as on a fleet that has been up for a while.
        self._tick = -preload_ticks
        self.store.ingest(self._snapshot(self._tick, 0), self._name.__getitem__)
        self.advance_to(0)

    def _tick_figures(self) -> tuple:
        hists: dict[tuple[int, int], Histogram] = {}
        pairs: dict[tuple[int, int], PairCounters] = {}
        holders: dict[tuple[int, int], PairCounters] = {}
        cgroups: dict[int, CgroupCounters] = {}
        for name, s in self.state.services.items():
            cg = self._cgid[name]
            hists[(cg, HIST_RUNQ)] = Histogram.from_ns(s.runq_ns)
            if s.iowait_ns:
                hists[(cg, HIST_IOWAIT)] = Histogram.from_ns(s.iowait_ns)
            for by, p in s.preempted_by.items():
                pairs[(cg, self._cgid[by])] = p
            for by, p in s.held_by.items():
                holders[(cg, IDLE_CGID if by == "idle" else self._cgid[by])] = p
            if s.migrations:
                cgroups[cg] = CgroupCounters(migrations=s.migrations)
        return hists, pairs, holders, cgroups

    def _snapshot(self, tick: int, times: int) -> ProbeSnapshot:
        hists, pairs, holders, cgroups = self._per_tick
        t = self.spec.tick_s
        if not times:
            return ProbeSnapshot.from_dicts(mono_ns=int((tick + 10**6) * t * 1e9), wall=self.start_wall + tick * t)

        def scaled(p: PairCounters) -> PairCounters:
            return PairCounters(p.count * times, p.wait_ns * times)

        return ProbeSnapshot.from_dicts(
            mono_ns=int((tick + 10**6) * t * 1e9), wall=self.start_wall + tick * t,
            hists={k: {slot: Bucket(b.count * times, b.sum_ns * times) for slot, b in h.items()}
                   for k, h in hists.items()},
            pairs={k: scaled(p) for k, p in pairs.items()},
            holders={k: scaled(p) for k, p in holders.items()},
            cgroups={k: CgroupCounters(migrations=c.migrations * times) for k, c in cgroups.items()})

    def advance_to(self, tick: int) -> None:
        times = tick - self._tick
        if times <= 0:
            return
        record = self.store.ingest(self._snapshot(tick, times), self._name.__getitem__)
        if record is not None:
            self.breaches.observe(record.end, record.services)
        end = self.start_wall + tick * self.spec.tick_s
        for name, s in self.state.services.items():
            for delay, parts in s.requests:
                by = [{"cause": c, "service": who, "seconds": sec} for c, who, sec in parts]
                for _ in range(times):
                    self.traces.add_request(name, delay, [], end, by)
        self._tick = tick

    def exposition(self, now: float, openmetrics: bool = False) -> bytes:
        self.advance_to(math.floor((now - self.start_wall) / self.spec.tick_s))
        return self.registry.exposition(openmetrics=openmetrics)


# The reference, from the raw node states.

def fleet_states(spec: FleetSpec) -> list[NodeState]:
    return [node_state(spec, i) for i in range(spec.nodes)]


def merged_runq_ns(states: Iterable[NodeState], service: str) -> list[int]:
    """Every node's per-tick waits of `service` together: the fleet's exact
    distribution over any window (every node adds its figures at the same rate)."""
    return [v for st in states if service in st.services for v in st.services[service].runq_ns]


def node_p99(st: NodeState, service: str) -> float:
    """The node's own exact run-queue P99 of the service (what its agent judges)."""
    return exact_quantile(st.services[service].runq_ns, 0.99)


def bucketed(spec: FleetSpec, service: str) -> bool:
    return service in slo_targets(spec) or service.startswith("llm/")


def exported_culprit_wait(spec: FleetSpec, st: NodeState, service: str) -> dict[str, float]:
    """Preempted wait per tick (seconds) by culprit that the node exports for
    `service`: every culprit of a bucketed service, else the top 3 by caused
    wait (preempting or holding the CPU), ties by name, as the series budget says."""
    s = st.services[service]
    if bucketed(spec, service):
        keep = set(s.preempted_by)
    else:
        caused = s.caused()
        keep = set(sorted(caused, key=lambda by: (-caused[by], by))[:3])
    return {by: p.wait_ns / 1e9 for by, p in s.preempted_by.items() if by in keep}


def delay_by_cause(states: Iterable[NodeState]) -> dict[tuple[str, str, str], float]:
    """(service, cause, culprit) -> request delay seconds per tick, summed over nodes."""
    out: dict[tuple[str, str, str], float] = {}
    for st in states:
        for name, s in st.services.items():
            for _, parts in s.requests:
                for cause, who, sec in parts:
                    out[(name, cause, who)] = out.get((name, cause, who), 0.0) + sec
    return out


def bounds() -> tuple[float, ...]:
    return classic_bounds()
