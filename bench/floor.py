"""The floor: programs that do nothing, on the six tracepoints slatrace's probe
uses, attached the way the agent attaches them. What a tool costs above it is
its own work; bench/toggle.py toggles it within one run, bench/run.py's
rounds start it as one more arm:

    python -m bench.floor [--attach-mode auto|btf|raw|classic]

runs until SIGINT or SIGTERM, after printing "Tracing" once attached.
"""

from __future__ import annotations

import argparse
import signal
import sys

from agent.probe.btf import TRACEPOINTS


def source(mode: str = "raw") -> str:
    """The empty programs: BTF-typed tracepoints (load() attaches them), raw
    or classic ones (BCC attaches either kind when it loads them)."""
    if mode == "btf":
        return "".join(f"int tp_btf__{tp}(void *ctx) {{ return 0; }}\n" for tp in TRACEPOINTS)
    if mode == "raw":
        return "".join(f"RAW_TRACEPOINT_PROBE({tp}) {{ return 0; }}\n" for tp in TRACEPOINTS)
    if mode == "classic":
        return "".join(f"TRACEPOINT_PROBE(sched, {tp}) {{ return 0; }}\n" for tp in TRACEPOINTS)
    raise ValueError(f"the attach mode must be btf, raw or classic, got {mode!r}")


def load(mode: str):
    """(BCC module, the BTF-typed programs or None), attached."""
    from bcc import BPF

    from agent.probe import features
    from agent.probe.tracing import TracingPrograms

    bpf = BPF(text=source(mode))
    if mode != "btf":
        return bpf, None
    progs = TracingPrograms(bpf, {name: tid for name, tid in features.detect().task_layout.btf_trace_ids
                                  if name in TRACEPOINTS})
    progs.attach()
    return bpf, progs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--attach-mode", choices=("auto", "btf", "raw", "classic"), default="auto",
                   help="auto: the agent's choice on this kernel (default)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from agent.probe import features, loader

    mode = loader.attach_mode(features.detect(), args.attach_mode)
    wanted = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    bpf, progs = load(mode)
    print(f"Tracing {len(TRACEPOINTS)} {mode} tracepoints with empty programs", flush=True)
    signal.sigwait(wanted)
    if progs is not None:
        progs.close()
    bpf.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
