"""The config's service rules: what the operator says names a service.

They live with the naming (agent/identity/services.py applies them); the
config reads them from YAML and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceRule:
    """Names the tasks that match every matcher given; the first matching rule wins."""

    name: str
    cgroup: str | None = None
    comm: str | None = None
    k8s_namespace: str | None = None
    k8s_pod: str | None = None
    k8s_container: str | None = None
    systemd_unit: str | None = None
    pid: int | None = None
