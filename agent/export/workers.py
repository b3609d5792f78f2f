"""The background workers' own family (declared in agent/export/catalog.py):
`slatrace_worker_errors_total{worker}`, read from every started worker at
scrape time (agent/workers.py keeps the counts)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.export.catalog import WORKER_ERRORS, WORKERS
from agent.export.figures import Family, Point
from agent.export.prometheus import declared, to_metric

__all__ = ["WorkerCollector"]


class _Worker(Protocol):
    name: str
    errors: int


class WorkerCollector(Collector):
    """One series per worker name (workers of the same name are summed)."""

    def __init__(self, workers: Callable[[], Iterable[_Worker]]) -> None:
        self._workers = workers

    def families(self) -> tuple[Family, ...]:
        errors: dict[str, int] = {}
        for worker in self._workers():
            errors[worker.name] = errors.get(worker.name, 0) + worker.errors
        return (Family(WORKER_ERRORS, tuple(Point((name,), n) for name, n in sorted(errors.items()))),)

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield to_metric(family)

    def describe(self) -> Iterator[Metric]:
        for spec in WORKERS:
            yield declared(spec)
