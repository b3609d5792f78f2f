"""The bench's Markdown: a summary for the terminal and the generated section
of BENCHMARKS.md, both rendered from the same results document (the JSON)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN bench results: written by `make bench`; edits inside are overwritten -->"
END = "<!-- END bench results -->"
SCALE_BEGIN = "<!-- BEGIN scale results: written by `make bench`; edits inside are overwritten -->"
SCALE_END = "<!-- END scale results -->"

MIB = 1 << 20


def _ns(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def _ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _num(v: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def cost_table(summary: dict[str, dict[str, dict[str, Any]]], tools: tuple[str, ...]) -> list[str]:
    """One row per workload and tool: runs and ns per run of each program kind."""
    rows = ["| workload | tool | sched_switch runs | ns / switch | wakeup(+new) runs | ns / wakeup | "
            "ns / event (switch+wakeup) | all programs, ns per switch |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for workload, by_tool in summary.items():
        for tool in tools:
            c = by_tool.get(tool)
            if not c:
                continue
            rows.append(f"| {workload} | {tool} | {c['switch_runs']} | {_ns(c['switch_ns'])} | {c['wakeup_runs']} | "
                        f"{_ns(c['wakeup_ns'])} | {_ns(c['event_ns'])} | {_ns(c['all_programs_ns_per_switch'])} |")
    return rows


def ratio_lines(summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    rows = ["| workload | switch | wakeup | per event | all programs per switch |", "|---|---:|---:|---:|---:|"]
    for workload, by_tool in summary.items():
        s, r = by_tool.get("slatrace"), by_tool.get("runqlat")
        if not s or not r:
            continue

        def q(key: str) -> str:
            return _ratio(s[key] / r[key] if s[key] and r[key] else None)

        rows.append(f"| {workload} | {q('switch_ns')} | {q('wakeup_ns')} | {q('event_ns')} | "
                    f"{q('all_programs_ns_per_switch')} |")
    return rows


def interval(iv: list[float] | None, prefix: str = "") -> str:
    """" (0.74–0.92)" after a ratio, or "" without an interval."""
    return f" ({prefix}{iv[0]:.2f}–{iv[1]:.2f})" if iv else ""


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    out = ["| target | measured | limit | verdict |", "|---|---:|---:|---|"]
    for t in targets:
        if t["pass"] is None:
            # A ratio whose interval spans the limit, or with no interval from
            # enough rounds (the noise exceeds runqlat's cost): this run cannot tell.
            if t.get("interval") is not None:
                verdict = "not resolved (interval spans the limit)"
            else:
                verdict = "n/a" if t.get("value") is None else "not resolved (runqlat's cost within the noise)"
        else:
            verdict = "PASS" if t["pass"] else "**FAIL**"
        out.append(f"| {t['name']} | {t['measured']} | {t['limit']} | {verdict} |")
    return out


def _load(d: dict[str, float | None] | None) -> str:
    return "n/a" if not d or d.get("median") is None else f"{d['median']:.0f} / {d['max']:.0f}"


def _ms(d: dict[str, float | None]) -> str:
    return "n/a" if d.get("median") is None else f"{d['median'] * 1e3:.0f} / {d['max'] * 1e3:.0f}"


def render_scale(res: dict[str, Any], images: list[str]) -> str:
    """The scale section: the agent beside N services and beside churn."""
    m = res["machine"]
    sc = res["scale"]
    st = sc["settings"]
    out = [
        f"Measured {m['date']} on {m['nproc']} CPUs ({m['possible_cpus']} possible), kernel {m['kernel']}, "
        f"commit {m['commit']} (bpf/sched.bpf.c sha256 {m['bpf_source_sha256']}).",
        "",
        f"Command: `{m['command']}`. Every worker computes ~{st['work_us']:.0f} us per round and sleeps so "
        f"that all of them together ask for {st['load_cpus']:g} CPUs; churn: {st['churn_rate']:.0f} new cgroups "
        f"a second, each killed and removed after {st['churn_lifetime_s']:.0f} s. A sample every "
        f"{st['sample_s']:.0f} s.",
        "",
        "### Targets",
        "",
    ] + targets_table(sc["targets"])
    out += ["", "### Agent cost", "",
            f"| point | CPU, % of a core (collection) | CPU with a scrape every {st['prometheus_scrape_s']:.0f} s | "
            "RSS / peak MiB | poll ms (median / max) | /metrics MB | series | scrape ms (median / max) | "
            "services_tracked | host load average (median / max) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sc["points"]:
        mb = p["metrics_bytes"]["median"]
        out.append(f"| {p['label']} | {_num(p['cpu_pct_loop'], '{:.1f}')} | "
                   f"{_num(p['cpu_pct_prometheus'], '{:.1f}')} | "
                   f"{p['rss_mib']:.0f} / {p['peak_rss_mib']:.0f} | {_ms(p['poll_s'])} | "
                   f"{_num(mb / 1e6 if mb else None, '{:.2f}')} | {_num(p['series']['median'], '{:.0f}')} | "
                   f"{_ms(p['scrape_s'])} | {_num(p['services_tracked'], '{:.0f}')} | {_load(p.get('loadavg'))} |")
    columns = [c for c in dict.fromkeys(c for p in sc["points"] for c in p["entries"]) if c != "watched"]
    out += ["", "### BPF maps at the end of the window", "",
            "| point | " + " | ".join(f"{c} entries / max" for c in columns) +
            " | entries naming removed cgroups | map errors during the window |",
            "|---|" + "---:|" * (len(columns) + 2)]
    for p in sc["points"]:
        cells = [f"{p['entries'].get(c, 0)} / {p['max_entries'].get(c, 0)}" for c in columns]
        dead = (f"{sum(p['dead_entries'].values())} (of {p['dead_cgroups']} removed cgroups)"
                if p["kind"] == "churn" else "–")
        errs = {k: v for k, v in p["map_errors_window"].items() if v}
        err_cell = ", ".join(f"{k} {v:.0f}" for k, v in sorted(errs.items())) or "0"
        out.append(f"| {p['label']} | " + " | ".join(cells) + f" | {dead} | {err_cell} |")
    for p in sc["points"]:
        if p.get("churn"):
            c = p["churn"]
            out += ["", f"{p['label']}: {c['created']} cgroups created and {c['removed']} removed, at most "
                    f"{c['max_live']} alive at once (rate × lifetime: "
                    f"{st['churn_rate'] * st['churn_lifetime_s']:.0f})."]
        errs = p.get("agent_log_errors") or {}
        if errs.get("error_lines") or errs.get("tracebacks"):
            last = [b.splitlines()[-1] for b in errs.get("first", [])]
            out += ["", f"Note: during \"{p['label']}\" the agent logged {errs['error_lines']} error line(s) and "
                    f"{errs['tracebacks']} traceback(s)" + (f", e.g. `{last[0]}`" if last else "") + "."]
    mem = sc["points"][0]["memory"] if sc["points"] else None
    if mem:
        out += ["", f"BPF map memory as loaded: {mem['bytes_here'] / MIB:.1f} MiB by the formula at "
                f"{mem['cpus_here']} CPUs (kernel memlock {mem['memlock_here'] / MIB:.1f} MiB), "
                f"{mem['bytes_64'] / MIB:.1f} MiB at 64 possible CPUs."]
    for img in images:
        out += ["", f"![{Path(img).stem}]({img})"]
    return "\n".join(out) + "\n"


def total_cost_table(res: dict[str, Any]) -> list[str]:
    """The workloads' slowdown and added CPU time per context switch, beside
    the programs' own time; the figure each target is judged on in bold. With
    the floor arm in the rounds, the floor's and each tool's ratio to it."""
    floor = any("floor" in t["wall"]["added_ns_per_switch"] for t in res["total_cost"].values())
    rows = ["| workload | switches per run (no tool) | measure | slatrace: added ns / switch | "
            "runqlat: added ns / switch | slatrace / runqlat |"
            + (" floor: added ns / switch | slatrace / floor | runqlat / floor |" if floor else ""),
            "|---|---:|---|---:|---:|---:|" + ("---:|---:|---:|" if floor else "")]
    tools = ("slatrace", "runqlat", "floor") if floor else ("slatrace", "runqlat")
    for w, t in res["total_cost"].items():
        label = w
        alone = res["alone"]["summary"].get(w, {})
        k = [(alone.get(tool) or {}).get("all_programs_ns_per_switch") for tool in tools]
        for kind, what in (("wall", "wall-clock slowdown"), ("cpu", "workload CPU time")):
            added, ratio = t[kind]["added_ns_per_switch"], _ratio(t[kind]["ratio"])
            ratio += interval(t[kind].get("ratio_95"))
            if kind == t.get("judged"):
                ratio = f"**{ratio}**"
            row = (f"| {label} | {t['switches']:.0f} | {what} | {_ns(added['slatrace'])} | "
                   f"{_ns(added['runqlat'])} | {ratio} |")
            if floor:
                fr, fr95 = t[kind].get("floor_ratio") or {}, t[kind].get("floor_ratio_95") or {}
                row += f" {_ns(added.get('floor'))} |" + "".join(
                    f" {_ratio(fr.get(c))}{interval(fr95.get(c))} |" for c in ("slatrace", "runqlat"))
            rows.append(row)
        ratio = _ratio(k[0] / k[1] if k[0] and k[1] else None)
        row = f"| {label} | | BPF programs' own time | {_ns(k[0])} | {_ns(k[1])} | {ratio} |"
        if floor:
            row += f" {_ns(k[2])} |" + "".join(f" {_ratio(x / k[2] if x and k[2] else None)} |" for x in k[:2])
        rows.append(row)
    return rows


def render(res: dict[str, Any], image: str | None = None) -> str:
    m = res["machine"]
    st = res["settings"]
    out = [
        f"Measured {m['date']} on {m['nproc']} CPUs ({m['possible_cpus']} possible), kernel {m['kernel']}, "
        f"commit {m['commit']} (bpf/sched.bpf.c sha256 {m['bpf_source_sha256']}).",
        "",
        f"Command: `{m['command']}` — {st['rounds_done']} interleaved rounds "
        f"({st['rounds']} asked), {st['together_reps']} repetitions with both tools attached; workloads "
        + ", ".join(f"`{cmd}`" for cmd in st["workloads"].values())
        + (f" (the pinned ones {st['repeat']} times per tool start in the rounds, median kept)"
           if st.get("repeat", 1) > 1 else "") + f"; whole run {res['elapsed_s']:.0f} s.",
        "",
    ]
    if res.get("notes"):
        out += [f"Note: {n}" for n in res["notes"]] + [""]

    out += ["### Targets", ""] + targets_table(res["targets"])

    tools = ("slatrace", "runqlat")
    out += ["", "### In-kernel cost, both tools attached (same events)", ""]
    out += cost_table(res["together"]["summary"], tools)
    out += ["", "slatrace / runqlat:", ""] + ratio_lines(res["together"]["summary"])
    out += ["", "### In-kernel cost, each tool alone (interleaved rounds)", ""]
    out += cost_table(res["alone"]["summary"], tools)
    out += ["", "slatrace / runqlat:", ""] + ratio_lines(res["alone"]["summary"])

    names = list(res["throughput"]["none"])
    out += ["", f"### Workload throughput (median of {st['rounds_done']} rounds; lower is better)", "",
            "| configuration | " + " | ".join(f"{w} | min–max | vs none" for w in names) + " |",
            "|---|" + "---:|---:|---:|" * len(names)]
    for config, by_w in res["throughput"].items():
        cells = []
        for w in names:
            d = by_w[w]
            fmt = "{:.3f}" if w.startswith("hackbench") else "{:.2f}"
            cells.append(f"{_num(d['median'], fmt)} | {_num(d['min'], fmt)}–{_num(d['max'], fmt)} | "
                         f"{_ratio(d['ratio'])}")
        out.append(f"| {config} | " + " | ".join(cells) + " |")

    layout = (f"the pinned workloads on CPU 1, each tool's processes on CPU {st.get('tool_cpu')}"
              if st.get("pinned") else "nothing pinned")
    out += ["", "### Total cost: the workload's slowdown per context switch", "",
            f"The run with the tool minus the run with none of the same round (median over rounds: the host "
            f"drifts during a run by more than the tools cost), over the context switches a run with none "
            f"makes (/proc/stat); {layout}. A pinned workload runs one task at a time on one CPU: its slowdown "
            "per switch is the cost of a switch, the figure the targets are judged on (bold). Unpinned "
            "hackbench spreads over both CPUs and its wall time on this shared VM moves by more than the tools "
            "cost (it can even run faster with a tool attached): shown, not judged. CPU time is the user + "
            "system time of all the workload's processes. In brackets, the ratio's 95% interval from "
            "resampling the rounds: a target passes when the whole interval is within it. Pinned hackbench "
            "spends ~25 us per switch copying its 8 KiB messages and that time moves by ~15% from run to run, "
            "several times what a tool adds, so its interval is wide; the ring switches between as many tasks "
            "every ~6 us. The programs' own time per switch (kernel BPF stats, "
            "the rounds with one tool) is the third line; the rest is what the kernel pays around the program "
            "(tracepoint, record set-up). The floor is one more arm of the rounds: empty programs on "
            "slatrace's six tracepoints, attached as the agent attaches them (bench/floor.py), what any tool "
            "there costs before doing anything; each tool's figure is also given as a ratio to the floor's.",
            ""]
    out += total_cost_table(res)
    if res.get("toggle"):
        out += ["", "### Total cost, the tools toggled within one run", "",
                "One long pinned run per workload; both tools' programs loaded once and attached in turn for "
                "50 ms windows (off, slatrace, off, runqlat, ...; slatrace's on the tracepoints the agent takes "
                "on this kernel, runqlat's raw ones), each tool window's "
                "context-switch rate against the off windows on either side, so the host's drift cancels "
                "(`python -m bench.toggle`). Added ns per switch = 1/rate(tool) − 1/rate(off), mean over "
                "windows; the kernel side only, kernel BPF stats off. In brackets, the ratio's 95% interval "
                "from resampling the windows.", "",
                "| workload | no tool, ns per switch | windows per tool | slatrace, added ns per switch | "
                "runqlat, added ns per switch | slatrace / runqlat |", "|---|---:|---:|---:|---:|---:|"]
        for w, m in res["toggle"].items():
            out.append(f"| {w} (pinned) | {m['off_ns_per_switch']:.0f} | {m['slatrace']['windows']} | "
                       f"{m['slatrace']['mean_ns']:.0f} | {m['runqlat']['mean_ns']:.0f} | "
                       f"**{_ratio(m['ratio'])}{interval(m['ratio_95'])}** |")
    if image:
        out += ["", f"![cost per switch]({image})"]

    a = res["slatrace"]
    out += ["", "### slatrace agent (median of rounds; min–max)", "", "| measure | median | min–max |",
            "|---|---:|---:|"]
    for label, key, scale, fmt in (("start-up, spawn → /readyz 200 (s)", "ready_s", 1, "{:.2f}"),
                                   ("BPF compile + attach, from its log (s)", "attach_s", 1, "{:.2f}"),
                                   ("RSS after the workloads (MiB)", "rss_bytes", MIB, "{:.1f}"),
                                   ("USS after the workloads (MiB)", "uss_bytes", MIB, "{:.1f}"),
                                   ("slatrace_poll_duration_seconds (ms)", "poll_s", 1e-3, "{:.1f}"),
                                   ("agent CPU time during the workloads (ms)", "cpu_s", 1e-3, "{:.0f}")):
        d = a.get(key) or {}
        if d.get("median") is None:
            out.append(f"| {label} | n/a | n/a |")
            continue
        out.append(f"| {label} | {fmt.format(d['median'] / scale)} | "
                   f"{fmt.format(d['min'] / scale)}–{fmt.format(d['max'] / scale)} |")
    rq_ready = res.get("runqlat", {}).get("ready_s") or {}
    if rq_ready.get("median") is not None:
        out.append(f"| runqlat-bpfcc start-up to attached (s), for comparison | {rq_ready['median']:.2f} | "
                   f"{rq_ready['min']:.2f}–{rq_ready['max']:.2f} |")
    rq = res.get("runqlat", {}).get("cpu_s") or {}
    if rq.get("median") is not None:
        out.append(f"| runqlat CPU time during the workloads (ms), for comparison | {rq['median'] * 1e3:.0f} | "
                   f"{rq['min'] * 1e3:.0f}–{rq['max'] * 1e3:.0f} |")

    mem = res["memory"]
    if mem.get("maps"):
        cpus = mem["cpus_here"]
        out += ["", "### BPF map memory (default sizes, as loaded)", "",
                f"| map | type | max_entries | key B | value B | formula, {cpus} CPUs (MiB) | "
                f"kernel memlock here (MiB) | formula, 64 CPUs (MiB) |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        for mp in mem["maps"]:
            out.append(f"| {mp['name']} | {mp['type']} | {mp['max_entries']} | {mp['key_size']} | "
                       f"{mp['value_size']} | {mp['bytes_here'] / MIB:.2f} | {mp['memlock'] / MIB:.2f} | "
                       f"{mp['bytes_64'] / MIB:.2f} |")
        out.append(f"| **total** | | | | | {mem['bytes_here'] / MIB:.2f} | {mem['memlock_here'] / MIB:.2f} | "
                   f"{mem['bytes_64'] / MIB:.2f} |")
    return "\n".join(out) + "\n"


def publish(root: Path, name: str, res: dict[str, Any], md: str, *, write_md: bool, begin: str, end: str,
            heading: str) -> Path:
    """The raw results to bench-results/NAME-<timestamp>.json, the Markdown to the
    terminal and, with write_md, between its markers in BENCHMARKS.md."""
    out_dir = root / "bench-results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"{name}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print("\n" + md + f"raw results: {path.relative_to(root)}")
    if write_md:
        update_markdown(root / "BENCHMARKS.md", md, begin=begin, end=end, heading=heading)
        print("BENCHMARKS.md updated")
    return path


def update_markdown(path: Path, section: str, begin: str = BEGIN, end: str = END,
                    heading: str = "Results") -> None:
    """Replace the generated section between the markers, or append it under heading."""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + f"\n\n## {heading}\n\n" + block + "\n"
    path.write_text(text if text.endswith("\n") else text + "\n")
