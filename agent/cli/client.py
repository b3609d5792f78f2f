"""HTTP client of the agent's API, for the query commands."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from agent.errors import SlatraceError


class AgentUnreachable(SlatraceError):
    pass


class FetchError(SlatraceError):
    """An HTTP JSON request that failed: status is None when nothing answered,
    or the HTTP status; detail says what happened."""

    def __init__(self, status: int | None, detail: str, not_json: bool = False) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.not_json = not_json


def fetch_json(url: str, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        try:
            detail = json.load(e).get("error", e.reason)
        except ValueError:
            detail = e.reason
        raise FetchError(e.code, str(detail)) from None
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(None, str(getattr(e, "reason", e))) from None
    except ValueError:
        raise FetchError(200, "not JSON", not_json=True) from None


def get(agent: str, path: str, params: dict | None = None, timeout: float = 5.0) -> dict:
    url = agent.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        return fetch_json(url, timeout)
    except FetchError as e:
        if e.not_json:
            raise AgentUnreachable(f"the agent at {agent} did not answer JSON on {path}") from None
        if e.status is not None:
            raise AgentUnreachable(f"the agent at {agent} answered {e.status}: {e.detail}") from None
        raise AgentUnreachable(f"cannot reach the agent at {agent} ({e.detail}): is 'slatrace run' running? "
                               "(use --agent URL for another address)") from None
