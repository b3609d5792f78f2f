"""The scale workload's parts that need no root: the duty-cycle arithmetic,
the C worker itself (its CPU share against its own rusage), and the bench's
reading of /metrics and of map keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from bench import bpfstats, scale
from tests.support.scale import Duty, compile_worker, sleep_for_load


def test_sleep_for_load_gives_the_asked_cpus() -> None:
    for n, load in ((10, 1.2), (100, 1.2), (1000, 1.2), (100, 0.8)):
        d = Duty.for_load(n, load, work_us=200.0)
        assert n * d.work_us / (d.work_us + d.sleep_us) == pytest.approx(load)
    assert sleep_for_load(1, 2.0, 200.0) == 0.0   # more CPUs asked than one worker can use
    with pytest.raises(ValueError):
        sleep_for_load(0, 1.0, 200.0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (make setup-test installs gcc)")
def test_worker_uses_its_duty_cycle_and_exits_on_time(tmp_path) -> None:
    """work 2 ms / sleep 6 ms for 1.5 s: a quarter of a CPU, by the kernel's
    own rusage of the child (loose: the host is shared and sleeps overshoot)."""
    exe = compile_worker(tmp_path)
    t0 = time.monotonic()
    p = subprocess.Popen([str(exe), "2000", "6000", "1.5"])
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    cpu = usage.ru_utime + usage.ru_stime
    assert p.returncode == 0
    assert 1.5 <= wall < 3.0
    assert cpu / wall == pytest.approx(0.25, abs=0.1)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (make setup-test installs gcc)")
def test_worker_rejects_bad_arguments(tmp_path) -> None:
    exe = compile_worker(tmp_path)
    res = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=10)
    assert res.returncode == 2 and "usage:" in res.stderr
    res = subprocess.run([str(exe), "1", "1", "1", str(tmp_path / "no-such-cgroup")], capture_output=True,
                         text=True, timeout=10)
    assert res.returncode == 126 and "joining the cgroup" in res.stderr


def test_parse_exposition_counts_series_and_reads_map_errors() -> None:
    text = "\n".join([
        "# HELP slatrace_poll_duration_seconds x",
        "# TYPE slatrace_poll_duration_seconds gauge",
        "slatrace_poll_duration_seconds 0.125",
        "slatrace_services_tracked 12.0",
        'slatrace_bpf_map_errors_total{map="hists"} 7.0',
        'slatrace_bpf_map_errors_total{map="pairs"} 0.0',
        'slatrace_runq_wait_seconds_total{service="/a b"} 1.5',
        "",
    ])
    series, plain, errors = scale.parse_exposition(text)
    assert series == 5
    assert plain == {"slatrace_poll_duration_seconds": 0.125, "slatrace_services_tracked": 12.0}
    assert errors == {"hists": 7.0, "pairs": 0.0}


def test_keys_naming_finds_ids_in_any_aligned_word() -> None:
    def key(*words: int) -> bytes:
        return b"".join(w.to_bytes(8, "little") for w in words)

    keys = [key(5, 1), key(7, 5), key(9, 9), (5).to_bytes(4, "little")]  # the last: too short to hold an id
    assert bpfstats.keys_naming(keys, {5}) == 2
    assert bpfstats.keys_naming(keys, {9, 5}) == 3
    assert bpfstats.keys_naming(keys, set()) == 0
