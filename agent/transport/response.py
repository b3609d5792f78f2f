"""What an HTTP app answers with, and the small helpers every app uses to
read a query and write JSON: one definition for the API and the receivers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from agent.errors import SlatraceError

__all__ = ["QueryError", "Response", "error", "finite_only", "float_param", "json_response", "str_param"]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    close: bool = False  # close the connection after answering


def json_response(status: int, doc: dict) -> Response:
    """Always valid JSON: a non-finite number (which json.dumps would write as
    NaN or Infinity) becomes null."""
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(finite_only(doc), separators=(",", ":"), allow_nan=False)
    return Response(status, (text + "\n").encode())


def finite_only(value):
    """`value` with every NaN or infinite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v) for v in value]
    return value


def error(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


class QueryError(SlatraceError, ValueError):
    pass


def str_param(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def float_param(query: dict[str, list[str]], name: str, default: float) -> float:
    raw = str_param(query, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise QueryError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise QueryError(f"{name} must be a positive number of seconds, got {raw}")
    return value
