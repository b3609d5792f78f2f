"""HTTP client of the agent's API, for the query commands."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class AgentUnreachable(Exception):
    pass


def get(agent: str, path: str, params: dict | None = None, timeout: float = 5.0) -> dict:
    url = agent.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e).get("error", e.reason)
        except ValueError:
            message = e.reason
        raise AgentUnreachable(f"the agent at {agent} answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AgentUnreachable(f"cannot reach the agent at {agent} ({reason}): is 'slatrace run' running? "
                               "(use --agent URL for another address)") from None
    except ValueError:
        raise AgentUnreachable(f"the agent at {agent} did not answer JSON on {path}") from None
