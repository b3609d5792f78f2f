"""The container tier: the project's image, built and run as deploy/daemonset.yaml says.

One private dockerd per session builds the Dockerfile (on a debootstrapped
debian:bookworm-slim when no registry image is at hand) and its containerd runs
the image with `ctr`, under the DaemonSet's capabilities, read-only root,
hostPID, mounts, seccomp profile and resources, all read from the YAML. The
layer cache and the base image stay in /var/cache/slatrace-test between runs;
everything else is removed at the end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from tests.support import containers as engine_mod
from tests.support import kernel_unavailable, require_kernel
from tests.support.agent import REPO
from tests.support.containers import Dockerd, PodSpec, Task

DAEMONSET = REPO / "deploy" / "daemonset.yaml"
CONFIGMAP = REPO / "deploy" / "configmap.yaml"
TAG = "slatrace:container-test"

pytestmark = pytest.mark.container


def _one(path: Path, kind: str) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    assert len(docs) == 1, f"{path} should hold one {kind}"
    return docs[0]


@pytest.fixture(scope="session")
def pod_spec() -> PodSpec:
    return PodSpec.from_daemonset(_one(DAEMONSET, "DaemonSet"))


@pytest.fixture(scope="session")
def config_data() -> dict[str, str]:
    return _one(CONFIGMAP, "ConfigMap")["data"]


@pytest.fixture(scope="session")
def timings() -> dict[str, float]:
    """Seconds each stage took, printed at the end of the session (pytest -s or -ra shows them)."""
    t: dict[str, float] = {}
    yield t
    print("\ncontainer tier timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()))


@pytest.fixture(scope="session")
def engine(timings: dict[str, float]) -> Iterator[Dockerd]:
    reason = kernel_unavailable() or engine_mod.missing_tools()
    if reason:
        require_kernel(reason)
    with engine_mod.cache_lock():
        engine_mod.remove_stale_runs()
        d = Dockerd()
        start = time.monotonic()
        try:
            d.start()
            timings["dockerd start"] = time.monotonic() - start
            yield d
        finally:
            try:
                if d.proc is not None and d.proc.poll() is None:
                    d.remove_namespace()
                    # Older builds' layers; the cache keeps the current image's.
                    d.docker("image", "prune", "-f", timeout=120)
            finally:
                d.stop()


@pytest.fixture(scope="session")
def image(engine: Dockerd, timings: dict[str, float]) -> str:
    """The image built from the checkout, imported into containerd; its ctr reference."""
    start = time.monotonic()
    base = engine_mod.ensure_base_image(engine)
    timings["base image"] = time.monotonic() - start
    timings["build"] = engine_mod.build_image(engine, base, REPO, TAG)
    start = time.monotonic()
    ref = engine_mod.import_image(engine, TAG)
    timings["import into containerd"] = time.monotonic() - start
    return ref


@pytest.fixture(scope="session")
def image_cfg(engine: Dockerd, image: str) -> dict:
    return engine_mod.image_config(engine, TAG)


RunPod = Callable[..., Task]


@pytest.fixture
def run_pod(engine: Dockerd, image: str, image_cfg: dict, pod_spec: PodSpec, config_data: dict[str, str],
            tmp_path: Path) -> Iterator[RunPod]:
    """Starts the image as the DaemonSet's container; removes every task it started."""
    tasks: list[Task] = []

    def run(**changes) -> Task:
        name = f"slatrace-{os.getpid()}-{secrets.token_hex(3)}"
        scratch = tmp_path / name
        scratch.mkdir()
        args = pod_spec.ctr_args(scratch, config_data, **changes)
        task = Task(engine, image, name, args, pod_spec.command(image_cfg), scratch / "output.log")
        tasks.append(task)
        return task

    yield run
    for task in tasks:
        task.remove()
    shutil.rmtree(tmp_path, ignore_errors=True)
