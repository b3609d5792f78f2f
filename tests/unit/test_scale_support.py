"""The scale workload's parts that need no root: the duty-cycle arithmetic,
the C worker itself (its CPU share against its own rusage), and the bench's
reading of /metrics and of map keys."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from bench import bpfstats, scale
from tests.support.scale import Duty, compile_worker, sleep_for_load
from tests.support.workload import read_schedstat, wait_zombie


def test_sleep_for_load_gives_the_asked_cpus() -> None:
    for n, load in ((10, 1.2), (100, 1.2), (1000, 1.2), (100, 0.8)):
        d = Duty.for_load(n, load, work_us=200.0)
        assert n * d.work_us / (d.work_us + d.sleep_us) == pytest.approx(load)
    assert sleep_for_load(1, 2.0, 200.0) == 0.0   # more CPUs asked than one worker can use
    with pytest.raises(ValueError):
        sleep_for_load(0, 1.0, 200.0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (make setup-test installs gcc)")
def test_worker_uses_its_duty_cycle_and_exits_on_time(tmp_path) -> None:
    """work 2 ms / sleep 6 ms for 1.5 s: a quarter of the time it is not
    kept waiting for a CPU, by the kernel's own accounting of the child
    (/proc schedstat: CPU time and run-queue wait), so a busy host does not
    change the answer."""
    exe = compile_worker(tmp_path)
    t0 = time.monotonic()
    p = subprocess.Popen([str(exe), "2000", "6000", "1.5"])
    wait_zombie(p.pid, timeout=30)
    wall = time.monotonic() - t0
    [stat] = read_schedstat(p.pid).values()
    assert p.wait() == 0
    assert wall >= 1.5
    share = stat.run_ns / 1e9 / (wall - stat.wait_ns / 1e9)
    assert share == pytest.approx(0.25, abs=0.07)


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
