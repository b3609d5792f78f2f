"""Clumsy flags and hostile config files: one bounded sentence, exit 2, no
traceback; SIGHUP reloads with one line either way."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config import Config, ConfigError, ServiceRule, Slo, load_config
from agent.daemon import UnknownSloWarnings
from agent.reload import ConfigReloader, describe_changes, load_with_overrides
from tests.support.agent import REPO, SLATRACE


def run_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([*SLATRACE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, says", [
    (["--retention", "nan"], "--retention must be a number of seconds"),
    (["--retention", "inf"], "--retention must be a number of seconds"),
    (["--retention", "-5"], "--retention must be a number of seconds"),
    (["--interval", "nan"], "--interval must be a number of seconds from 0.1 to 60"),
    (["--interval", "0.0001"], "--interval must be a number of seconds from 0.1 to 60"),
    (["--interval", "0"], "--interval must be a number of seconds from 0.1 to 60"),
    (["--interval=-inf"], "--interval must be a number of seconds from 0.1 to 60"),
    (["--interval", "5", "--retention", "2"], "--retention must be a number of seconds from the interval (5 s)"),
])
def test_bad_durations_are_one_sentence(flags, says):
    r = run_cli("run", "--listen", "127.0.0.1:0", *flags)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr


def test_an_interval_longer_than_the_files_retention_names_the_file(tmp_path: Path):
    config = tmp_path / "slatrace.yaml"
    config.write_text("retention: 30\n")
    r = run_cli("run", "--listen", "127.0.0.1:0", "--config", str(config), "--interval", "60")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"retention in {config} must be a number of seconds from the interval (60 s)" in r.stderr


BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.mark.parametrize("where", ["a top key", "services", "interval", "slos item"])
def test_an_alias_bomb_costs_one_short_sentence(tmp_path: Path, where: str):
    text = {"a top key": BOMB,
            "services": BOMB + "services: *i\n",
            "interval": BOMB + "interval: *i\n",
            "slos item": BOMB + "slos:\n  - *i\n"}[where]
    # Keep only the bomb's own keys valid where needed: the first error wins anyway.
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert len(str(e.value)) <= 400 and "\n" not in str(e.value), str(e.value)[:500]
    assert grown_kib < 50 * 1024


def test_the_cli_prints_the_bomb_in_one_short_line(tmp_path: Path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "interval: *i\n")
    r = run_cli("run", "--config", str(path))
    assert r.returncode == 2 and len(r.stderr) <= 400 and r.stderr.count("\n") == 1, r.stderr[:500]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "slatrace.yaml"
    path.write_text(text)
    return str(path)


GOOD = """\
services:
  - name: vllm
    comm: "vllm*"
  - name: batch
    comm: "stress-ng*"
slos:
  - service: vllm
    runq_p99: 0.005
"""


def test_reload_applies_services_and_slos_and_says_what_changed(tmp_path: Path, caplog):
    path = write(tmp_path, GOOD)
    applied: list[Config] = []
    current = [load_with_overrides(path, {"interval": 0.5})]

    def apply(c: Config) -> None:
        applied.append(c)
        current[0] = c

    reloader = ConfigReloader(path, {"interval": 0.5}, lambda: current[0], apply)
    write(tmp_path, GOOD.replace('name: batch', 'name: etl').replace("0.005", "0.004")
          + "  - service: etl\n    runq_p95: 0.01\nretention: 60\n")
    caplog.set_level(logging.INFO, logger="slatrace")
    assert reloader.reload()
    new = applied[-1]
    assert [r.name for r in new.services] == ["vllm", "etl"]
    assert new.slos == (Slo("vllm", runq_p99=0.004), Slo("etl", runq_p95=0.01))
    assert new.interval == 0.5            # the flag still wins
    assert new.retention == 900.0         # needs a restart: kept
    line, = [r.getMessage() for r in caplog.records]
    assert "services +etl -batch" in line and "slos +etl ~vllm" in line
    assert "retention" in line and "restart" in line


@pytest.mark.parametrize("bad", ["slos: [", "interval: 0\n", "services:\n  - name: x\n", BOMB + "slos: *i\n"])
def test_a_bad_file_on_reload_keeps_the_old_config_with_one_error_line(tmp_path: Path, caplog, bad: str):
    path = write(tmp_path, GOOD)
    old = load_config(path)
    applied: list[Config] = []
    reloader = ConfigReloader(path, {}, lambda: old, applied.append)
    write(tmp_path, bad)
    caplog.set_level(logging.INFO, logger="slatrace")
    assert not reloader.reload()
    assert applied == []
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and "keeping the running config" in record.getMessage()
    assert len(record.getMessage()) < 600 and "\n" not in record.getMessage()


def test_describe_changes_with_nothing_changed():
    c = Config(services=(ServiceRule("a", comm="a"),))
    assert describe_changes(c, c) == ("nothing", [])
    assert describe_changes(c, replace(c, max_services=7)) == ("nothing", ["max_services"])


def test_an_slo_for_an_unknown_service_is_warned_once(caplog):
    now = [0.0]
    warnings = UnknownSloWarnings(grace_s=60, clock=lambda: now[0])
    slos = (Slo("ghost", runq_p99=0.01), Slo("vllm", runq_p99=0.01))
    caplog.set_level(logging.WARNING, logger="slatrace")
    assert warnings.check(slos, {"vllm"}) == []       # too early to say
    now[0] = 61
    assert warnings.check(slos, {"vllm"}) == ["ghost"]
    assert warnings.check(slos, {"vllm"}) == []       # once
    assert len(caplog.records) == 1 and "'ghost'" in caplog.records[0].getMessage()


def test_an_slo_of_an_unseen_service_is_not_exported_as_holding():
    from agent.attribution.breaches import SloBreaches

    breaches = SloBreaches((Slo("ghost", runq_p99=0.01),), 60)
    breaches.observe(1.0, {})
    assert breaches.totals() == {}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_bpf_stats_sampler_holds_the_fd_per_mode_and_on_request():
    import os
    import time

    from agent.bpf_stats import BpfStatsSampler

    opened: list[int] = []

    def fake_enable() -> int:
        fd = os.open("/dev/null", os.O_RDONLY)
        opened.append(fd)
        return fd

    off = BpfStatsSampler("off", period_s=60, window_s=0.2, enable=fake_enable)
    off.start()
    time.sleep(0.1)
    assert not off.enabled and opened == []
    off.request()
    time.sleep(0.1)
    assert off.enabled and len(opened) == 1
    time.sleep(0.3)
    assert not off.enabled
    off.stop()

    sampled = BpfStatsSampler("sampled", period_s=0.3, window_s=0.1, enable=fake_enable)
    sampled.start()
    time.sleep(1.0)
    sampled.stop()
    assert 3 <= sampled.samples <= 4 and not sampled.enabled

    always = BpfStatsSampler("always", enable=fake_enable)
    always.start()
    assert always.enabled
    always.stop()
    assert not always.enabled
