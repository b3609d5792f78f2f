"""A stand-in for vLLM: serves requests with real CPU work and reports each as
an `llm_request` span through the OpenTelemetry SDK's OTLP exporter.

Each request waits briefly in a queue, runs a prefill step, then decode steps
with a short sleep between them (the pause a GPU sync would cause), so its
threads both get preempted while computing and wait in the run queue after
each wakeup. The work is a fixed number of loop iterations, not a fixed time,
so a noisy neighbour stretches the request the way it stretches a real one.

Tracing is set up exactly as vLLM's `init_tracer` does it (tests/support/
vllm_tracing.py): the release's resource (no pid up to 0.15, `vllm.process_id`
from 0.16), the exporter built from `--otlp-traces-endpoint` as given with the
protocol from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, a BatchSpanProcessor with its
5 s default; and the span carries what the V1 output processor sets. One JSON
line per request goes to stdout with what the server itself measured, and a
last line with its thread ids, for the test's reference.

    python inference_server.py serve --otlp-traces-endpoint http://127.0.0.1:4317 --requests 5

Started as `.../vllm serve ...` its command line is a vLLM server's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def burn(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x += i * i
    return x


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", nargs="?", choices=["serve"])
    p.add_argument("--otlp-traces-endpoint", required=True)
    p.add_argument("--release", choices=["0.15", "0.16"], default="0.15")
    p.add_argument("--load-s", type=float, default=0.0, help="sleep this long first, as loading a model does")
    p.add_argument("--linger-s", type=float, default=0.0, help="stay up this long after the last spans are sent")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prefill", type=int, default=1_500_000, help="loop iterations of the prefill step")
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--decode", type=int, default=400_000, help="loop iterations per decode step")
    p.add_argument("--queue-ms", type=float, default=5.0)
    p.add_argument("--step-sleep-ms", type=float, default=2.0)
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    p.add_argument("--prefix", default="req")
    p.add_argument("--title", default="VLLM::EngineCore", help="the process's name (comm); empty: leave it")
    args = p.parse_args()

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    if args.title:
        # As vLLM V1's engine core titles its process (setproctitle sets the comm too).
        import ctypes
        ctypes.CDLL(None).prctl(15, args.title.encode()[:15], 0, 0, 0)  # PR_SET_NAME

    sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
    from opentelemetry.trace import SpanKind
    from vllm_tracing import V1_MODULE, init_tracer, v1_attributes

    tracer, provider = init_tracer(V1_MODULE, args.otlp_traces_endpoint, args.release)
    time.sleep(args.load_s)

    def serve(request_id: str, prefill: int, steps: int, decode: int) -> dict:
        arrival_ns = time.time_ns()
        time.sleep(args.queue_ms / 1e3)
        scheduled_ns = time.time_ns()
        burn(prefill)
        first_token_ns = time.time_ns()
        for _ in range(steps):
            time.sleep(args.step_sleep_ms / 1e3)
            burn(decode)
        last_token_ns = time.time_ns()
        attrs = v1_attributes(request_id, arrival_s=arrival_ns / 1e9, scheduled_s=scheduled_ns / 1e9,
                              first_token_s=first_token_ns / 1e9, last_token_s=last_token_ns / 1e9,
                              prompt_tokens=512, completion_tokens=steps, max_tokens=steps, temperature=0.0)
        span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=arrival_ns, attributes=attrs)
        span.end(end_time=last_token_ns)
        return {"request_id": request_id, "start_ns": arrival_ns, "end_ns": last_token_ns,
                "e2e": attrs["gen_ai.latency.e2e"], "ttft": attrs["gen_ai.latency.time_to_first_token"]}

    for i in range(args.requests):
        print(json.dumps(serve(f"{args.prefix}-{i}", args.prefill, args.decode_steps, args.decode)), flush=True)
    print(json.dumps({"tids": sorted(int(t) for t in os.listdir("/proc/self/task"))}), flush=True)
    ok = provider.force_flush(10_000)
    time.sleep(args.linger_s)  # a server outlives its spans' arrival
    provider.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
