"""How the agent writes a duration for people: verdicts, request documents and
the CLI's tables all go through fmt_seconds, so one figure reads the same
everywhere."""

from __future__ import annotations

import math


def fmt_seconds(value: float | None) -> str:
    """'0.38 s' from a tenth of a second up, '25 ms', '3.1 ms', '0.40 ms', then
    '20 µs' below a tenth of a millisecond; '0' for zero, '-' for no figure."""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    if value >= 0.1:
        return f"{value:.2f} s"
    ms = value * 1e3
    if ms >= 10:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms".replace(".0 ms", " ms")
    if ms >= 0.1:
        return f"{ms:.2f} ms"
    return f"{value * 1e6:.0f} µs"
