"""The agent's bpf(2) wrapper (agent/probe/bpfsys.py) and the build process's
answers (agent/probe/build.py), where no kernel is needed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from agent.probe.bpfsys import BpfMap, possible_cpus
from agent.probe.build import BuildKilledError, MapMemoryError, _no_answer


@pytest.mark.parametrize("text, n", [("0\n", 1), ("0-1\n", 2), ("0-63\n", 64), ("0,2-3\n", 4), ("0-3,8-11\n", 12)])
def test_possible_cpus_counts_up_to_the_highest(tmp_path: Path, text: str, n: int) -> None:
    (tmp_path / "possible").write_text(text)
    assert possible_cpus(tmp_path / "possible") == n


def test_per_cpu_values_are_rounded_to_eight_bytes_per_cpu() -> None:
    # BPF_MAP_TYPE_PERCPU_ARRAY (6): the kernel copies round_up(value_size, 8) per possible CPU
    assert BpfMap("errors", -1, 6, 4, 8, 6, ncpu=4).value_bytes == 32
    assert BpfMap("odd", -1, 6, 4, 12, 1, ncpu=4).value_bytes == 64
    assert BpfMap("hists", -1, 1, 16, 16, 8, ncpu=1).value_bytes == 16


def test_a_key_of_the_wrong_size_is_refused_before_the_kernel_sees_it() -> None:
    with pytest.raises(ValueError, match="key of 4 bytes, expected 8"):
        BpfMap("watched", -1, 1, 8, 1, 1024).lookup(b"\0" * 4)


def test_the_build_process_killed_names_the_memory_limit() -> None:
    assert isinstance(BuildKilledError(), MapMemoryError)
    assert "raise the container's memory limit" in str(BuildKilledError())
    assert _no_answer(-signal.SIGSEGV) == ("the BPF build process was killed by SIGSEGV before handing over "
                                           "the programs")
    assert _no_answer(1) == "the BPF build process exited with status 1 before handing over the programs"
