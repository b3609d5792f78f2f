"""A stand-in for vLLM: serves requests with real CPU work and reports each as
an `llm_request` span through the OpenTelemetry SDK's OTLP exporter.

Each request waits briefly in a queue, runs a prefill step, then decode steps
with a short sleep between them (the pause a GPU sync would cause), so its
threads both get preempted while computing and wait in the run queue after
each wakeup. The work is a fixed number of loop iterations, not a fixed time,
so a noisy neighbour stretches the request the way it stretches a real one.

The span carries vLLM V1's attribute names and a `process.pid` resource
attribute (what OTEL_RESOURCE_ATTRIBUTES or the process resource detector
gives a real server). One JSON line per request goes to stdout with what the
server itself measured, and a last line with its thread ids, for the test's
reference.

    python inference_server.py --endpoint http://127.0.0.1:4317 --protocol grpc --requests 5
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
    p.add_argument("--endpoint", required=True)
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prefill", type=int, default=1_500_000, help="loop iterations of the prefill step")
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--decode", type=int, default=400_000, help="loop iterations per decode step")
    p.add_argument("--queue-ms", type=float, default=5.0)
    p.add_argument("--step-sleep-ms", type=float, default=2.0)
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    p.add_argument("--warmup-s", type=float, default=1.0,
                   help="send one short request first, then wait this long before the measured ones")
    p.add_argument("--prefix", default="req")
    args = p.parse_args()

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind

    if args.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=args.endpoint, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=args.endpoint.rstrip("/") + "/v1/traces")
    provider = TracerProvider(resource=Resource.create({
        "service.name": "inference-stand-in", "process.pid": os.getpid()}))
    # vLLM exports through a BatchSpanProcessor too.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    tracer = provider.get_tracer("vllm.v1.engine.output_processor")

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
        s = 1e-9
        attrs = {
            "gen_ai.request.id": request_id,
            "gen_ai.latency.time_to_first_token": (first_token_ns - arrival_ns) * s,
            "gen_ai.latency.e2e": (last_token_ns - arrival_ns) * s,
            "gen_ai.latency.time_in_queue": (scheduled_ns - arrival_ns) * s,
            "gen_ai.latency.time_in_model_prefill": (first_token_ns - scheduled_ns) * s,
            "gen_ai.latency.time_in_model_decode": (last_token_ns - first_token_ns) * s,
            "gen_ai.latency.time_in_model_inference": (last_token_ns - scheduled_ns) * s,
            "gen_ai.usage.prompt_tokens": 512,
            "gen_ai.usage.completion_tokens": steps,
            "gen_ai.request.max_tokens": steps,
        }
        span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=arrival_ns, attributes=attrs)
        span.end(end_time=last_token_ns)
        return {"request_id": request_id, "start_ns": arrival_ns, "end_ns": last_token_ns,
                "e2e": attrs["gen_ai.latency.e2e"], "ttft": attrs["gen_ai.latency.time_to_first_token"]}

    if args.warmup_s > 0:
        # Makes the agent start watching this service before the measured requests.
        print(json.dumps({"warmup": serve(f"{args.prefix}-warmup", 10_000, 1, 10_000)}), flush=True)
        provider.force_flush()
        time.sleep(args.warmup_s)
    for i in range(args.requests):
        print(json.dumps(serve(f"{args.prefix}-{i}", args.prefill, args.decode_steps, args.decode)), flush=True)
    print(json.dumps({"tids": sorted(int(t) for t in os.listdir("/proc/self/task"))}), flush=True)
    ok = provider.force_flush(10_000)
    provider.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
