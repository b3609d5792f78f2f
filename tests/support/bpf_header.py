"""bpf/sched.h as the tests read it: the text and its integer #defines."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

import agent


def sched_h() -> str:
    in_tree = Path(agent.__file__).parent.parent / "bpf" / "sched.h"
    if in_tree.is_file():
        return in_tree.read_text()
    return files("agent.bpf").joinpath("sched.h").read_text()


def header_defines() -> dict[str, int]:
    """#define NAME <integer expression> lines, evaluated in order."""
    defines: dict[str, int] = {}
    for m in re.finditer(r"^#define\s+(\w+)\s+(.+?)\s*(?:/\*.*)?$", sched_h(), re.M):
        name, expr = m.groups()
        expr = re.sub(r"(?<=[0-9a-fA-F])U?L{1,2}\b", "", expr)  # C integer suffixes
        if re.fullmatch(r"[\w\s()+\-*<>]+", expr):
            defines[name] = eval(expr, {"__builtins__": {}}, dict(defines))  # noqa: S307
    return defines
