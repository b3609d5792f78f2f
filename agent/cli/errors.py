"""The CLI's own error: a mistake on the command line, not in the agent."""

from __future__ import annotations

from agent.errors import SlatraceError


class CliError(SlatraceError):
    """Printed as one line, exit status 2."""
