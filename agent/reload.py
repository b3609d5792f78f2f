"""SIGHUP: read the config file again and apply what can change live.

Services (the naming rules) and SLOs change at once; interval, retention,
max_services and buckets_per_octave shape what is already collected and need
a restart, which the log says. A file that does not load keeps the running
config, with one error line. The signal handler only sets a flag; the work is
done on this module's thread, never inside the handler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from agent.config import Config, ConfigError, load_config
from agent.workers import Worker, WorkerHandle

__all__ = ["ConfigReloader", "ConfigSubscribers", "describe_changes", "load_with_overrides"]

log = logging.getLogger("slatrace")

LIVE = ("services", "slos", "otlp_relays")


class ConfigSubscribers:
    """Who reads which live section of the config (one of LIVE), and what else
    a SIGHUP reloads: each reader registers where it is built, so a reload
    reaches every reader without the daemon knowing them."""

    def __init__(self) -> None:
        self._by_section: dict[str, list[Callable[[Any], None]]] = {}
        self._on_hangup: list[Callable[[], None]] = []

    def subscribe(self, section: str, callback: Callable[[Any], None]) -> None:
        """`callback(new value)` whenever a reload changes `section`."""
        if section not in LIVE:
            raise ValueError(f"{section!r} does not change live; the sections that do: {', '.join(LIVE)}")
        self._by_section.setdefault(section, []).append(callback)

    def on_hangup(self, callback: Callable[[], None]) -> None:
        """`callback()` on every SIGHUP, inside the signal handler: it must only set a flag."""
        self._on_hangup.append(callback)

    def hangup(self) -> None:
        for callback in list(self._on_hangup):
            callback()

    def publish(self, old: Config, new: Config) -> list[str]:
        """Call the subscribers of every section that differs; the sections, in LIVE's order."""
        changed = [section for section in LIVE if getattr(old, section) != getattr(new, section)]
        for section in changed:
            for callback in list(self._by_section.get(section, ())):
                callback(getattr(new, section))
        return changed


def load_with_overrides(path: str | None, overrides: dict) -> Config:
    """The file's config with the command line's flags on top (flags win)."""
    config = load_config(path) if path else Config()
    if overrides:
        config = replace(config, **overrides)
    if config.retention < config.interval:
        raise ConfigError(f"retention ({config.retention:g} s) must be at least the interval "
                          f"({config.interval:g} s)")
    return config


def _by_name(items, key: str) -> dict:
    out: dict = {}
    for item in items:
        out.setdefault(getattr(item, key), []).append(item)
    return out


def _diff(old: dict, new: dict) -> list[str]:
    parts = [f"+{k}" for k in sorted(new.keys() - old.keys())]
    parts += [f"-{k}" for k in sorted(old.keys() - new.keys())]
    parts += [f"~{k}" for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    return parts


def describe_changes(old: Config, new: Config) -> tuple[str, list[str]]:
    """(what changed live, in one phrase; fields that need a restart)."""
    said = []
    services = _diff(_by_name(old.services, "name"), _by_name(new.services, "name"))
    if not services and old.services != new.services:
        services = ["order"]
    if services:
        said.append("services " + " ".join(services))
    slos = _diff(_by_name(old.slos, "service"), _by_name(new.slos, "service"))
    if slos:
        said.append("slos " + " ".join(slos))
    if old.otlp_relays != new.otlp_relays:
        said.append(f"otlp_relays {len(old.otlp_relays)}->{len(new.otlp_relays)}")
    restart = [f.name for f in fields(Config) if f.name not in LIVE and getattr(old, f.name) != getattr(new, f.name)]
    return ("; ".join(said) or "nothing"), restart


class ConfigReloader:
    """Waits for `request()` (called from the SIGHUP handler) and reloads;
    between requests, calls `tick` every `tick_s` (housekeeping)."""

    def __init__(self, path: str | None, overrides: dict, current: Callable[[], Config],
                 apply: Callable[[Config], None], tick: Callable[[], None] | None = None,
                 tick_s: float = 5.0, warn_without_path: bool = True) -> None:
        self.path = path
        self.warn_without_path = warn_without_path
        self._tick = tick
        self.tick_s = tick_s
        self.overrides = dict(overrides)
        self._current = current
        self._apply = apply
        self.worker = Worker.loop("reload", "reloading the config and housekeeping", self._run)
        self.reloads = 0
        self.failures = 0

    def start(self) -> None:
        self.worker.start()

    def request(self) -> None:
        """Safe inside a signal handler: sets a flag, nothing else."""
        self.worker.nudge()

    def stop(self) -> None:
        self.worker.stop(2.0)

    def _run(self, handle: WorkerHandle) -> None:
        while True:
            wanted = handle.wait_nudge(self.tick_s)
            if handle.stopping:
                return
            if wanted:
                self.reload()
            elif self._tick is not None:
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001  (housekeeping is retried at the next tick)
                    handle.failed(e, again_in=self.tick_s)
                    continue
            handle.succeeded()

    def reload(self) -> bool:
        if not self.path:
            if self.warn_without_path:
                log.warning("SIGHUP: slatrace was started without --config, so there is no file to reload")
            return False
        try:
            new = load_with_overrides(self.path, self.overrides)
        except ConfigError as e:
            self.failures += 1
            log.error("reload failed, keeping the running config: %s", e)
            return False
        old = self._current()
        changed, restart = describe_changes(old, new)
        keep = {name: getattr(old, name) for name in restart}
        try:
            self._apply(replace(new, **keep))
        except Exception as e:  # noqa: BLE001  (one line; the old config stays where it was not replaced)
            self.failures += 1
            log.error("reload failed while applying %s: %s", self.path, e)
            return False
        self.reloads += 1
        log.info("reloaded %s: %s%s", self.path, changed,
                 f"; {', '.join(restart)} changed in the file but need a restart (kept)" if restart else "")
        return True
