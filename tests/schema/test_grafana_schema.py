"""The dashboards as Grafana itself reads them.

Grafana drops keys its dashboard model does not know and fills in what is
missing, so a dashboard can pass every other test and still render differently.
Here each dashboard is validated against the JSON Schema of the `Dashboard`
TypeScript type of the @grafana/schema release that carries its schemaVersion
(validate-dashboards.mjs; scripts/setup-grafana-schema.sh installs the pinned
releases): unknown keys are errors wherever the model is closed, and the keys
Grafana's own defaults supply may be absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.support import require_kernel

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
MODULES = Path(os.environ.get("SLATRACE_GRAFANA_SCHEMA_DIR", REPO / ".cache" / "grafana-schema")) / "node_modules"
# schemaVersion -> the pinned @grafana/schema release (tests/schema/package.json).
RELEASES = {36: "11.0.7", 39: "11.5.3", 41: "12.1.1", 42: "13.2.3"}


def validate(paths: list[Path]) -> dict[str, dict]:
    """The validator's findings per file; skips (fails in CI) without node or the schemas."""
    if shutil.which("node") is None:
        require_kernel("node is not installed (SLATRACE_SETUP_TEST=1 scripts/setup.sh installs Debian's nodejs)")
    if not (MODULES / "ts-json-schema-generator").is_dir():
        require_kernel(f"Grafana's schemas are not installed in {MODULES.parent} (run scripts/setup-grafana-schema.sh)")
    r = subprocess.run(["node", str(HERE / "validate-dashboards.mjs"), str(MODULES), *map(str, paths)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"validate-dashboards.mjs failed: {r.stderr.strip()}"
    return json.loads(r.stdout)


def test_the_pins_are_the_releases_the_validator_maps() -> None:
    pins = json.loads((HERE / "package.json").read_text())["dependencies"]
    assert {v.rpartition("@")[2] for k, v in pins.items() if k.startswith("grafana-schema-")} == set(RELEASES.values())
    assert pins["ts-json-schema-generator"] == "2.4.0" and pins["typescript"] == "5.9.3"
    assert pins["ajv"].startswith("8.")
    mapped = (HERE / "validate-dashboards.mjs").read_text()
    for version, release in RELEASES.items():
        assert f'{version}: "{release}"' in mapped, f"validate-dashboards.mjs does not map {version} to {release}"


def test_every_dashboard_is_valid_under_grafanas_model() -> None:
    found = validate(DASHBOARDS)
    for path in DASHBOARDS:
        result = found[str(path)]
        version = json.loads(path.read_text())["schemaVersion"]
        assert result["release"] == RELEASES.get(version), \
            f"{path.name}: schemaVersion {version} has no pinned @grafana/schema release"
        assert result["definitions"] >= 30, f"{path.name}: the generated schema is too small to be the model"
        assert not result["errors"], f"{path.name} is not what Grafana {result['release']} reads: {result['errors']}"


# What a hand-edited dashboard gets wrong, and what Grafana would do with it.
BREAKAGES = {
    "/: must NOT have additional properties 'time_options'":
        lambda d: d.__setitem__("time_options", ["5m"]),            # dropped: it belongs to timepicker
    "/panels/0: must NOT have additional properties 'descripton'":
        lambda d: d["panels"][0].__setitem__("descripton", "x"),    # a row: RowPanel is closed
    "/panels/1: must NOT have additional properties 'legend'":
        lambda d: d["panels"][1].__setitem__("legend", {}),         # a panel: options.legend, not legend
    "/panels/1/fieldConfig/defaults: must NOT have additional properties 'units'":
        lambda d: d["panels"][1]["fieldConfig"]["defaults"].__setitem__("units", "s"),
    "/panels/2: must have required property 'type'":
        lambda d: d["panels"][2].pop("type"),                       # no default: Grafana cannot draw it
    "/templating/list/1/datasource: must NOT have additional properties 'name'":
        lambda d: d["templating"]["list"][1]["datasource"].__setitem__("name", "Prometheus"),
}


def test_each_pinned_release_rejects_what_grafana_would_drop(tmp_path: Path) -> None:
    """Each release's schema is closed where Grafana's model is, open where it
    is not (plugin options, query targets), and lets defaults be absent."""
    base = json.loads((REPO / "dashboards" / "slatrace-overview.json").read_text())
    assert base["panels"][0]["type"] == "row" and base["panels"][1]["type"] != "row"
    files = []
    for version in RELEASES:
        for variant in ("good", "bad"):
            doc = json.loads(json.dumps(base))
            doc["schemaVersion"] = version
            # What Grafana's defaults supply may be absent.
            for key in ("editable", "graphTooltip", "fiscalYearStartMonth", "liveNow"):
                doc.pop(key, None)
            doc["panels"][1]["gridPos"].pop("w")
            doc["panels"][1]["options"]["anyPluginOption"] = {"open": True}
            doc["panels"][1]["targets"][0]["anyQueryField"] = 1
            if variant == "bad":
                for breakage in BREAKAGES.values():
                    breakage(doc)
            files.append(tmp_path / f"{variant}-{version}.json")
            files[-1].write_text(json.dumps(doc))
    found = validate(files)
    for version, release in RELEASES.items():
        good, bad = found[str(tmp_path / f"good-{version}.json")], found[str(tmp_path / f"bad-{version}.json")]
        assert good["release"] == release and not good["errors"], (release, good["errors"])
        assert set(bad["errors"]) == set(BREAKAGES), (release, bad["errors"])
