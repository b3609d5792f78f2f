"""The attacks of RELIABILITY.md against the real daemon, at full size.
Long (about two minutes): `make test-reliability` runs them."""

from __future__ import annotations

import pytest

from tests.reliability import measure
from tests.support.agent import REPO

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("kernel")]


def test_a_thousand_clients_at_once():
    fig = measure.crowd(REPO, 1000)
    assert fig["served"] >= 990, fig
    assert fig["alive"]
    assert fig["peak"]["threads"] <= 30, fig  # a fixed pool, not a thread per client


def test_a_thousand_slow_clients():
    fig = measure.slowloris(REPO, 1000, hold=5.0, close_within=15.0)
    assert fig["opened"] == 1000 and fig["probe_failed"] == 0, fig
    assert fig["probe_p50_s"] <= 0.1, fig
    # The head timeout is 10 s: every stalled connection is closed by then (+5 s slack).
    assert fig["closed_by_server"] == 1000, fig
    assert fig["peak"]["threads"] <= fig["before"]["threads"] + 1, fig
    assert fig["peak"]["rss_mib"] - fig["before"]["rss_mib"] < 50, fig


def test_resetting_clients_leave_no_log_noise():
    fig = measure.resets(REPO, 200)
    assert fig["tracebacks"] == 0 and fig["log_lines"] <= 200, fig


def test_huge_attributes_with_the_collector_blackholed():
    fig = measure.big_spans(REPO, 150, 1 << 20)
    assert fig["accepted"] == 150, fig
    assert fig["truncated"] == ["slatrace_otlp_truncated_attributes_total 150.0"], fig
    assert fig["peak_rss_growth_mib"] <= 50, fig


def test_non_finite_numbers_and_the_end_of_time():
    fig = measure.nan_spans(REPO)
    assert fig["status"] == 200 and fig["valid_json"], fig
    assert fig["explain_exit"] == 0 and not fig["explain_traceback"], fig


def test_sighup_without_a_config_file_is_survived():
    fig = measure.sighup(REPO)
    assert fig["alive"] and fig["readyz"] == 200, fig
