"""The bench's scale section: the real agent beside many services, and beside
cgroup churn.

Each point starts a fresh `slatrace run` (default settings, private port),
then its workload (tests/support/scale.py): N busy services, one tiny C worker
per cgroup, or the churn (new cgroups at a fixed rate, each killed and removed
after a fixed lifetime). After a warm-up it samples, every few seconds:

- agent CPU from /proc/PID/stat (utime + stime), split into the time spent
  serving the /metrics scrape and the rest (the collection loop), so the CPU
  of a Prometheus scraping every 15 s can be stated apart from the bench's
  own, denser sampling;
- RSS and peak RSS (VmRSS, VmHWM);
- one /metrics scrape: bytes, series, wall time, and from it
  slatrace_poll_duration_seconds, slatrace_services_tracked and
  slatrace_bpf_map_errors_total per map;
- the entries of every hash map the agent holds, walked with the bpf()
  syscall by map id (bench/bpfstats.py), and how many of them name a cgroup
  this run has already removed.

BPF map memory at 64 possible CPUs comes from the loaded maps' shapes through
bench/mapmem.py.
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench import bpfstats, mapmem
from bench.tools import Slatrace
from tests.support.scale import Churn, Duty, Services, compile_worker

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMETHEUS_SCRAPE_S = 15.0   # the cadence the "with scrapes" CPU figure assumes
CHURN_RATE = 20.0            # new cgroups a second
CHURN_LIFETIME = 5.0         # seconds each one lives
WORK_US = 200.0              # compute per round of every worker

# Targets for a real node (the agent's design goals at 1,000 services and churn).
POLL_LIMIT_S = 0.100
CPU_LIMIT_PCT = 5.0
SCRAPE_LIMIT_S = 0.250


@dataclass(frozen=True)
class Point:
    label: str
    kind: str           # "services" or "churn"
    services: int       # N, or the live set of the churn (rate x lifetime)
    warmup_s: float
    window_s: float


def points(sizes: list[int], window_s: float, churn_s: float, warmup_s: float) -> list[Point]:
    out = [Point(f"{n} services", "services", n, warmup_s, window_s) for n in sizes]
    if churn_s > 0:
        out.append(Point(f"churn {CHURN_RATE:.0f}/s x {CHURN_LIFETIME:.0f} s", "churn",
                         int(CHURN_RATE * CHURN_LIFETIME), CHURN_LIFETIME, churn_s))
    return out


# --- what one sample reads --------------------------------------------------

def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB."""
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            vals[key] = int(rest.split()[0])
    return vals["VmRSS"], vals["VmHWM"]


@dataclass(frozen=True)
class Scrape:
    bytes: int
    series: int
    seconds: float
    cpu_ticks: int
    poll_s: float | None
    services_tracked: float | None
    map_errors: dict[str, float]


def parse_exposition(text: str) -> tuple[int, dict[str, float], dict[str, float]]:
    """(series, unlabelled samples, slatrace_bpf_map_errors_total by map) of a
    Prometheus text exposition; only what the bench reads."""
    series = 0
    plain: dict[str, float] = {}
    errors: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series += 1
        name, _, value = line.rpartition(" ")
        if name.startswith("slatrace_bpf_map_errors_total{"):
            label = name.split('map="', 1)[1].split('"', 1)[0] if 'map="' in name else "?"
            errors[label] = float(value)
        elif "{" not in name:
            plain[name] = float(value)
    return series, plain, errors


def scrape(agent: Slatrace, timeout: float = 30.0) -> Scrape:
    before = cpu_ticks(agent.pid)
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=timeout) as resp:
        body = resp.read()
    seconds = time.monotonic() - t0
    ticks = cpu_ticks(agent.pid) - before
    series, plain, errors = parse_exposition(body.decode(errors="replace"))
    return Scrape(len(body), series, seconds, ticks, plain.get("slatrace_poll_duration_seconds"),
                  plain.get("slatrace_services_tracked"), errors)


def map_entries(pid: int, dead: frozenset[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Entries of each hash map, and of those the ones naming a dead cgroup."""
    keys = bpfstats.process_map_keys(pid)
    return ({name: len(k) for name, k in keys.items()},
            {name: bpfstats.keys_naming(k, set(dead)) for name, k in keys.items()} if dead else {})


# --- one point ----------------------------------------------------------------

def measure(point: Point, worker: Path, logdir: Path, load_cpus: float, sample_s: float,
            progress: Callable[[str], None]) -> dict[str, Any]:
    agent = Slatrace.start(logdir / f"slatrace-scale-{point.kind}-{point.services}.log")
    try:
        agent.wait_ready()
        maps = bpfstats.process_maps(agent.pid)
        duty = Duty.for_load(point.services, load_cpus, WORK_US)
        total = point.warmup_s + point.window_s
        if point.kind == "services":
            # the workers outlive any slow sampling; they are killed on exit anyway
            workload: Services | Churn = Services(point.services, duty, seconds=total + 600, worker=worker)
        else:
            workload = Churn(CHURN_RATE, CHURN_LIFETIME, total, duty, worker=worker)
        t_start = time.monotonic()
        with workload:
            progress(f"{point.label}: workload started in {time.monotonic() - t_start:.1f} s "
                     f"(each worker {duty.work_us:.0f} us on, ~{duty.sleep_us / 1e3:.1f} ms off); "
                     f"warm-up {point.warmup_s:.0f} s")
            time.sleep(point.warmup_s)
            samples = sample_window(agent, workload, point, sample_s, progress)
            if isinstance(workload, Churn):
                churn = workload.join()
                churn_doc = {"created": churn.created, "removed": churn.removed, "max_live": churn.max_live}
            else:
                churn_doc = None
                alive = workload.alive()
                if alive < point.services:
                    raise RuntimeError(f"only {alive} of {point.services} workers still ran at the end")
        log_errors = agent_errors(agent.log.read_text(errors="replace"))
    finally:
        agent.stop()
    return summarize(point, samples, maps, churn_doc, duty, log_errors)


def agent_errors(log: str, keep: int = 3) -> dict[str, Any]:
    """How many error lines and tracebacks the agent logged; the first few
    tracebacks in full (their last line names the exception)."""
    lines = log.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback") and len(blocks) < keep:
            end = i + 1
            while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
                end += 1
            blocks.append("\n".join(lines[i:end + 1]))
    return {"error_lines": sum(1 for line in lines if " ERROR " in line),
            "tracebacks": sum(1 for line in lines if line.startswith("Traceback")), "first": blocks}


def sample_window(agent: Slatrace, workload: Services | Churn, point: Point, sample_s: float,
                  progress: Callable[[str], None]) -> list[dict[str, Any]]:
    samples = []
    t0 = time.monotonic()
    ticks0 = cpu_ticks(agent.pid)
    errors0: dict[str, float] | None = None
    while True:
        now = time.monotonic()
        dead = workload.dead_ids() if isinstance(workload, Churn) else frozenset()
        sc = scrape(agent)
        if errors0 is None:
            errors0 = sc.map_errors
        entries, dead_entries = map_entries(agent.pid, dead)
        rss, hwm = memory_kib(agent.pid)
        s = {"t": now - t0, "cpu_ticks": cpu_ticks(agent.pid) - ticks0, "scrape_ticks": sc.cpu_ticks,
             "rss_kib": rss, "hwm_kib": hwm, "metrics_bytes": sc.bytes, "series": sc.series,
             "scrape_s": sc.seconds, "poll_s": sc.poll_s, "services_tracked": sc.services_tracked,
             "map_errors": sc.map_errors, "entries": entries, "dead_entries": dead_entries,
             "dead_cgroups": len(dead), "loadavg": float(Path("/proc/loadavg").read_text().split()[0])}
        samples.append(s)
        errs = sum(sc.map_errors.values()) - sum(errors0.values())
        progress(f"{point.label}: t={s['t']:4.0f} s poll {fmt_ms(sc.poll_s)} ms, /metrics "
                 f"{sc.bytes / 1e6:.2f} MB in {sc.seconds * 1e3:.0f} ms, hists {entries.get('hists', 0)} "
                 f"entries, +{errs:.0f} map errors")
        if now - t0 >= point.window_s:
            return samples
        time.sleep(max(0.0, min(sample_s, t0 + point.window_s - time.monotonic())))


def fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.0f}"


def _spread(vals: list[float]) -> dict[str, float | None]:
    vals = [v for v in vals if v is not None]
    if not vals:
        return {"median": None, "max": None}
    return {"median": statistics.median(vals), "max": max(vals)}


def summarize(point: Point, samples: list[dict[str, Any]], maps: list[mapmem.MapInfo],
              churn: dict[str, int] | None, duty: Duty, log_errors: dict[str, Any]) -> dict[str, Any]:
    first, last = samples[0], samples[-1]
    wall = last["t"] - first["t"]
    ticks = last["cpu_ticks"] - first["cpu_ticks"]
    # scrape CPU of the samples after the first, which fall inside [first, last]
    scrape_ticks = sum(s["scrape_ticks"] for s in samples[1:])
    scrapes = len(samples) - 1
    cpu_all = ticks / CLK_TCK / wall * 100 if wall > 0 else None
    cpu_loop = (ticks - scrape_ticks) / CLK_TCK / wall * 100 if wall > 0 else None
    per_scrape_s = scrape_ticks / CLK_TCK / scrapes if scrapes else None
    cpu_prom = (cpu_loop + per_scrape_s / PROMETHEUS_SCRAPE_S * 100
                if cpu_loop is not None and per_scrape_s is not None else None)
    errors_window = {m: v - first["map_errors"].get(m, 0.0) for m, v in last["map_errors"].items()}
    mem = mapmem.summary(maps, mapmem.possible_cpus())
    return {
        "label": point.label, "kind": point.kind, "services": point.services,
        "warmup_s": point.warmup_s, "window_s": wall, "work_us": duty.work_us, "sleep_us": duty.sleep_us,
        "cpu_pct_loop": cpu_loop, "cpu_pct_prometheus": cpu_prom, "cpu_pct_sampled": cpu_all,
        "scrape_cpu_s": per_scrape_s,
        "rss_mib": last["rss_kib"] / 1024, "peak_rss_mib": last["hwm_kib"] / 1024,
        "poll_s": _spread([s["poll_s"] for s in samples]),
        "metrics_bytes": _spread([s["metrics_bytes"] for s in samples]),
        "series": _spread([s["series"] for s in samples]),
        "scrape_s": _spread([s["scrape_s"] for s in samples]),
        "services_tracked": last["services_tracked"],
        "loadavg": _spread([s.get("loadavg") for s in samples]),
        "entries": last["entries"], "max_entries": {m.name: m.max_entries for m in maps},
        "dead_entries": last["dead_entries"], "dead_cgroups": last["dead_cgroups"],
        "map_errors_window": errors_window, "map_errors_total": last["map_errors"],
        "memory": mem, "churn": churn, "agent_log_errors": log_errors, "samples": samples,
    }


# --- the section ----------------------------------------------------------------

def run(pts: list[Point], logdir: Path, load_cpus: float, sample_s: float,
        progress: Callable[[str], None]) -> dict[str, Any]:
    worker = compile_worker(logdir)
    results = []
    for p in pts:
        progress(f"scale: {p.label}, {p.warmup_s:.0f} s warm-up + {p.window_s:.0f} s measured")
        results.append(measure(p, worker, logdir, load_cpus, sample_s, progress))
        time.sleep(1.0)
    return {"settings": {"load_cpus": load_cpus, "work_us": WORK_US, "sample_s": sample_s,
                         "churn_rate": CHURN_RATE, "churn_lifetime_s": CHURN_LIFETIME,
                         "prometheus_scrape_s": PROMETHEUS_SCRAPE_S},
            "points": results, "targets": targets(results)}


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    big = [r for r in results if r["kind"] == "services" and r["services"] >= 1000]
    for r in big:
        for name, value, limit, fmt in (
                ("poll (max)", r["poll_s"]["max"], POLL_LIMIT_S, "{:.0f} ms"),
                ("agent CPU, Prometheus scraping every 15 s", r["cpu_pct_prometheus"], CPU_LIMIT_PCT, "{:.1f} %"),
                ("/metrics scrape (max)", r["scrape_s"]["max"], SCRAPE_LIMIT_S, "{:.0f} ms")):
            scale = 1e3 if "ms" in fmt else 1
            out.append({"name": f"{r['label']}: {name}", "value": value,
                        "measured": "n/a" if value is None else fmt.format(value * scale),
                        "limit": "≤ " + fmt.format(limit * scale),
                        "pass": None if value is None else value <= limit})
    for r in results:
        if r["kind"] == "churn" or r["services"] >= 1000:
            errs = sum(r["map_errors_window"].values())
            out.append({"name": f"{r['label']}: BPF map errors during the window", "value": errs,
                        "measured": f"{errs:.0f}", "limit": "0", "pass": errs == 0})
        if r["kind"] == "churn":
            dead = sum(r["dead_entries"].values())
            out.append({"name": f"{r['label']}: map entries naming removed cgroups at the end", "value": dead,
                        "measured": f"{dead}", "limit": "≈ 0 (the last interval's)",
                        "pass": dead <= CHURN_RATE * 2 * 50})
    mem = max((r["memory"]["bytes_64"] for r in results), default=None)
    if mem:
        out.append({"name": "BPF map memory at 64 possible CPUs (formula)", "value": mem,
                    "measured": f"{mem / mapmem.MIB:.1f} MiB", "limit": "≤ 64 MiB",
                    "pass": mem <= mapmem.MEMORY_LIMIT_64})
    return out
