"""PNG plots of the bench, for BENCHMARKS.md (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOT_PER_CGROUP = ("tasks", "watched")   # keyed by tid; the configured watch list


def _maps(points: list[dict[str, Any]]) -> list[str]:
    """The per-cgroup hash maps the agent had, in the order first seen."""
    return [m for m in dict.fromkeys(m for p in points for m in p["entries"]) if m not in NOT_PER_CGROUP]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scale(doc: dict[str, Any], outdir: Path) -> list[Path]:
    """scale.png (cost against the number of services) and churn.png (maps
    over time under churn); returns the files written."""
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    services = [p for p in doc["points"] if p["kind"] == "services"]
    if services:
        written.append(_services(services, doc["settings"], outdir / "scale.png"))
    for p in doc["points"]:
        if p["kind"] == "churn":
            written.append(_churn(p, outdir / "churn.png"))
    return written


def _services(points: list[dict[str, Any]], settings: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    n = [p["services"] for p in points]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))

    a = ax[0][0]
    a.plot(n, [p["cpu_pct_loop"] for p in points], "o-", label="collection loop")
    a.plot(n, [p["cpu_pct_prometheus"] for p in points], "s--",
           label=f"with a scrape every {settings['prometheus_scrape_s']:.0f} s")
    a.axhline(5, color="grey", lw=0.8, ls=":", label="target 5 %")
    a.set_ylabel("agent CPU, % of a core")
    a.legend(fontsize=8)

    a = ax[0][1]
    a.plot(n, [_ms(p["poll_s"]["median"]) for p in points], "o-", label="median")
    a.plot(n, [_ms(p["poll_s"]["max"]) for p in points], "s--", label="max")
    a.axhline(100, color="grey", lw=0.8, ls=":", label="target 100 ms")
    a.set_ylabel("poll duration, ms")
    a.legend(fontsize=8)

    a = ax[1][0]
    a.plot(n, [(p["metrics_bytes"]["median"] or 0) / 1e6 for p in points], "o-", label="/metrics MB")
    a.set_ylabel("/metrics size, MB")
    b = a.twinx()
    b.plot(n, [_ms(p["scrape_s"]["median"]) for p in points], "s--", color="tab:red", label="scrape ms")
    b.set_ylabel("scrape time, ms", color="tab:red")
    a.legend(loc="upper left", fontsize=8)

    a = ax[1][1]
    for name in _maps(points):
        a.plot(n, [100.0 * p["entries"].get(name, 0) / max(1, p["max_entries"].get(name, 1)) for p in points],
               "o-", label=name)
    a.set_ylabel("map entries, % of max_entries")
    b = a.twinx()
    b.bar(n, [sum(p["map_errors_window"].values()) for p in points], width=[x * 0.3 for x in n],
          alpha=0.25, color="tab:red")
    b.set_ylabel("map errors during the window", color="tab:red")
    a.legend(fontsize=8, loc="upper left")

    for a in (ax[0][0], ax[0][1], ax[1][0], ax[1][1]):
        a.set_xscale("log")
        a.set_xlabel("busy services (one cgroup and worker each)")
        a.grid(alpha=0.3)
    fig.suptitle("slatrace beside N busy services")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _churn(point: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    samples = point["samples"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.2))

    a = ax[0]
    for name in _maps(samples):
        a.plot(t, [s["entries"].get(name, 0) for s in samples], "-", label=name)
    a.plot(t, [sum(s["dead_entries"].values()) for s in samples], "k--", label="all maps: naming removed cgroups")
    a.set_ylabel("map entries")
    a.legend(fontsize=8)

    a = ax[1]
    base = samples[0]["map_errors"]
    for name in sorted({k for s in samples for k in s["map_errors"]}):
        a.plot(t, [s["map_errors"].get(name, 0) - base.get(name, 0) for s in samples], "-", label=name)
    a.set_ylabel("map errors since the window began")
    a.legend(fontsize=8)

    a = ax[2]
    a.plot(t, [_ms(s["poll_s"]) for s in samples], "o-", label="poll")
    a.plot(t, [s["scrape_s"] * 1e3 for s in samples], "s--", label="/metrics scrape")
    a.set_ylabel("ms")
    a.legend(fontsize=8)

    for a in ax:
        a.set_xlabel("seconds into the measured window")
        a.grid(alpha=0.3)
    fig.suptitle(f"slatrace under {point['label']} ({point['churn']['created']} cgroups created and removed)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1e3


def cost(res: dict[str, Any], path: Path) -> Path:
    """cost.png: per workload, each tool's added cost per context switch (the
    workload's slowdown) and its programs' own time per switch; then the
    toggled measurement's added cost, where it ran."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    tools = ("slatrace", "runqlat")
    toggled = res.get("toggle", {})
    workloads = list(res["total_cost"]) + [f"{w} (pinned),\ntoggled" for w in toggled]
    fig, ax = plt.subplots(figsize=(11 if toggled else 9, 4.2))
    width = 0.2
    for i, tool in enumerate(tools):
        total = [_ns(res["total_cost"][w]["wall"]["added_ns_per_switch"][tool]) for w in res["total_cost"]]
        total += [m[tool]["mean_ns"] for m in toggled.values()]
        prog = [_ns((res["alone"]["summary"].get(w, {}).get(tool) or {}).get("all_programs_ns_per_switch"))
                for w in res["total_cost"]] + [float("nan")] * len(toggled)
        xs = [k + (i - 0.5) * 2 * width for k in range(len(workloads))]
        ax.bar([x - width / 2 for x in xs], total, width, label=f"{tool}: the workload's slowdown per switch",
               color=f"C{i}")
        ax.bar([x + width / 2 for x in xs], prog, width, label=f"{tool}: BPF programs' own time",
               color=f"C{i}", alpha=0.45, hatch="//")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("ns per context switch")
    ax.set_title(f"Added cost per context switch ({res['machine']['date'][:10]}, median of "
                 f"{res['settings']['rounds_done']} rounds)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def modes(results: dict[str, dict[str, Any]], path: Path) -> Path:
    """modes.png: per workload of a bench.toggle run, what each arm adds per
    context switch (mean over its windows, with the windows' 95% interval of
    the mean): slatrace in each attach mode, the floor, runqlat-bpfcc."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    arms = [a for a in next(iter(results.values())) if isinstance(next(iter(results.values()))[a], dict)]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        means = [results[w][arm]["mean_ns"] for w in results]
        errs = [1.96 * results[w][arm]["sd_ns"] / max(results[w][arm]["windows"], 1) ** 0.5 for w in results]
        xs = [k + (i - (len(arms) - 1) / 2) * width for k in range(len(results))]
        ax.bar(xs, means, width, yerr=errs, capsize=2, label=arm, color=f"C{i}")
    ax.set_xticks(range(len(results)), [f"{w} (pinned)" for w in results])
    ax.set_ylabel("added ns per context switch")
    ax.set_title("Each arm toggled within one long run (python -m bench.toggle)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ns(v: float | None) -> float:
    return float("nan") if v is None else v


def fleet(doc: dict[str, Any], path: Path) -> Path:
    """fleet.png: Prometheus's cost and the CLI's time against the number of
    nodes, measured points and the straight line to the extrapolated fleet."""
    plt = _pyplot()
    pts = sorted(doc["points"], key=lambda p: p["nodes"])
    ext = doc["extrapolated"]
    n = [p["nodes"] for p in pts]
    panels = [
        ("Prometheus RSS, GiB", [p["rss_bytes"] / 2**30 for p in pts],
         None if ext.get("rss_bytes") is None else ext["rss_bytes"] / 2**30),
        ("samples appended / s (thousands)", [p["samples_per_s"] / 1e3 for p in pts],
         None if ext.get("samples_per_s") is None else ext["samples_per_s"] / 1e3),
        ("rule evaluation, s (all groups)", [p["rule_eval_all_s"]["median"] for p in pts], ext.get("rule_eval_all_s")),
        ("slatrace attribution --prometheus, s", [p["cli_all_s"]["median"] for p in pts], ext.get("cli_all_s")),
    ]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    for a, (label, ys, far) in zip([x for row in ax for x in row], panels):
        a.plot(n, ys, "o-", label="measured")
        if far is not None:
            a.plot([n[-1], ext["nodes"]], [ys[-1], far], "s:", color="grey", label="extrapolated")
        a.set_xscale("log")
        a.set_xlabel("nodes")
        a.set_ylabel(label)
        a.legend(fontsize=8)
    ax[1][1].axhline(2.0, color="red", lw=0.8, ls=":", label="target 2 s")
    fig.suptitle(f"The fleet scene: {doc['settings']['services_per_node']} services a node, scraped every "
                 f"{doc['settings']['scrape_s']} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
