"""`slatrace top --once` and `slatrace services` against the real daemon and
real cgroups; the figures printed are checked against the agent's own API."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from agent.durations import fmt_seconds
from tests.e2e.scenes import contention
from tests.support import needs_kernel
from tests.support.agent import REPO, SLATRACE, Agent
from tests.support.workload import PREFIX, wait_zombie

pytestmark = pytest.mark.e2e

SECONDS = 3.0


def _remove_cgroup(directory: Path) -> None:
    """rmdir, retried while the exited sleeper is still being torn down (EBUSY)."""
    for _ in range(100):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    directory.rmdir()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(SLATRACE + list(argv), cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def scene():
    needs_kernel()
    with Agent(interval=0.5) as agent, contention(SECONDS, heavy_hogs=2) as c:
        # A cgroup laid out as systemd lays out a service unit: its name is the unit's.
        unit_parent = c.victim.mount / f"{PREFIX}sd-{c.victim.dir.name.split('-')[-2]}-{secrets.token_hex(3)}.slice"
        unit = f"demo-{secrets.token_hex(3)}.service"
        unit_dir = unit_parent / unit
        unit_dir.mkdir(parents=True)
        sleeper = None
        try:
            sleeper = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > {unit_dir}/cgroup.procs && '
                                        'exec python3 -c "import time\nfor _ in range(300): time.sleep(0.01)"'])
            wait_zombie(c.victim_pid, timeout=SECONDS + 10)
            sleeper.wait(timeout=30)
            services = _cli("services", "--json", "--agent", agent.url)  # the hogs still run
            services_table = _cli("services", "--agent", agent.url)
            # Stop the hogs so the window stops changing: the API and top must then agree exactly.
            for cg in (c.heavy, c.light):
                (cg.dir / "cgroup.kill").write_text("1")
            time.sleep(1.5)
            api = agent.get_json("/api/v1/attribution?since=120")
            top = _cli("top", "--once", "--since", "120", "--agent", agent.url)
            yield c, unit, api, top, services, services_table
        finally:
            if sleeper is not None and sleeper.poll() is None:
                sleeper.kill()
                sleeper.wait()
            _remove_cgroup(unit_dir)
            _remove_cgroup(unit_parent)


def test_top_once_shows_every_service_with_p99_and_culprit(scene) -> None:
    c, unit, api, top, _, _ = scene
    assert top.returncode == 0, top.stderr
    assert "\x1b" not in top.stdout, "control codes written to a pipe"
    rows = {line.split("│")[1].strip(): line for line in top.stdout.splitlines() if line.count("│") > 3}
    by_name = {r["service"]: r for r in api["attribution"]}
    for cg in (c.victim, c.heavy, c.light):
        rec = by_name[cg.path]
        line = rows[cg.path]
        assert fmt_seconds(rec["runq"]["p99"]) in line, (line, rec["runq"])
        culprit = rec["blame"]["culprits"][0]["service"] if rec["blame"]["culprits"] else "-"
        assert culprit.split("/")[-1][:20] in line, (line, rec["blame"]["culprits"])
    assert unit in rows


def test_top_sorts_by_p99_by_default(scene) -> None:
    c, _, api, top, _, _ = scene
    names = [line.split("│")[1].strip() for line in top.stdout.splitlines() if line.count("│") > 3]
    # Only this test's services are quiet now; the host's others keep moving between calls.
    ours = {c.victim.path, c.heavy.path, c.light.path}
    p99 = {r["service"]: r["runq"]["p99"] for r in api["attribution"] if r["service"] in ours}
    listed = [p99[n] for n in names if n in p99]
    assert len(listed) == 3 and listed == sorted(listed, reverse=True)


def test_services_lists_sources_and_tasks(scene) -> None:
    c, unit, _, _, services, table = scene
    assert services.returncode == 0, services.stderr
    listed = {s["name"]: s for s in json.loads(services.stdout)["services"]}
    heavy = listed[c.heavy.path]
    assert heavy["source"] == "cgroup" and heavy["cgroups"] == [c.heavy.path]
    assert heavy["processes"] == 2 and heavy["tasks"] == 2  # the two busy loops, still running
    assert {cmd["comm"] for cmd in heavy["commands"]} == {"python3"}
    assert listed[unit]["source"] == "systemd"
    assert listed[unit]["identity"] == [{"unit": unit}]
    assert listed["host"]["source"] == "host"
    assert table.returncode == 0 and unit in table.stdout and "systemd" in table.stdout


def test_bad_input_is_one_sentence() -> None:
    r = _cli("top", "--once", "--sort", "nope", "--agent", "http://127.0.0.1:9")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--sort" in r.stderr
    r = _cli("top", "--once", "--agent", "http://127.0.0.1:9")
    assert r.returncode == 2 and "is 'slatrace run' running" in r.stderr
