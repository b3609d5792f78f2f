"""How bench.engine_cost judges a tool beside a real engine: each round's slowdown
against the run with no tool of the same round, so the engine's drift between
rounds cancels."""

from __future__ import annotations

import pytest

from bench.engine_cost import parse_args, render, slowdowns, summarize


def row(tps: float, cpu: float = 0.0) -> dict[str, float]:
    return {"tokens_per_s": tps, "mean_latency_s": 3 / tps, "p99_latency_s": 4 / tps, "switches_per_s": 1e4,
            "tool_cpu_pct": cpu}


def test_each_round_is_judged_against_its_own_run_with_no_tool() -> None:
    # The engine drifts from 1000 to 1500 tokens/s; the tools cost 2% and 4% in every round.
    rounds = [{"none": row(t), "slatrace": row(t / 1.02, 0.6), "runqlat": row(t / 1.04)}
              for t in (1000, 1100, 1250, 1400, 1500)]
    assert slowdowns(rounds, "slatrace") == pytest.approx([0.02] * 5)
    s = summarize(rounds, ["none", "slatrace", "runqlat"])
    assert s["slatrace"]["slowdown"] == pytest.approx(0.02)
    assert s["slatrace"]["slowdown_interval"] == pytest.approx([0.02, 0.02])
    point, interval = s["slatrace"]["vs_runqlat"]
    assert point == pytest.approx(0.5) and interval == pytest.approx([0.5, 0.5])
    assert "vs_floor" not in s["slatrace"]
    table = render(s, {"date": "d", "nproc": 2, "kernel": "k", "commit": "c", "command": "x", "rounds": 5,
                       "clients": 3, "seconds": 20, "settle": 10, "max_tokens": 32, "elapsed_s": 1})
    assert "| slatrace | 1225.5 |" in table              # the median of the tool's own rows: 1250 / 1.02
    assert "+2.00% (+2.00% to +2.00%)" in table and "0.50x (0.50–0.50)" in table


def test_a_peer_within_the_noise_gives_no_ratio() -> None:
    rounds = [{"none": row(1000), "slatrace": row(990), "runqlat": row(r)} for r in (1001, 1002, 1000, 1003)]
    point, _ = summarize(rounds, ["none", "slatrace", "runqlat"])["slatrace"]["vs_runqlat"]
    assert point is None


def test_none_always_runs_first_and_unknown_tools_are_refused(capsys) -> None:
    assert parse_args(["--tools", "runqlat,slatrace"]).tools == ["none", "runqlat", "slatrace"]
    with pytest.raises(SystemExit):
        parse_args(["--tools", "perf"])
    assert "unknown tool 'perf'" in capsys.readouterr().err
