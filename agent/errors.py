"""The base of every error slatrace explains to its operator.

Each says in one sentence what went wrong and how to fix it; the CLI prints
it as `slatrace: error: ...` and exits 2, without a traceback. It imports
nothing, so every floor of the agent can raise it.
"""

from __future__ import annotations


class SlatraceError(Exception):
    """An error whose message is the whole explanation (what and how to fix)."""
