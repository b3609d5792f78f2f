"""Opt-in: the stand-in's tracing set-up and the span fixtures against vLLM's
own tracing code, read from its release wheels.

vLLM's wheels are 250-500 MB, so this runs only when SLATRACE_VLLM_WHEELS names
a cache directory (CI does not set it): missing wheels are fetched there once
with `pip download vllm==X --no-deps`, and only `vllm/tracing*` is read from
them (nothing is installed or imported).

    SLATRACE_VLLM_WHEELS=~/.cache/slatrace-vllm .venv/bin/python -m pytest tests/unit/test_vllm_wheels.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agent.traces.spans import VllmAttr
from tests.support.vllm_tracing import V1_MODULE, init_tracer

CACHE = os.environ.get("SLATRACE_VLLM_WHEELS")
FIXTURES = Path(__file__).parent / "fixtures" / "otlp"
# The last release with vllm/tracing.py and a current one with the vllm/tracing/ package.
RELEASES = {"0.15": "0.15.1", "0.16": "0.34.0"}

pytestmark = pytest.mark.skipif(not CACHE, reason="opt-in: set SLATRACE_VLLM_WHEELS to a wheel cache directory")


def tracing_source(version: str) -> str:
    cache = Path(CACHE).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-d", str(cache)],
                       check=True, capture_output=True, timeout=1800)
        wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        return "\n".join(z.read(n).decode() for n in sorted(z.namelist()) if n.startswith("vllm/tracing"))


def fixture_keys() -> set[str]:
    keys = set()
    for path in FIXTURES.glob("vllm_*.json"):
        for rs in json.loads(path.read_text())["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    keys |= {a["key"] for a in span["attributes"]}
    return keys


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_attribute_names_are_the_releases(release):
    src = tracing_source(RELEASES[release])
    names = set(re.findall(r'"(gen_ai\.[a-z0-9_.]+)"', src))
    ours = {v for k, v in vars(VllmAttr).items() if k.isupper()}
    assert names, "no span attribute names found in the wheel"
    assert names <= ours, f"attributes the parser does not know: {names - ours}"
    assert "gen_ai.request.best_of" not in names
    # Every attribute in the fixtures is one some release sets.
    all_releases = set()
    for version in RELEASES.values():
        all_releases |= set(re.findall(r'"(gen_ai\.[a-z0-9_.]+)"', tracing_source(version)))
    assert fixture_keys() <= all_releases


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_stand_ins_tracer_is_built_as_the_release_builds_it(release, monkeypatch):
    src = tracing_source(RELEASES[release])
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    _, provider = init_tracer(V1_MODULE, "http://127.0.0.1:9", release)
    try:
        ours = set(provider.resource.attributes)
        exporter = provider._active_span_processor._span_processors[0].span_exporter
    finally:
        provider.shutdown()
    theirs = set(re.findall(r'resource_attrs\["([^"]+)"\]', src))
    if "TracerProvider()" in src:
        assert release == "0.15" and not theirs and not {k for k in ours if k.startswith("vllm.")}
    else:
        assert theirs == {k for k in ours if k.startswith("vllm.")} == {"vllm.instrumenting_module_name",
                                                                         "vllm.process_id"}
    # Up to 0.15 the gRPC exporter gets the endpoint alone (its scheme decides TLS); later, insecure=True.
    insecure_always = re.search(r"OTLPGrpcExporter\(endpoint=\w+, insecure=True\)", src) is not None
    assert insecure_always == (release != "0.15")
    assert ("OTLPSpanExporter(endpoint=endpoint)" in src) == (release == "0.15")
    assert type(exporter).__module__.endswith("grpc.trace_exporter")
