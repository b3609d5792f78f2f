"""Every import points down: the packages of agent/ form no cycle, and
neither do the modules inside a package.

Checked from what the code really imports (module-level imports, read with
ast), not from a rule file: each package's floor is derived as one above the
highest package it imports, which exists only while the graph has no cycle.
A function-level import (done to load a heavy dependency late) counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module one file imports, anywhere in it."""
    out: set[str] = set()
    for item in ast.walk(ast.parse(path.read_text())):
        if isinstance(item, ast.ImportFrom) and item.module and item.level == 0:
            out.add(item.module)
        elif isinstance(item, ast.Import):
            out.update(a.name for a in item.names)
    return out


def package_graph() -> dict[str, set[str]]:
    """agent.<package or top-level module> -> the others it imports."""
    graph: dict[str, set[str]] = {}
    for path in (REPO / "agent").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        node = ".".join(parts[:2])
        deps = graph.setdefault(node, set())
        for name in imported_modules(path):
            if name.startswith("agent."):
                target = ".".join(name.split(".")[:2])
                if target != node:
                    deps.add(target)
    return graph


def module_graph() -> dict[str, set[str]]:
    """agent.<package>.<module> -> the modules of agent/ it imports; a name
    taken from a package (`from agent.cli import main`) counts as that module."""
    paths: dict[str, Path] = {}
    for path in (REPO / "agent").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        deps = graph.setdefault(module, set())
        for item in ast.walk(ast.parse(path.read_text())):
            if isinstance(item, ast.ImportFrom) and item.module and item.level == 0:
                names = [item.module] + [f"{item.module}.{a.name}" for a in item.names]
            elif isinstance(item, ast.Import):
                names = [a.name for a in item.names]
            else:
                continue
            deps.update(n for n in names if n in paths and n != module)
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """0 for a package that imports none of the others, else one above the
    highest it imports; raises on a cycle, naming it."""
    out: dict[str, int] = {}
    visiting: list[str] = []

    def floor(node: str) -> int:
        if node in out:
            return out[node]
        if node in visiting:
            raise AssertionError("import cycle: " + " -> ".join(visiting[visiting.index(node):] + [node]))
        visiting.append(node)
        out[node] = 1 + max((floor(d) for d in graph.get(node, ())), default=-1)
        visiting.pop()
        return out[node]

    for node in sorted(graph):
        floor(node)
    return out


def test_the_packages_import_each_other_without_a_cycle():
    levels = floors(package_graph())
    # The data flows one way: kernel contract -> probe -> store -> attribution
    # -> exporters and API -> daemon -> CLI.
    assert levels["agent.probe"] < levels["agent.store"] < levels["agent.attribution"]
    assert levels["agent.attribution"] < levels["agent.export"] < levels["agent.daemon"] < levels["agent.cli"]
    assert levels["agent.identity"] < levels["agent.config"] < levels["agent.attribution"]
    assert levels["agent.attribution"] < levels["agent.traces"]
    # The transport (HTTP/TLS/auth) is a floor of its own under both apps that
    # serve HTTP; neither reaches into the other for it. Background work (one
    # worker shape) is a floor below everything that runs a thread.
    graph = package_graph()
    assert graph["agent.transport"] <= {"agent.errors", "agent.workers"}
    assert graph.get("agent.workers", set()) == set() and levels["agent.workers"] == 0
    assert levels["agent.transport"] < min(levels["agent.api"], levels["agent.traces"])
    assert "agent.api" not in graph["agent.traces"] and "agent.traces" not in graph["agent.api"]


def test_the_lower_floors_count_in_plain_numbers():
    """The transport and the trace side keep their counters as plain numbers;
    the export floor declares the families (agent/export/catalog.py) and builds
    them from those numbers. Neither reaches up for a metric family or the
    catalog (the trace forwarder shares only the OTLP endpoint settings)."""
    reaching_up = []
    for package in ("transport", "traces"):
        for path in sorted((REPO / "agent" / package).rglob("*.py")):
            for name in imported_modules(path):
                metric_api = name.startswith("prometheus_client") and name != "prometheus_client.parser"
                export = name.startswith("agent.export") and name != "agent.export.otlp_settings"
                if metric_api or export:
                    reaching_up.append(f"{path.relative_to(REPO)}: {name}")
    assert not reaching_up, reaching_up


def test_the_modules_import_each_other_without_a_cycle():
    """Inside a package as between packages: two files that import each other
    (even from inside a function, to dodge the circle at import time) fail;
    what both need belongs in a module below them."""
    levels = floors(module_graph())
    assert levels["agent.cli.errors"] < min(levels["agent.cli.main"], levels["agent.cli.requests"])


def test_a_cycle_is_named():
    try:
        floors({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    except AssertionError as e:
        assert "a -> b -> c -> a" in str(e)
    else:
        raise AssertionError("the cycle was not found")
