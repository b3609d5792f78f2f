"""Config parsing: values land in the dataclasses, and every mistake is reported
as one sentence naming the file, the key path and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from agent.config import (
    DEFAULT_CONFIG_YAML,
    Config,
    ConfigError,
    EngineTarget,
    ServiceRule,
    Slo,
    load_config,
    parse_config,
)

SPEC_EXAMPLE = """\
interval: 1            # seconds
retention: 900         # seconds
max_services: 500      # beyond this, new services are counted under "other"
services:              # first match wins; a task matching none gets an automatic name
  - name: vllm
    cgroup: "/kubepods*/**/cri-containerd-abc*"   # glob on the cgroup v2 path
  - name: batch
    comm: "stress-ng*"                             # glob on the process name
  # also accepted: k8s_namespace, k8s_pod, k8s_container, systemd_unit, pid
slos:
  - service: vllm
    runq_p99: 0.005            # seconds
    request_e2e_p99: 2.0       # seconds, judged from the service's request spans
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def parse(text: str) -> Config:
    return parse_config(yaml.safe_load(text), "config.yaml")


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse(text)
    return str(exc.value)


def test_spec_example_parses_to_expected_values(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SPEC_EXAMPLE))
    assert cfg == Config(
        interval=1.0,
        retention=900.0,
        max_services=500,
        services=(
            ServiceRule(name="vllm", cgroup="/kubepods*/**/cri-containerd-abc*"),
            ServiceRule(name="batch", comm="stress-ng*"),
        ),
        slos=(Slo(service="vllm", runq_p99=0.005, request_e2e_p99=2.0),),
    )
    assert isinstance(cfg.interval, float) and isinstance(cfg.retention, float)


def test_defaults_yaml_and_no_file_give_config_defaults() -> None:
    assert parse_config(yaml.safe_load(DEFAULT_CONFIG_YAML), "defaults") == Config()
    assert load_config(None) == Config()
    assert Config() == Config(interval=1.0, retention=900.0, max_services=1000)
    # The embedded file documents every top-level key it defaults.
    for key in ("interval:", "retention:", "max_services:", "buckets_per_octave:", "histograms:", "services:",
                "slos:"):
        assert key in DEFAULT_CONFIG_YAML


def test_empty_file_and_empty_lists_are_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "# only a comment\n")) == Config()
    assert parse("services:\nslos: []\ninterval:\n") == Config()


def test_all_rule_matchers_and_slo_targets_are_kept() -> None:
    cfg = parse(
        """
interval: 0.5
retention: 30
max_services: 4
services:
  - name: web
    k8s_namespace: prod
    k8s_pod: "web-*"
    k8s_container: app
  - name: db
    systemd_unit: postgresql.service
  - name: one
    pid: 4242
    comm: "java"
slos:
  - service: web
    runq_p95: 0.002
    iowait_p99: 0.05
    request_ttft_p99: 1
"""
    )
    assert cfg.interval == 0.5 and cfg.retention == 30.0 and cfg.max_services == 4
    assert cfg.services == (
        ServiceRule(name="web", k8s_namespace="prod", k8s_pod="web-*", k8s_container="app"),
        ServiceRule(name="db", systemd_unit="postgresql.service"),
        ServiceRule(name="one", pid=4242, comm="java"),
    )
    assert cfg.slos == (
        Slo(service="web", runq_p95=0.002, iowait_p99=0.05, request_ttft_p99=1.0),
    )


def test_results_are_frozen() -> None:
    cfg = parse(SPEC_EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.interval = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.services[0].name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "intervall: 2",
            "config.yaml: unknown key 'intervall' "
            "(known keys: interval, retention, max_services, buckets_per_octave, attach_mode, event_rate, "
            "histograms, services, slos, request_spans, otlp_relays, web_config_file, engines)",
        ),
        (
            "services:\n  - name: a\n    comm: x\n  - name: b\n    cgroup: 3\n",
            "config.yaml: services[1].cgroup: expected a string "
            "(a glob on the cgroup v2 path), got 3",
        ),
        (
            "services:\n  - name: a\n    comm: 7\n",
            "config.yaml: services[0].comm: expected a string "
            "(a glob on the process name), got 7",
        ),
        (
            "services:\n  - name: a\n    cgroup: 'kubepods/*'\n",
            "config.yaml: services[0].cgroup: the glob must be an absolute cgroup v2 path; "
            "write '/kubepods/*' or '/**/kubepods/*' instead of 'kubepods/*'",
        ),
        (
            "services:\n  - name: a\n    cgroup: '/x[z-a]'\n",
            "config.yaml: services[0].cgroup: invalid glob '/x[z-a]': bad character range z-a; "
            "fix the [...] character class",
        ),
        (
            "services:\n  - name: lonely\n",
            "config.yaml: services[0]: service 'lonely' has no matcher; add one of cgroup, "
            "comm, k8s_namespace, k8s_pod, k8s_container, systemd_unit, pid",
        ),
        (
            "services:\n  - comm: x\n",
            "config.yaml: services[0].name: expected the service name as a non-empty string, "
            "got None",
        ),
        (
            "services:\n  - name: a\n    pid: '12'\n",
            "config.yaml: services[0].pid: expected a process id (a whole number >= 1), got '12'",
        ),
        (
            "services:\n  - name: a\n    pid: 0\n",
            "config.yaml: services[0].pid: expected a process id (a whole number >= 1), got 0",
        ),
        (
            "services:\n  - name: a\n    comm: x\n    cmdline: y\n",
            "config.yaml: services[0]: unknown key 'cmdline' (known keys: name, cgroup, comm, "
            "k8s_namespace, k8s_pod, k8s_container, systemd_unit, pid)",
        ),
        (
            "services:\n  name: a\n",
            "config.yaml: services: expected a list (each item starting with '- '), "
            "got {'name': 'a'}",
        ),
        (
            "services: [vllm]",
            "config.yaml: services[0]: expected a service rule as a mapping of keys, got 'vllm'",
        ),
        ("- 1\n- 2\n", "config.yaml: expected the top level as a mapping of keys, got [1, 2]"),
        ("interval: fast", "config.yaml: interval: expected a number of seconds, got 'fast'"),
        ("interval: true", "config.yaml: interval: expected a number of seconds, got True"),
        ("interval: .nan", "config.yaml: interval: expected a number of seconds, got nan"),
        (
            "interval: 0",
            "config.yaml: interval: must be a number of seconds from 0.1 to 60, got 0",
        ),
        (
            "interval: 61",
            "config.yaml: interval: must be a number of seconds from 0.1 to 60, got 61",
        ),
        (
            "interval: 10\nretention: 5",
            "config.yaml: retention: must be a number of seconds from the interval (10 s) to 604800, got 5",
        ),
        (
            "max_services: 0",
            "config.yaml: max_services: expected a whole number of at least 1, got 0",
        ),
        (
            "buckets_per_octave: 3",
            "config.yaml: buckets_per_octave: expected one of 1, 2, 4, 8, got 3",
        ),
        (
            "buckets_per_octave: four",
            "config.yaml: buckets_per_octave: expected one of 1, 2, 4, 8, got 'four'",
        ),
        (
            "max_services: 2.5",
            "config.yaml: max_services: expected a whole number of at least 1, got 2.5",
        ),
        (
            "max_services: 2\nservices: [{name: a, comm: a}, {name: b, comm: b}]",
            "config.yaml: max_services: must be more than the 2 service names the rules give "
            "(one name is kept for \"other\"), got 2",
        ),
        (
            "histograms: vllm",
            "config.yaml: histograms: expected a list (each item starting with '- '), got 'vllm'",
        ),
        (
            "histograms: [vllm, 3]",
            "config.yaml: histograms[1]: expected a service name or a glob on service names "
            "(e.g. \"vllm\" or \"/batch/*\"), got 3",
        ),
        (
            "slos:\n  - service: 3\n    runq_p99: 0.1\n",
            "config.yaml: slos[0].service: expected the service name as a non-empty string, "
            "got 3",
        ),
        (
            "slos:\n  - service: vllm\n    runq_p99: -0.1\n",
            "config.yaml: slos[0].runq_p99: expected a positive number of seconds, got -0.1",
        ),
        (
            "slos:\n  - service: vllm\n    runq_p99: 0\n",
            "config.yaml: slos[0].runq_p99: expected a positive number of seconds, got 0",
        ),
        (
            "slos:\n  - service: vllm\n    runq_p50: 0.1\n",
            "config.yaml: slos[0]: unknown key 'runq_p50' (known keys: service, runq_p99, "
            "runq_p95, iowait_p99, request_e2e_p99, request_ttft_p99)",
        ),
        (
            "slos:\n  - service: vllm\n",
            "config.yaml: slos[0]: the SLO of 'vllm' sets no target; add one of runq_p99, "
            "runq_p95, iowait_p99, request_e2e_p99, request_ttft_p99",
        ),
    ],
)
def test_errors_are_one_exact_sentence(text: str, message: str) -> None:
    got = error_of(text)
    assert got == message
    assert "\n" not in got


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 1\nservices:\n  - name: a\n    comm: [x\nslos: []\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: line 5: invalid YAML: ")
    assert "\n" not in msg


def test_tab_indentation_is_reported_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 1\nservices:\n\t- name: a\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value).startswith(f"{path}: line 3: invalid YAML: ")


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as exc:
        load_config(missing)
    assert str(exc.value) == f"{missing}: cannot read: No such file or directory"
    with pytest.raises(ConfigError) as exc:
        load_config(str(tmp_path))
    assert str(exc.value) == f"{tmp_path}: cannot read: Is a directory"


def test_errors_name_the_given_source() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"interval": "x"}, "/etc/slatrace/config.yaml")
    assert str(exc.value).startswith("/etc/slatrace/config.yaml: interval: ")


def test_engines_name_a_service_and_its_metrics_url() -> None:
    cfg = parse("engines:\n  - service: vllm\n    url: http://10.0.0.7:8000/metrics\n")
    assert cfg.engines == (EngineTarget("vllm", "http://10.0.0.7:8000/metrics"),)
    with pytest.raises(ConfigError) as exc:
        parse("engines:\n  - service: vllm\n    url: 10.0.0.7:8000\n")
    assert str(exc.value) == ("config.yaml: engines[0].url: expected the engine's metrics URL "
                              "(http://HOST:PORT/metrics), got '10.0.0.7:8000'")
    with pytest.raises(ConfigError) as exc:
        parse("engines:\n  - url: http://h/metrics\n")
    assert "engines[0].service: expected the service's name" in str(exc.value)


def test_the_event_streams_rate_limit_is_a_setting_with_bounds():
    from agent.config import DEFAULT_EVENT_RATE
    from agent.probe.loader import MapSizes, events_per_window

    assert parse_config({"event_rate": 200000}, "c.yaml").event_rate == 200000
    assert parse_config({}, "c.yaml").event_rate == DEFAULT_EVENT_RATE
    # The programs count in windows of 2^30 ns: the default per second is the loader's default per window.
    assert events_per_window(DEFAULT_EVENT_RATE) == MapSizes().event_rate
    for bad in (0, 999, 10_000_001, "fast", 1.5):
        with pytest.raises(ConfigError, match="event_rate: expected a whole number of events per CPU per second"):
            parse_config({"event_rate": bad}, "c.yaml")
