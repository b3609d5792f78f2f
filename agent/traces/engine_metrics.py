"""vLLM's own latency histograms, to be shown beside the scheduler's figures.

The engine already measures what its users feel (time to first token, time
between tokens, time queued, prefill, decode, end to end) as Prometheus
histograms on its HTTP port. Their names change between releases (V0's
`time_per_output_token` became V1's `inter_token_latency`), so they are not
hard-coded: every histogram family the running engine exposes is matched by
what it measures, and kept under the engine's own name.

Pure: exposition text in, figures out; the caller fetches the text (from the
URL `engine_url` finds on the server's command line, or one configured).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ROLES", "EngineHistogram", "engine_url", "parse_histograms", "window_figures"]

# What a histogram measures -> words its name holds, in order of preference.
ROLES: dict[str, tuple[str, ...]] = {
    "ttft": ("time_to_first_token",),
    "inter_token": ("inter_token_latency", "time_per_output_token"),
    "queue": ("queue_time",),
    "prefill": ("prefill_time",),
    "decode": ("decode_time",),
    "e2e": ("e2e_request_latency",),
}
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class EngineHistogram:
    """One histogram family, its label sets (models, engines) added up."""

    name: str
    bounds: tuple[float, ...]      # upper bounds, +Inf last
    cumulative: tuple[float, ...]  # observations at or below each bound
    count: float
    sum: float

    def minus(self, earlier: EngineHistogram | None) -> EngineHistogram:
        """The observations made since `earlier` (a restarted engine starts from zero)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count:
            return self
        return EngineHistogram(self.name, self.bounds,
                               tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative)),
                               self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """As PromQL's histogram_quantile: linear inside the bucket holding the
        q-th observation; above the last finite bound, that bound."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative):
            if cum >= rank:
                if math.isinf(bound):
                    return lower
                inside = cum - below
                return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = bound, cum
        return lower


def parse_histograms(text: str) -> dict[str, EngineHistogram]:
    """role -> the engine's histogram for it, from a Prometheus exposition.
    Only families measured in seconds count; the first family matching a
    role's preferred word wins."""
    families = {f.name: f for f in text_string_to_metric_families(text) if f.type == "histogram"}
    out: dict[str, EngineHistogram] = {}
    for role, words in ROLES.items():
        for word in words:
            name = next((n for n in sorted(families) if word in n and n.endswith("_seconds")), None)
            if name is not None:
                out[role] = _summed(name, families[name].samples)
                break
    return out


def _summed(name: str, samples: Iterable) -> EngineHistogram:
    buckets: dict[float, float] = {}
    count = total = 0.0
    for s in samples:
        if s.name.endswith("_bucket"):
            bound = float(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
        elif s.name.endswith("_count"):
            count += s.value
        elif s.name.endswith("_sum"):
            total += s.value
    bounds = tuple(sorted(buckets))
    return EngineHistogram(name, bounds, tuple(buckets[b] for b in bounds), count, total)


def window_figures(now: dict[str, EngineHistogram], then: dict[str, EngineHistogram] | None,
                   quantiles: Sequence[float] = QUANTILES) -> dict[str, dict]:
    """Per role, the engine's figures for the observations made between two
    scrapes: its metric's name, the count, the mean and the quantiles. A role
    the engine does not expose is absent (said, not guessed)."""
    out = {}
    for role, h in now.items():
        d = h.minus((then or {}).get(role))
        out[role] = {"metric": h.name, "count": d.count,
                     "mean": d.sum / d.count if d.count > 0 else None,
                     **{f"p{round(q * 100)}": d.quantile(q) for q in quantiles}}
    return out


def engine_url(cmdline: Sequence[str]) -> str | None:
    """Where a `vllm serve` (or vLLM's OpenAI server module) serves /metrics,
    from its command line: --host and --port (vLLM's defaults: every address,
    port 8000); None for other commands."""
    args = list(cmdline)
    text = "\0".join(args)
    if not ("vllm\0serve" in text or any(a.startswith("vllm.entrypoints") for a in args)):
        return None
    host, port = "127.0.0.1", "8000"
    for i, a in enumerate(args):
        for flag in ("--host", "--port"):
            value = None
            if a == flag and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
            if value is not None:
                if flag == "--port":
                    port = value
                elif value not in ("", "0.0.0.0", "::"):
                    host = value
    if not port.isdigit():
        return None
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"
