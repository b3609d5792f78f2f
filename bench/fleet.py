"""The fleet section of `make bench` (`--sections fleet`): what N nodes cost the
Prometheus that scrapes them, and how long the fleet answers take.

For each N (default 100, 300, 1,000 nodes; `--fleet-nodes` chooses) the fleet
scene of the tests (tests/support/fleet.py, ≥20 services a node, each node's
exposition written by the agent's own exporter from a node state of its own)
is served by tests/support/fleet_server.py (a process per 500 nodes, each
node rendered in the background just before its scrape), and Debian's
Prometheus scrapes every node every 15 s and evaluates
the shipped rule file (deploy/rules/slatrace.rules.yaml) every 15 s, both
under nice 10. Once the rules' 5 m windows are full, Prometheus's own metrics
are read for a minute: head series, samples appended per second, resident
memory, CPU, each rule group's evaluation time; then `slatrace attribution
--prometheus` is timed over 5 minutes of the fleet (all services, and one),
the window the fleet rules record, so it reads their series when they are
fresh (the path each run took is kept).
Series per node at 20, 100 and 1,000 services come from the exporter alone
(bench/export_budget.py). The figures for 10,000 nodes are extrapolated
linearly from the largest two points (the assumptions are printed with them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import export_budget, plots, report
from tests.support.agent import REPO, SLATRACE, http_get
from tests.support.fleet import FleetSpec
from tests.support.fleet_server import prometheus_targets, running_fleet
from tests.support.prometheus import RULES, running_prometheus

NODES = (100, 300, 1000)
SCRAPE_S = 15
WARM_S = 5 * 60 + 2 * SCRAPE_S     # the rules' 5 m windows full, plus two scrapes
MEASURE_S = 60
SERVICES_PER_NODE = (20, 100, 1000)
EXTRAPOLATE_TO = 10_000
CLI_SINCE = 300
CLI_TARGET_S = 2.0
FLEET_GROUP = "slatrace.fleet"


def prometheus_figures(url: str) -> dict[str, Any]:
    """Prometheus's own metrics, the ones this section reports."""
    status, body = http_get(url + "/metrics", timeout=30.0)
    assert status == 200, status
    out: dict[str, Any] = {"groups": {}}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name == "process_resident_memory_bytes":
                out["rss"] = s.value
            elif s.name == "process_cpu_seconds_total":
                out["cpu_s"] = s.value
            elif s.name == "prometheus_tsdb_head_series":
                out["series"] = s.value
            elif s.name == "prometheus_tsdb_head_samples_appended_total":
                out["appended"] = out.get("appended", 0.0) + s.value
            elif s.name == "prometheus_rule_group_last_duration_seconds":
                out["groups"][s.labels["rule_group"].rpartition(";")[2]] = s.value
            elif s.name == "go_memstats_heap_inuse_bytes":
                out["heap"] = s.value
    return out


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait), from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def rule_reads(url: str) -> dict[str, dict[str, float]]:
    """Per rule group, the samples one evaluation round reads and the time the
    query engine spends on it (each rule's expression run with stats=all):
    the samples do not depend on how loaded the machine is, the time does."""
    out: dict[str, dict[str, float]] = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        total = out.setdefault(group["name"], {"samples": 0.0, "eval_s": 0.0})
        for rule in group["rules"]:
            query = urllib.parse.urlencode({"query": rule["expr"], "stats": "all"})
            status, body = http_get(f"{url}/api/v1/query?{query}", timeout=120.0)
            stats = json.loads(body)["data"]["stats"] if status == 200 else None
            if stats:
                total["samples"] += stats["samples"]["totalQueryableSamples"]
                total["eval_s"] += stats["timings"]["evalTotalTime"]
    return out


def time_cli(url: str, *service: str) -> tuple[float, str | None, str | None]:
    """Seconds the command took, its error if it failed (a query past the
    CLI's 10 s timeout on a starved machine: a failure is a figure too), and
    the path it took (the records' `source`: recorded series or raw counters)."""
    start = time.monotonic()
    r = subprocess.run(SLATRACE + ["attribution", *service, "--prometheus", url, "--since", str(CLI_SINCE), "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    if r.returncode:
        return took, r.stderr.strip() or f"exit {r.returncode}", None
    sources = {rec.get("source") for rec in json.loads(r.stdout)["attribution"]}
    return took, None, "/".join(sorted(s for s in sources if s)) or None


def _cli_times(runs: list[tuple[float, str | None, str | None]]) -> dict[str, Any]:
    ok = [t for t, e, _ in runs if not e] or [math.nan]
    paths = sorted({p for _, e, p in runs if not e and p})
    return {"median": statistics.median(ok), "values": ok, "paths": paths}


def run_point(nodes: int, services: int, progress: Callable[[str], None], warm_s: float = WARM_S,
              measure_s: float = MEASURE_S) -> dict[str, Any]:
    spec = FleetSpec(nodes=nodes, services_per_node=services)
    tmp = Path(tempfile.mkdtemp(prefix="slatrace-bench-fleet-"))
    progress(f"fleet: {nodes} nodes x {services} services, scraped every {SCRAPE_S} s")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with running_fleet(spec, nice=10, scrape_s=SCRAPE_S) as fleet:
        scrape = [{"job_name": "slatrace", "static_configs": prometheus_targets(spec, fleet)}]
        with running_prometheus(tmp, scrape_configs=scrape, interval=f"{SCRAPE_S}s", rule_files=(RULES,),
                                nice=10, timeout=120) as prom:
            time.sleep(warm_s)
            first, t0, server0, busy0 = prometheus_figures(prom.url), time.monotonic(), fleet.stats(), busy_cpu_s()
            samples = [first]
            while time.monotonic() - t0 < measure_s:
                time.sleep(SCRAPE_S)
                samples.append(prometheus_figures(prom.url))
            last, elapsed, server, busy = samples[-1], time.monotonic() - t0, fleet.stats(), busy_cpu_s()
            up = prom.query('count(up{job="slatrace"} == 1)')
            failed = prom.query(f'sum(count_over_time(up{{job="slatrace"}}[{int(warm_s + measure_s)}s]) '
                                f'- sum_over_time(up{{job="slatrace"}}[{int(warm_s + measure_s)}s]))')
            scrape_s = prom.query('quantile(0.99, scrape_duration_seconds{job="slatrace"})')
            reads = rule_reads(prom.url)
            progress(f"fleet: {nodes} nodes measured; timing slatrace attribution --prometheus")
            cli_all = [time_cli(prom.url) for _ in range(3)]
            cli_one = [time_cli(prom.url, "llm/vllm") for _ in range(3)]
    errors = [e for _, e, _ in cli_all + cli_one if e]
    fleet_eval = [s["groups"].get(FLEET_GROUP, 0.0) for s in samples]
    all_eval = [sum(s["groups"].values()) for s in samples]
    return {
        "nodes": nodes, "services_per_node": services, "started": started,
        "nodes_up": int(float(up[0]["value"][1])) if up else 0,
        "failed_scrapes": int(float(failed[0]["value"][1])) if failed else 0,
        "scrape_p99_s": float(scrape_s[0]["value"][1]) if scrape_s else None,
        "head_series": last["series"], "series_per_node": last["series"] / nodes,
        "samples_per_s": (last["appended"] - first["appended"]) / elapsed,
        "rss_bytes": statistics.median(s["rss"] for s in samples),
        "rss_max_bytes": max(s["rss"] for s in samples),
        "heap_bytes": statistics.median(s["heap"] for s in samples),
        "cpu_pct": 100 * (last["cpu_s"] - first["cpu_s"]) / elapsed,
        "rule_eval_fleet_s": {"median": statistics.median(fleet_eval), "max": max(fleet_eval)},
        "rule_eval_all_s": {"median": statistics.median(all_eval), "max": max(all_eval)},
        "rule_samples_fleet": reads.get(FLEET_GROUP, {}).get("samples"),
        "rule_samples_all": sum(g["samples"] for g in reads.values()),
        "rule_query_s_all": sum(g["eval_s"] for g in reads.values()),
        "cli_all_s": _cli_times(cli_all),
        "cli_one_s": _cli_times(cli_one),
        "cli_errors": errors,
        # The node server: its processes' CPU over the measured minute, and the
        # scrapes it had to render when they came (its renderer behind).
        "server_workers": len(fleet.addresses),
        "server_cpu_pct": 100 * (server.get("cpu_s", 0.0) - server0.get("cpu_s", 0.0)) / elapsed,
        "server_scrapes": server.get("scrapes", 0),
        "server_on_demand": server.get("rendered_on_demand", 0),
        # Everything else on the machine over the same minute: this bench's own
        # sampling, and whatever other people ran.
        "others_cpu_pct": 100 * ((busy - busy0) - (last["cpu_s"] - first["cpu_s"])
                                 - (server.get("cpu_s", 0.0) - server0.get("cpu_s", 0.0))) / elapsed,
    }


def series_budget() -> list[dict[str, Any]]:
    """Series one node exports at 20, 100 and 1,000 services, budget on and every service bucketed."""
    out = []
    for n in SERVICES_PER_NODE:
        for histograms in ((), ("*",)):
            r = export_budget.measure(n, histograms)
            out.append({k: r[k] for k in ("services", "histograms", "series", "bytes", "max_per_service")})
    return out


def extrapolate(points: list[dict[str, Any]], key: Callable[[dict[str, Any]], float],
                to: int = EXTRAPOLATE_TO) -> float | None:
    """A least-squares straight line through every point, at `to` nodes; the
    slope at least zero (a cost does not fall as the fleet grows: a negative
    slope is the machine's noise)."""
    if len({p["nodes"] for p in points}) < 2:
        return None
    xs, ys = [p["nodes"] for p in points], [key(p) for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return my + slope * (to - mx)


def run(nodes: list[int], services: int, progress: Callable[[str], None], warm_s: float = WARM_S,
        measure_s: float = MEASURE_S) -> dict[str, Any]:
    budget = series_budget()
    points = [run_point(n, services, progress, warm_s, measure_s) for n in nodes]
    doc = {"settings": {"scrape_s": SCRAPE_S, "evaluation_s": SCRAPE_S, "warm_s": warm_s, "measure_s": measure_s,
                        "services_per_node": services, "cli_since_s": CLI_SINCE, "nice": 10},
           "budget": budget, "points": points}
    doc["extrapolated"] = extrapolated(doc)
    doc["targets"] = targets(points)
    return doc


def targets(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CLI's target, judged at the largest fleet measured."""
    big = max(points, key=lambda p: p["nodes"])
    return [{"name": f"slatrace attribution --prometheus at {big['nodes']} nodes (all services, {CLI_SINCE} s)",
             "measured": _cli(big["cli_all_s"]), "limit": f"≤ {CLI_TARGET_S:.0f} s",
             "value": big["cli_all_s"]["median"], "pass": bool(big["cli_all_s"]["median"] <= CLI_TARGET_S)}]


def failed_share(p: dict[str, Any], settings: dict[str, Any]) -> float:
    """Failed scrapes over the scrapes the point should have made."""
    settings = settings | p.get("settings", {})   # a row kept from an earlier run: its own
    expected = p["nodes"] * (settings["warm_s"] + settings["measure_s"]) / settings["scrape_s"]
    return p["failed_scrapes"] / expected if expected else 0.0


def extrapolated(doc: dict[str, Any], to: int = EXTRAPOLATE_TO) -> dict[str, Any]:
    """The figures at `to` nodes. Series: a straight line through every point
    (each node's series exist once it has been scraped, however slowly);
    samples/s: those series every scrape interval, what a Prometheus that keeps
    up appends; memory: a straight line in the series. Work and times (the
    samples the rules read, rule and CLI times): proportional to the nodes from
    the point whose scrapes failed least, since on a starved machine the larger
    points measure the machine, not the work."""
    points, settings = doc["points"], doc["settings"]
    series = extrapolate(points, lambda p: p["head_series"], to)
    if series is None:
        return {"nodes": to}
    by_series = [{"nodes": p["head_series"], "rss": p["rss_bytes"]} for p in points]
    base = min(points, key=lambda p: failed_share(p, settings))
    scale = to / base["nodes"]
    return {"nodes": to, "head_series": series, "samples_per_s": series / settings["scrape_s"],
            "rss_bytes": extrapolate(by_series, lambda p: p["rss"], int(series)),
            "basis_nodes": base["nodes"],
            "rule_samples_all": base["rule_samples_all"] * scale,
            "rule_query_s_all": base["rule_query_s_all"] * scale,
            "rule_eval_all_s": base["rule_eval_all_s"]["median"] * scale,
            "rule_eval_fleet_s": base["rule_eval_fleet_s"]["median"] * scale,
            "cli_all_s": _cli_at(points, base, scale, "cli_all_s"),
            "cli_one_s": _cli_at(points, base, scale, "cli_one_s"),
            "cli_recorded": all(_recorded(p, "cli_all_s") and _recorded(p, "cli_one_s") for p in points)}


def _recorded(p: dict[str, Any], key: str) -> bool:
    return p[key].get("paths") == ["prometheus_recorded"]


def _cli_at(points: list[dict[str, Any]], base: dict[str, Any], scale: float, key: str) -> float:
    """The CLI's time at a larger fleet: on the recorded path the largest
    measured, as the series it reads do not grow with the nodes; else in
    proportion to the nodes."""
    if all(_recorded(p, key) for p in points):
        return max(p[key]["median"] for p in points)
    return base[key]["median"] * scale


def _server(p: dict[str, Any]) -> str:
    if "server_cpu_pct" not in p:
        return "–"
    late = max(0, p["server_on_demand"] - p["nodes"])
    return f"{p['server_cpu_pct']:.0f}; {late:,} of {p['server_scrapes']:,}"


FLEET_BEGIN = ("<!-- BEGIN fleet results: written by `make bench ARGS='--sections fleet'`; "
               "edits inside are overwritten -->")
FLEET_END = "<!-- END fleet results -->"


def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f}"


_PATHS = {"prometheus_recorded": "recorded", "prometheus": "raw"}


def _cli(t: dict[str, Any]) -> str:
    """A CLI time with the path it took: the rules' recorded series or the raw counters."""
    paths = "/".join(_PATHS.get(p, p) for p in t.get("paths", []))
    return f"{t['median']:.2f} s" + (f" ({paths})" if paths else "")


def render(res: dict[str, Any], image: str | None) -> str:
    doc = res["fleet"]
    s = doc["settings"]
    m = res["machine"]
    points = sorted(doc["points"], key=lambda p: p["nodes"])
    intro = (f"Measured {m['date']} on {m['nproc']} CPUs, kernel {m['kernel']}, commit {m['commit']}, with "
           f"`{m['command']}`. Debian's Prometheus scrapes every node every {s['scrape_s']} s and evaluates "
           f"the shipped rules every {s['evaluation_s']} s (both under nice {s['nice']}; *other work* is the CPU "
           f"the rest of the machine used meanwhile, of {m['nproc']} CPUs = {100 * m['nproc']}%); "
           f"each point is read over {s['measure_s']:.0f} s once the rules' 5 m windows are "
           f"full ({s['warm_s']:.0f} s after the start). {s['services_per_node']} services a node, about 40% "
           "of them with buckets (an SLO or a `histograms` entry). The nodes are served by "
           "tests/support/fleet_server.py, a process per 500 nodes, each node's exposition rendered by the agent's "
           "exporter in the background just before its scrape (*node server*: its processes' CPU, and the scrapes it "
           "had to render when they came beyond each node's first, its renderer behind). The CLI times say which "
           "path it took: *recorded* (the fleet rules' 5 m series) or *raw* (every node's counters re-summed).")
    kept = [p for p in points if p.get("kept_from")]
    if kept:
        intro += (" Rows kept from an earlier run (this one did not measure those node counts): "
                  + "; ".join(f"{p['nodes']:,} nodes measured {p['kept_from']}" for p in kept)
                  + f"; the other rows measured by this run, from {m['date']}.")
    out = [intro, ""]
    out += ["| nodes | head series | series / node | samples / s | Prometheus RSS MiB | Prometheus CPU % | "
            "rule groups' evaluation (Prometheus's own, median / max; fleet group) | samples one round of the "
            "rules reads | the same rounds' query time | CLI, all services | CLI, one service "
            "| failed scrapes | scrape p99 | node server CPU %, scrapes rendered late | other work CPU % |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        out.append(f"| {p['nodes']:,} | {p['head_series']:,.0f} | {p['series_per_node']:,.0f} | "
                   f"{p['samples_per_s']:,.0f} | {_mib(p['rss_bytes'])} | {p['cpu_pct']:.0f} | "
                   f"{p['rule_eval_all_s']['median']:.2f} / {p['rule_eval_all_s']['max']:.2f} s; "
                   f"{p['rule_eval_fleet_s']['median']:.2f} s | {p['rule_samples_all']:,.0f} | "
                   f"{p['rule_query_s_all']:.2f} s | {_cli(p['cli_all_s'])} | "
                   f"{_cli(p['cli_one_s'])} | {p['failed_scrapes']:,} "
                   f"({failed_share(p, s):.0%}) | "
                   f"{(p['scrape_p99_s'] or 0) * 1e3:.0f} ms | {_server(p)} | "
                   + (f"{max(0.0, p['others_cpu_pct']):.0f} |" if p.get("others_cpu_pct") is not None else "– |"))
    e = doc["extrapolated"]
    if e.get("rss_bytes") is not None:
        out.append(f"| **{e['nodes']:,}** (extrapolated) | {e['head_series']:,.0f} | | {e['samples_per_s']:,.0f} | "
                   f"{_mib(e['rss_bytes'])} | | {e['rule_eval_all_s']:.1f} s; {e['rule_eval_fleet_s']:.1f} s | "
                   f"{e['rule_samples_all']:,.0f} | {e['rule_query_s_all']:.1f} s | {e['cli_all_s']:.1f} s | "
                   f"{e['cli_one_s']:.1f} s | | | | |")
    starved = ", ".join(f"{p['nodes']:,}" + (f" (other work {p['others_cpu_pct']:.0f}%)"
                                             if p.get("others_cpu_pct") is not None else "")
                        for p in points if failed_share(p, s) > 0.02)
    if starved:
        out += ["", "Failed scrapes are timeouts: the node server and Prometheus, both at nice 10, did not get "
                f"the CPU they needed at {starved} nodes. There the "
                "samples appended, rule and CLI times measure the starved machine, not the work; the series and "
                "memory stand (a node's series exist once it has been scraped)."]
    if e.get("rss_bytes") is not None:
        out += ["", f"Extrapolated to {e['nodes']:,} nodes: head series on a straight line through the points; "
                f"samples/s as those series every {s['scrape_s']} s (a Prometheus that keeps up); memory on a "
                f"straight line in the series; the rules' samples and rule times in proportion to the nodes "
                f"from the {e['basis_nodes']:,}-node point (the one whose scrapes failed least); "
                + (("the CLI's times as the largest measured, since on the recorded path the series it reads do "
                    "not grow with the nodes (the Prometheus it asks must keep its rules up to date: at 10,000 "
                    "nodes a shard's)")
                   if e.get("cli_recorded") else "the CLI's times likewise (it read raw series).")]
    out += ["", "Series one node exports (the exporter alone, bench/export_budget.py):", "",
            "| services on the node | budget on (buckets only for SLO/rule services: none here) | "
            "every service with buckets (`histograms: [\"*\"]`) |", "|---:|---:|---:|"]
    by_n: dict[int, dict[str, int]] = {}
    for b in doc["budget"]:
        by_n.setdefault(b["services"], {})[b["histograms"]] = b["series"]
    for n, v in sorted(by_n.items()):
        out.append(f"| {n:,} | {v.get('(budget)', 0):,} | {v.get('*', 0):,} |")
    out.append("")
    for p in points:
        if p.get("cli_errors"):
            out.append(f"At {p['nodes']:,} nodes {len(p['cli_errors'])} of the 6 CLI runs failed: "
                       f"{p['cli_errors'][0]}")
    for t in doc["targets"]:
        verdict = "pass" if t["pass"] else "MISSED"
        out.append(f"Target: {t['name']}: {t['measured']} ({t['limit']}): **{verdict}**.")
    if image:
        out += ["", f"![fleet cost against the number of nodes]({image})"]
    return "\n".join(out) + "\n"


def keep_rows(res: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`res` with the fleet points of `earlier` (another run's raw results)
    whose node counts it did not measure, each marked with when and at which
    commit it was measured; the extrapolation and the target made again."""
    doc = res["fleet"]
    measured = {p["nodes"] for p in doc["points"]}
    m = earlier["machine"]
    for p in earlier["fleet"]["points"]:
        if p["nodes"] not in measured:
            doc["points"].append(p.get("kept_from") and p or p | {
                "kept_from": f"{m['date']}, commit {m['commit']}, with `{m['command']}`",
                "settings": {k: earlier["fleet"]["settings"][k] for k in ("warm_s", "measure_s", "scrape_s")}})
    doc["extrapolated"] = extrapolated(doc)
    doc["targets"] = targets(doc["points"])
    return res


def main(argv: list[str] | None = None) -> int:
    """Write the fleet section of BENCHMARKS.md and its plot again from raw
    results, optionally keeping the rows of an earlier run the newer one did
    not measure (a run of the largest fleet alone, when the whole run does not fit)."""
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=main.__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="bench-results/bench-*.json of the run with the fleet section")
    p.add_argument("--keep-rows-from", type=Path, metavar="EARLIER.json",
                   help="an earlier run's raw results whose other node counts stay in the table")
    args = p.parse_args(argv)
    res = json.loads(args.results.read_text())
    merged = args.results
    if args.keep_rows_from:
        res = keep_rows(res, json.loads(args.keep_rows_from.read_text()))
        merged = args.results.with_name(args.results.stem + "-kept.json")
        merged.write_text(json.dumps(res, indent=2) + "\n")
    image = plots.fleet(res["fleet"], REPO / "docs" / "bench" / "fleet.png")
    md = render(res, image.relative_to(REPO).as_posix())
    report.update_markdown(REPO / "BENCHMARKS.md", md, FLEET_BEGIN, FLEET_END, "Fleet results")
    print(md)
    print(f"raw results: {merged}; BENCHMARKS.md updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
