"""Every constant agent/probe/layout.py mirrors from bpf/sched.h equals the
header's #define, so the C and Python sides cannot drift apart."""

from __future__ import annotations

import re

from agent.probe import layout
from agent.probe.snapshot import CgroupCounters
from tests.support.bpf_header import header_defines, sched_h


def test_every_header_constant_is_mirrored_once_and_equal() -> None:
    d = header_defines()
    mirrored = {name: getattr(layout, name) for name in d if hasattr(layout, name)}
    assert mirrored == {name: d[name] for name in mirrored}
    # Every value class the programs use is mirrored.
    for prefix in ("HIST_", "TS_", "EV_", "BLAME_", "CAUSE_", "TF_"):
        missing = [n for n in d if n.startswith(prefix) and n not in mirrored]
        assert not missing, missing
    assert layout.KERNEL_CGID == d["KERNEL_CGID"] and layout.NR_ERRORS == d["NR_ERRORS"]
    # CAUSES names each CAUSE_* at its value.
    causes = sorted((v, n) for n, v in d.items() if n.startswith("CAUSE_"))
    assert [v for v, _ in causes] == list(range(d["NR_CAUSES"])) and len(layout.CAUSES) == d["NR_CAUSES"]
    assert [layout.CAUSES[v] for v, _ in causes] == [n.removeprefix("CAUSE_").lower() for _, n in causes]


def test_error_and_cgroup_field_orders_follow_the_header() -> None:
    d = header_defines()
    errors = sorted((v, n) for n, v in d.items() if n.startswith("ERR_"))
    assert len(errors) == len(layout.ERROR_MAPS) == d["NR_ERRORS"]
    assert [v for v, _ in errors] == list(range(d["NR_ERRORS"]))
    # cgroup_val's members, in declaration order, are CGROUP_FIELDS, and so
    # CgroupCounters' fields; the programs index it with CG_INDEX(), not a list.
    body = re.search(r"struct cgroup_val \{(.*?)\};", sched_h(), re.S).group(1)
    members = re.findall(r"__u64 (\w+);", body)
    assert tuple(members) == layout.CGROUP_FIELDS == tuple(CgroupCounters.__dataclass_fields__)
    assert not [n for n in d if n.startswith("CG_")], "a CG_* index restates cgroup_val's order"
    # cgroup_add_n() adds a (count, ns) pair to every field from lost_runq on.
    pairs = members[members.index("lost_runq"):]
    assert pairs[1::2] == [f + "_ns" for f in pairs[::2]]


def test_every_map_of_maps_names_its_inner_map_as_the_source_does() -> None:
    from agent.probe.loader import bpf_source_dir

    source = (bpf_source_dir() / "sched.bpf.c").read_text()
    declared = dict(re.findall(r'^BPF_(?:ARRAY|HASH)_OF_MAPS\((\w+),\s*"(\w+)"', source, re.M))
    assert declared and declared == layout.INNER_MAPS
