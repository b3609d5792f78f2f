"""`slatrace run` with start-up levers undone, so bench/footprint.py can measure
what each one buys in the same run.

    python -m bench.agent_variant VARIANT run [slatrace run flags...]

Each variant patches the agent in this process only, then hands over to the
normal command line; "shipped" changes nothing.
"""

from __future__ import annotations

import sys

VARIANTS = {
    "shipped": "as shipped: heap trimmed and library pages paged out after attach, a short first interval",
    "no-release": "nothing handed back after start-up",
    "trim-only": "malloc_trim(0) only, library pages left resident",
    "pageout-only": "library pages paged out, heap not trimmed",
    "full-first-interval": "ready only after one whole interval (1 s)",
    "before": "all of the above undone, and the OTLP receivers' modules (gRPC) imported even when off",
}


def apply(variant: str) -> None:
    from agent import daemon
    from agent.probe import footprint

    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; one of: {', '.join(VARIANTS)}")
    if variant in ("no-release", "before"):
        daemon.Daemon._release_compiler_memory = lambda self: None
    if variant == "trim-only":
        footprint.page_out = lambda ranges, libc=None: (0, None)
    if variant == "pageout-only":
        footprint.trim_heap = lambda libc=None: False
    if variant in ("full-first-interval", "before"):
        daemon.FIRST_INTERVAL_S = float("inf")  # min(.., interval): the whole interval
    if variant == "before":
        import agent.traces.receiver_grpc
        import agent.traces.receiver_http  # noqa: F401


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python -m bench.agent_variant VARIANT run [flags]")
    apply(argv[0])
    from agent.cli.main import main as slatrace

    return slatrace(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
