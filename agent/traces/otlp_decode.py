"""OTLP trace payloads -> ExportTraceServiceRequest, with limits.

Both receivers (gRPC and HTTP) and the property tests go through here, so every
malformed body is judged once, the same way: a DecodeError carrying the status
an HTTP receiver answers and a reason an operator can act on. Nothing here
touches a socket.

OTLP/JSON is the protobuf JSON mapping with two exceptions (OTLP spec, "JSON
Protobuf Encoding"): trace and span ids are hex, not base64, and enum values
may be integers. The ids are rewritten to base64 before protobuf's own JSON
parser sees the document, so everything else (camelCase or snake_case field
names, int64 as string or number) follows protobuf's rules exactly.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError as ProtoDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.errors import SlatraceError

__all__ = [
    "DecodeError",
    "Limits",
    "count_spans",
    "decode_body",
    "decode_json",
    "decode_protobuf",
    "gunzip",
    "truncate_attributes",
]

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one export request may cost the agent."""

    max_body_bytes: int = 4 * MiB          # on the wire (compressed or not)
    max_decompressed_bytes: int = 16 * MiB  # after gunzip: a bomb stops here
    max_spans: int = 10_000                 # per export request
    # Longer string (characters) or bytes attribute values are cut to this length
    # and counted, so a span's size on the agent stays bounded whatever it carries.
    max_attribute_length: int = 8192


class DecodeError(SlatraceError, ValueError):
    """A payload the receiver refuses; `status` is the HTTP status to answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def gunzip(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body, refusing to produce more than `limit` bytes.

    zlib's max_length caps each step's output, so a few KiB that would expand
    to gigabytes cost at most `limit` bytes of memory before being refused.
    """
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise DecodeError(400, f"the body is not valid gzip ({e})") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise DecodeError(413, f"the body inflates to more than {limit} bytes; send smaller batches")
    if not inflater.eof:
        raise DecodeError(400, "the gzip body is truncated")
    return out


def decode_protobuf(data: bytes, limits: Limits = Limits()) -> ExportTraceServiceRequest:
    """Binary protobuf ExportTraceServiceRequest."""
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(data)
    except (ProtoDecodeError, RuntimeError, ValueError) as e:
        raise DecodeError(400, f"the body is not a protobuf ExportTraceServiceRequest ({e})") from None
    _check_spans(req, limits)
    return req


def decode_json(data: bytes, limits: Limits = Limits()) -> ExportTraceServiceRequest:
    """OTLP/JSON ExportTraceServiceRequest."""
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as e:
        raise DecodeError(400, f"the JSON body is not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise DecodeError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise DecodeError(400, "the JSON body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise DecodeError(400, f"the JSON body must be an object with resourceSpans, got {type(doc).__name__}")
    _hex_ids_to_base64(doc)
    req = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(doc, req, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise DecodeError(400, f"the JSON body is not an OTLP ExportTraceServiceRequest: {e}") from None
    except (RecursionError, TypeError, ValueError, AttributeError) as e:
        # ParseDict lets a few of these through for odd shapes; they are still the client's error.
        raise DecodeError(400, f"the JSON body is not an OTLP ExportTraceServiceRequest: {e}") from None
    _check_spans(req, limits)
    return req


def decode_body(body: bytes, content_type: str | None, content_encoding: str | None,
                limits: Limits = Limits()) -> tuple[ExportTraceServiceRequest, bool]:
    """An HTTP body by its headers; returns the request and whether it was JSON
    (the response is encoded the same way)."""
    if len(body) > limits.max_body_bytes:
        raise DecodeError(413, f"the body has {len(body)} bytes, more than the limit of {limits.max_body_bytes}")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in ("application/x-protobuf", "application/protobuf"):
        is_json = False
    elif media == "application/json":
        is_json = True
    else:
        raise DecodeError(415, f"Content-Type {content_type or '(none)'!r} is not supported; "
                               "send application/x-protobuf or application/json")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = gunzip(body, limits.max_decompressed_bytes)
    elif encoding != "identity":
        raise DecodeError(415, f"Content-Encoding {content_encoding!r} is not supported; send gzip or none")
    return (decode_json(body, limits) if is_json else decode_protobuf(body, limits)), is_json


def count_spans(req: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


def _check_spans(req: ExportTraceServiceRequest, limits: Limits) -> None:
    n = count_spans(req)
    if n > limits.max_spans:
        raise DecodeError(413, f"the request carries {n} spans, more than the limit of {limits.max_spans} "
                               "per export; send smaller batches")


_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _hex_ids_to_base64(doc: dict[str, Any]) -> None:
    """Rewrite hex ids in place where the document has the expected shape; any
    other shape is left for ParseDict to reject with its own message."""
    for i, rs in enumerate(_items(doc, "resourceSpans", "resource_spans")):
        for j, ss in enumerate(_items(rs, "scopeSpans", "scope_spans")):
            for k, span in enumerate(_items(ss, "spans")):
                where = f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]"
                _rewrite_ids(span, where)
                for m, link in enumerate(_items(span, "links")):
                    _rewrite_ids(link, f"{where}.links[{m}]")


def _items(obj: Any, *keys: str) -> list[Any]:
    if not isinstance(obj, dict):
        return []
    for key in keys:
        value = obj.get(key)
        if isinstance(value, list):
            return value
    return []


def _rewrite_ids(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        return
    for key in _ID_FIELDS:
        value = obj.get(key)
        if not isinstance(value, str):
            continue  # a wrong type is reported by ParseDict
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise DecodeError(400, f"{where}.{key} {value[:40]!r} is not hex (OTLP/JSON ids are hex strings)") from None
        obj[key] = base64.b64encode(raw).decode("ascii")


def truncate_attributes(req: ExportTraceServiceRequest, limit: int) -> int:
    """Cut every string or bytes attribute value (resource, scope, span, event,
    link; nested arrays and maps too) to `limit`, in place; returns how many
    values were cut. A span no larger than `limit` bytes is skipped unread."""
    if req.ByteSize() <= limit:
        return 0
    cut = 0
    for rs in req.resource_spans:
        cut += _truncate_kvs(rs.resource.attributes, limit)
        for ss in rs.scope_spans:
            cut += _truncate_kvs(ss.scope.attributes, limit)
            for span in ss.spans:
                if span.ByteSize() <= limit:
                    continue
                cut += _truncate_kvs(span.attributes, limit)
                for event in span.events:
                    cut += _truncate_kvs(event.attributes, limit)
                for link in span.links:
                    cut += _truncate_kvs(link.attributes, limit)
    return cut


def _truncate_kvs(kvs, limit: int) -> int:
    return sum(_truncate_value(kv.value, limit) for kv in kvs)


def _truncate_value(value, limit: int) -> int:
    if value.ByteSize() <= limit:
        return 0
    kind = value.WhichOneof("value")
    if kind in ("string_value", "bytes_value"):
        data = getattr(value, kind)
        if len(data) <= limit:  # ByteSize counts the tag and length too
            return 0
        setattr(value, kind, data[:limit])
        return 1
    if kind == "array_value":
        return sum(_truncate_value(v, limit) for v in value.array_value.values)
    if kind == "kvlist_value":
        return _truncate_kvs(value.kvlist_value.values, limit)
    return 0
