"""vLLM span parsing, OTLP decoding, span -> service, verdicts and request SLOs.

The fixtures under fixtures/otlp are OTLP/JSON export requests as the
OpenTelemetry SDK's OTLP encoder produced them for an `llm_request` SERVER span
carrying the attribute sets of vLLM's V1 output processor and V0 engine
(vllm/tracing.py SpanAttributes), with a caller's traceparent as parent.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.attribution.request_sched import RequestSched
from agent.attribution.requests import causes, judge, request_document, verdict
from agent.durations import fmt_seconds
from agent.config import Slo
from agent.traces.otlp_decode import DecodeError, Limits, decode_body, decode_json, decode_protobuf, gunzip
from agent.traces.request_store import RequestStore
from agent.traces.spans import RequestSpan, attributes, iter_spans, request_span

FIXTURES = Path(__file__).parent / "fixtures" / "otlp"


def load(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def only_span(body: bytes) -> tuple[dict, RequestSpan]:
    req = decode_json(body)
    [(rs, _, span)] = list(iter_spans(req))
    return attributes(rs.resource.attributes), request_span(span)


# --- span model -------------------------------------------------------------

def test_v1_fixture_parses_every_figure():
    resource, s = only_span(load("vllm_llm_request_v1.json"))
    assert s.request_id == "cmpl-8c5d1c2e4b7a4f0e9d3b6a1f2e7c9d40"
    assert s.trace_id == "5b8efff798038103d269b633813fc60c"
    assert s.span_id == "1249ea9bf35be388"
    assert s.parent_span_id == "eee19b7ec3c1b174"
    assert s.start == pytest.approx(1764680000.104551)
    assert s.end == pytest.approx(1764680001.907502289)
    assert s.e2e == pytest.approx(1.802741289138794)
    assert s.ttft == pytest.approx(0.4123671054840088)
    assert s.queue == pytest.approx(0.051203012466430664)
    assert s.prefill == pytest.approx(0.35744190216064453)
    assert s.decode == pytest.approx(1.3874588012695312)
    assert s.inference == pytest.approx(1.7449007034301758)
    assert (s.prompt_tokens, s.completion_tokens, s.max_tokens, s.n) == (812, 256, 256, 1)
    # The span's own duration and vLLM's e2e agree to within the time it took to end it.
    assert s.end - s.start == pytest.approx(s.e2e, abs=1e-3)
    # Up to 0.15 vLLM's resource is the SDK's default: nothing names the process.
    assert resource["service.name"] == "unknown_service:python"
    assert not {"process.pid", "host.name", "vllm.process_id"} & set(resource)


def test_v1_fixture_of_0_16_carries_vllms_own_resource_and_omits_falsy_parameters():
    resource, s = only_span(load("vllm_llm_request_v1_0.16.json"))
    # The pid as a string, in vLLM's own pid namespace (here the container's init).
    assert resource["vllm.process_id"] == "1" and resource["vllm.instrumenting_module_name"] == "vllm.llm_engine"
    assert "process.pid" not in resource
    attrs = attributes(decode_json(load("vllm_llm_request_v1_0.16.json")).resource_spans[0]
                       .scope_spans[0].spans[0].attributes)
    # temperature 0 is falsy, so V1 leaves it out; no model name, no finish reasons.
    assert "gen_ai.request.temperature" not in attrs and "gen_ai.response.model" not in attrs
    assert s.model is None and s.finish_reasons == () and s.parent_span_id is None
    assert s.request_id == "chatcmpl-0f3b9a7e5c2d4b1a8e6f0c9d7b5a3e21"
    assert (s.prompt_tokens, s.completion_tokens, s.max_tokens, s.n) == (37, 64, 64, 1)
    assert s.queue + s.prefill + s.decode == pytest.approx(s.e2e, abs=1e-3)


def test_n_greater_than_one_keeps_every_sibling():
    req = decode_json(load("vllm_llm_request_v1_n2.json"))
    spans = [request_span(span) for _, _, span in iter_spans(req)]
    assert {s.request_id for s in spans} == {"cmpl-5e1f0c7a9b3d4e2f8a6c1b0d9e7f3a52"} and len(spans) == 2
    store = RequestStore(900, clock=lambda: 1764680010.0)
    for s in spans + spans[:1]:   # the first one twice: a retried export replaces, it does not add
        store.add(request_document(s, "vllm", "connection", None, [], True))
    docs = store.get_all("cmpl-5e1f0c7a9b3d4e2f8a6c1b0d9e7f3a52")
    assert sorted(d["span_id"] for d in docs) == ["3c4d5e6f708192a3", "4d5e6f708192a3b4"]
    assert sorted(d["tokens"]["completion"] for d in docs) == [180, 256]
    assert len(store) == 2 and len(store.query()) == 2
    from agent.traces.api import request_routes
    one = json.loads(request_routes(store)["/api/v1/requests/"]({"_tail": [spans[0].request_id]}).body)
    assert len(one["siblings"]) == 1 and {one["span_id"], one["siblings"][0]["span_id"]} == \
        {"3c4d5e6f708192a3", "4d5e6f708192a3b4"}
    # Eviction by count drops the oldest span and its index entry.
    small = RequestStore(900, max_requests=1, clock=lambda: 1764680010.0)
    for s in spans:
        small.add(request_document(s, "vllm", "connection", None, [], True))
    assert [d["span_id"] for d in small.get_all(spans[0].request_id)] == [spans[1].span_id]


def test_v0_fixture_parses_its_own_attribute_set():
    _, s = only_span(load("vllm_llm_request_v0.json"))
    assert s.request_id == "42"
    assert s.model == "facebook/opt-125m"
    assert s.scheduler == pytest.approx(0.016315937042236328)
    assert s.model_forward == pytest.approx(0.8841199951171875)
    assert s.model_execute == pytest.approx(1.0105345249176025)
    assert s.prefill is None and s.decode is None  # V0 has no phase split
    assert s.ttft == pytest.approx(0.0520627498626709)
    assert set(s.phases()) == {"queue", "scheduler", "model_forward", "model_execute"}


def test_missing_attributes_fall_back_instead_of_failing():
    doc = json.loads(load("vllm_llm_request_v1.json"))
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["attributes"] = [{"key": "gen_ai.latency.time_to_first_token", "value": {"stringValue": "0.25"}},
                          {"key": "gen_ai.usage.prompt_tokens", "value": {"boolValue": True}}]
    del span["parentSpanId"]
    _, s = only_span(json.dumps(doc).encode())
    assert s.request_id == s.span_id == "1249ea9bf35be388"
    assert s.e2e == pytest.approx(s.end - s.start)
    assert s.ttft == 0.25            # a number sent as a string still counts
    assert s.prompt_tokens is None   # a bool is no count
    assert s.parent_span_id is None and s.queue is None


# --- decoding -----------------------------------------------------------------

def test_json_and_protobuf_decode_to_the_same_request():
    from_json = decode_json(load("vllm_llm_request_v1.json"))
    from_proto = decode_protobuf(from_json.SerializeToString())
    assert from_proto == from_json
    req, is_json = decode_body(gzip.compress(from_json.SerializeToString()), "application/x-protobuf", "gzip")
    assert req == from_json and not is_json


def test_json_accepts_snake_case_and_integer_enums():
    doc = {"resource_spans": [{"scope_spans": [{"spans": [{
        "trace_id": "5b8efff798038103d269b633813fc60c", "span_id": "1249ea9bf35be388",
        "name": "llm_request", "kind": 2, "start_time_unix_nano": 1_000_000_000, "end_time_unix_nano": "3000000000"}]}]}]}
    [(_, _, span)] = list(iter_spans(decode_json(json.dumps(doc).encode())))
    assert span.kind == 2 and span.end_time_unix_nano == 3_000_000_000
    assert span.trace_id.hex() == "5b8efff798038103d269b633813fc60c"


@pytest.mark.parametrize("body, status, words", [
    (b"\xff\xfe not json", 400, "UTF-8"),
    (b"{\"resourceSpans\": ", 400, "not JSON"),
    (b"[1, 2]", 400, "object"),
    (b'{"resourceSpans": 5}', 400, "resourceSpans"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "xyz"}]}]}]}', 400, "not hex"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}', 400, "startTimeUnixNano"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 7}]}]}]}', 400, "name"),
    (b"[" * 100_000, 400, "JSON"),
])
def test_bad_json_is_refused_with_a_reason(body, status, words):
    with pytest.raises(DecodeError) as e:
        decode_json(body)
    assert e.value.status == status and words in e.value.reason


def test_truncated_protobuf_is_refused():
    good = decode_json(load("vllm_llm_request_v1.json")).SerializeToString()
    with pytest.raises(DecodeError) as e:
        decode_protobuf(good[: len(good) // 2])
    assert e.value.status == 400 and "protobuf" in e.value.reason


def test_limits_on_size_spans_and_inflation():
    body = load("vllm_llm_request_v1.json")
    with pytest.raises(DecodeError) as e:
        decode_body(body, "application/json", None, Limits(max_body_bytes=100))
    assert e.value.status == 413
    doc = json.loads(body)
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.extend(copy.deepcopy(spans[0]) for _ in range(4))
    with pytest.raises(DecodeError) as e:
        decode_body(json.dumps(doc).encode(), "application/json", None, Limits(max_spans=4))
    assert e.value.status == 413 and "5 spans" in e.value.reason
    bomb = gzip.compress(b"\0" * (64 << 20))   # 64 MiB of zeros in ~64 KiB
    assert len(bomb) < 100_000
    with pytest.raises(DecodeError) as e:
        gunzip(bomb, 1 << 20)
    assert e.value.status == 413
    with pytest.raises(DecodeError) as e:
        gunzip(gzip.compress(b"x" * 1000)[:-12], 1 << 20)
    assert e.value.status == 400 and "truncated" in e.value.reason
    with pytest.raises(DecodeError) as e:
        decode_body(body, "text/plain", None)
    assert e.value.status == 415
    with pytest.raises(DecodeError) as e:
        decode_body(body, "application/json", "br")
    assert e.value.status == 415


# Any JSON value in any position of an OTLP-shaped document: the parser must
# either decode it or refuse it with a DecodeError, never raise anything else.
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                      st.text(max_size=12), st.sampled_from(["5b8efff798038103d269b633813fc60c", "1249ea9bf35be388",
                                                             "SPAN_KIND_SERVER", "llm_request", "1764680000"]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["key", "value", "stringValue", "intValue", "doubleValue", "arrayValue",
                                     "values", "kvlistValue", "boolValue", "x"]), inner, max_size=3)), max_leaves=12)
span_doc = st.fixed_dictionaries({}, optional={
    "traceId": json_value, "spanId": json_value, "parentSpanId": json_value, "name": json_value,
    "kind": json_value, "startTimeUnixNano": json_value, "endTimeUnixNano": json_value,
    "attributes": st.lists(st.fixed_dictionaries({"key": json_value, "value": json_value}), max_size=3),
    "events": json_value, "links": json_value, "status": json_value})
export_doc = st.fixed_dictionaries({"resourceSpans": st.lists(st.fixed_dictionaries({
    "resource": st.one_of(json_value, st.fixed_dictionaries({"attributes": st.lists(
        st.fixed_dictionaries({"key": json_value, "value": json_value}), max_size=2)})),
    "scopeSpans": st.lists(st.fixed_dictionaries({"scope": json_value, "spans": st.lists(span_doc, max_size=3)}),
                           max_size=2)}), max_size=2)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(export_doc, json_value))
def test_property_json_bodies_decode_or_refuse_cleanly(doc):
    body = json.dumps(doc).encode()
    try:
        req = decode_json(body)
    except DecodeError as e:
        assert e.status == 400 and e.reason
        return
    # What decodes also parses as request spans, whatever its attributes hold.
    for _, _, span in iter_spans(req):
        s = request_span(span)
        assert s.end >= s.start and not math.isnan(s.e2e)


# --- verdicts and SLOs ------------------------------------------------------------

def span(e2e: float = 1.8, ttft: float | None = 0.4, duration: float | None = None) -> RequestSpan:
    return RequestSpan("cmpl-42", "ab" * 16, "cd" * 8, None, 100.0, 100.0 + (e2e if duration is None else duration),
                       e2e, ttft=ttft, queue=0.05, prefill=0.3, decode=1.4)


def sched(delay: float, by: tuple[tuple[str, float], ...] = (), iowait: float = 0.0,
          thread_seconds: float | None = None) -> RequestSched:
    """Figures whose delay is `delay`, split as `by` (the rest without a
    recorded culprit), over `thread_seconds` of waits (4x the delay by default)."""
    rest = delay - sum(w for _, w in by)
    split = by + ((("unknown", rest),) if rest > 1e-12 else ())
    runq = 4 * delay if thread_seconds is None else thread_seconds
    return RequestSched(runq, 37, tuple((s, 4 * w) for s, w in by), iowait, 3, 1e-6,
                        delay_seconds=delay, delay_by=split)


def test_verdict_names_the_largest_culprit_with_its_share():
    s = sched(0.42, (("batch/etl", 0.38), ("host", 0.02)))
    # The delay (0.38 s of 0.42), not the thread-seconds (4x as much), in the sentence.
    assert verdict(span(), s, "vllm") == ("CPU contention from batch/etl added 0.38 s (21% of 1.80 s end to end); "
                                          "give vllm more CPU weight (requests) than batch/etl, or keep them apart")
    assert [c.kind for c in causes(s, "vllm")] == ["neighbour", "neighbour", "unknown"]
    assert causes(s)[2].seconds == pytest.approx(0.02)


def test_the_delay_by_culprit_names_idle_and_self():
    # 0.35 s held up by batch (preempting or holding the CPU the work woke up
    # to), 0.05 s of wake-up latency on an idle CPU is nobody's, 0.02 s behind
    # the service's own threads.
    s = RequestSched(1.9, 5, (("batch", 0.4),), 0.0, 1, 1e-6, waited_behind=(("batch", 1.0), ("idle", 0.2)),
                     delay_seconds=0.42, delay_by=(("batch", 0.35), ("idle", 0.05), ("vllm", 0.02)))
    assert [(c.kind, c.culprit, round(c.seconds, 3)) for c in causes(s, "vllm")] == [
        ("neighbour", "batch", 0.35), ("idle", None, 0.05), ("own_threads", "vllm", 0.02)]
    assert verdict(span(), s, "vllm").startswith("CPU contention from batch added 0.35 s (19% of 1.80 s end to end)")
    only_self = RequestSched(0.9, 0, (), 0.0, 0, 1e-6, waited_behind=(("vllm", 0.9),),
                             delay_seconds=0.3, delay_by=(("vllm", 0.3),))
    assert verdict(span(), only_self, "vllm").startswith("run-queue wait behind its own threads")


def test_the_services_own_cpu_limit_is_a_cause_named_with_its_setting():
    # 0.19 s of the delay was the limit's part of the waits (the kernel's
    # EV_LIMIT pieces), 0.02 s woke to an idle CPU once the limit lifted.
    s = RequestSched(0.5, 0, (), 0.0, 0, 1e-6, delay_seconds=0.21, delay_by=(("cpu_limit", 0.19), ("idle", 0.02)),
                     service="vllm", limit_seconds=0.45)
    limit = {"cgroup": "/kubepods/burstable/pod1234", "setting": "cpu.max 50000 100000", "quota_seconds": 0.05,
             "period_seconds": 0.1, "cpus": 0.5, "level": "pod"}
    assert [(c.kind, c.culprit) for c in causes(s)] == [("cpu_limit", None), ("idle", None)]
    assert verdict(span(), s, "vllm", [limit]) == (
        "its own CPU limit (cpu.max 50000 100000, 0.5 CPU, on the pod's cgroup) added 0.19 s "
        "(11% of 1.80 s end to end); raise or remove the limit, or give the service less work per CPU")
    doc = request_document(span(), "vllm", "connection", s, [], True, [limit])
    assert doc["sched"]["delay_by"] == [{"service": "vllm", "cause": "cpu_limit", "seconds": 0.19},
                                        {"service": "idle", "cause": "idle", "seconds": 0.02}]
    assert doc["sched"]["delay_by_cause"] == {"cpu_limit": 0.19, "idle": 0.02}
    assert doc["sched"]["limits"] == [limit] and doc["culprits"] == []
    # Where the limit is not known, it is still named as the cause.
    assert verdict(span(), s, "vllm").startswith("its own CPU limit added 0.19 s")
    # Second to a neighbour, but significant: named after it.
    both = RequestSched(1.0, 0, (), 0.0, 0, 1e-6, delay_seconds=0.5,
                        delay_by=(("batch", 0.4), ("cpu_limit", 0.08), ("idle", 0.02)), service="vllm")
    assert verdict(span(), both, "vllm", [limit]).endswith(
        "; its own CPU limit (cpu.max 50000 100000, 0.5 CPU, on the pod's cgroup) also held it 80 ms, and "
        "between throttles it waits longer behind batch: removing the limit can take away more than that")
    # Second to its own threads: the limit's share is all there is to say.
    own = RequestSched(1.0, 0, (), 0.0, 0, 1e-6, delay_seconds=0.5,
                       delay_by=(("vllm", 0.4), ("cpu_limit", 0.08), ("idle", 0.02)), service="vllm")
    assert verdict(span(), own, "vllm", [limit]).endswith("on the pod's cgroup) also held it 80 ms")


def test_shares_are_of_the_requests_window_and_never_above_all_of_it():
    # vLLM's own e2e attribute (0.806 s) can be shorter than the span's window
    # (0.818 s) the delay is measured over: the share is of the window.
    s = RequestSched(2.0, 0, (), 0.0, 0, 1e-6, delay_seconds=0.812, delay_by=(("batch", 0.812),), service="vllm")
    assert "(99% of 0.82 s end to end)" in verdict(span(e2e=0.806, duration=0.818), s, "vllm")


def test_verdict_other_causes_and_noise():
    # 40 ms of thread-seconds, 2 ms of delay: no significant delay.
    assert verdict(span(), sched(0.002, thread_seconds=0.04), "vllm") == \
        "no significant scheduling delay (waited for a CPU 2 ms)"
    assert verdict(span(), sched(0.01, iowait=0.5), "vllm") == \
        "I/O wait (D state) added 0.50 s (28% of 1.80 s end to end)"
    assert verdict(span(), sched(0.3), "vllm").startswith("run-queue wait without a recorded culprit")
    assert "no scheduling figures" in verdict(span(), None, None)
    assert fmt_seconds(0.0004) == "0.40 ms" and fmt_seconds(0.025) == "25 ms" and fmt_seconds(0.0031) == "3.1 ms"


def test_request_slos_judge_e2e_and_ttft():
    slos = (Slo("vllm", request_e2e_p99=2.0, request_ttft_p99=0.3), Slo("other", request_e2e_p99=0.1))
    result = judge(span(e2e=1.8, ttft=0.4), slos, "vllm")
    assert result == [{"name": "request_e2e_p99", "target": 2.0, "value": 1.8, "ok": True},
                      {"name": "request_ttft_p99", "target": 0.3, "value": 0.4, "ok": False}]
    assert [r["name"] for r in judge(span(ttft=None), slos, "vllm")] == ["request_e2e_p99"]
    assert judge(span(), slos, "batch") == []


def test_request_document_has_the_spec_shape():
    doc = request_document(span(), "vllm", "process.pid", sched(0.21, (("batch", 0.19),), thread_seconds=0.84),
                           [], True)
    assert {"request_id", "trace_id", "service", "start", "end", "e2e", "ttft", "queue", "sched", "slo",
            "verdict"} <= set(doc)
    assert doc["sched"] == {"delay_seconds": 0.21,
                            "delay_by": [{"service": "batch", "cause": "neighbour", "seconds": 0.19},
                                         {"service": "unknown", "cause": "unknown", "seconds": pytest.approx(0.02)}],
                            "delay_by_cause": {"neighbour": 0.19, "unknown": pytest.approx(0.02)},
                            "limit_thread_seconds": 0.0, "dropped_events": 0, "limits": [],
                            "runq_thread_seconds": 0.84, "runq_wait_seconds": 0.84, "preemptions": 37,
                            "preempted_by": [{"service": "batch", "wait_seconds": 0.76}],
                            "waited_behind": [], "iowait_seconds": 0.0, "migrations": 3, "by_thread": [],
                            "phases": []}
    assert doc["culprits"] == [{"service": "batch", "wait_seconds": 0.19}]
    json.dumps(doc)


def test_request_store_bounds_and_queries():
    now = [1000.0]
    store = RequestStore(retention_s=60, max_requests=3, clock=lambda: now[0])
    for i in range(5):
        store.add({"request_id": f"r{i}", "service": "a" if i % 2 else "b", "end": 990.0 + i,
                   "slo": [{"name": "request_e2e_p99", "ok": i != 3}]})
    assert [d["request_id"] for d in store.query()] == ["r2", "r3", "r4"] and store.evicted == 2
    assert [d["request_id"] for d in store.query(service="a")] == ["r3"]
    assert [d["request_id"] for d in store.query(breached=True)] == ["r3"]
    assert [d["request_id"] for d in store.query(since_s=7)] == ["r3", "r4"]
    now[0] = 1053.5
    assert store.get("r2") is None and store.get("r4") is not None


def test_request_slo_status_is_the_p99_of_the_last_minute():
    from agent.traces.metrics import SLO_WINDOW_S, TraceCounters

    now = [1000.0]
    counters = TraceCounters(clock=lambda: now[0])
    # 200 requests: 198 fast, 2 slow; nearest-rank P99 of 200 is the 198th value.
    for i in range(200):
        e2e = 3.0 if i in (10, 20) else 0.5 + i / 1000
        counters.add_request("vllm", 0.01, [{"name": "request_e2e_p99", "target": 2.0, "value": e2e,
                                             "ok": e2e <= 2.0}], end=990.0 + i / 100)
    target, p99, ok = counters.slo_status()[("vllm", "request_e2e_p99")]
    assert (target, ok) == (2.0, True) and p99 == pytest.approx(0.5 + 199 / 1000)
    assert counters.breach_counts() == {("vllm", "request_e2e_p99"): 2}
    # One more slow request tips the P99 over the target.
    counters.add_request("vllm", 0.01, [{"name": "request_e2e_p99", "target": 2.0, "value": 3.0,
                                         "ok": False}], end=995.0)
    assert counters.slo_status()[("vllm", "request_e2e_p99")] == (2.0, 3.0, False)
    # A minute later nothing is left to judge: met, no value.
    now[0] += SLO_WINDOW_S + 10
    assert counters.slo_status()[("vllm", "request_e2e_p99")] == (2.0, None, True)
