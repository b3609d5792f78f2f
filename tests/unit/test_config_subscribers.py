"""A reload reaches the readers that registered for the sections it changed,
and only those; SIGHUP reaches what registered for it."""

from __future__ import annotations

import pytest

from agent.config import Config, ServiceRule, Slo
from agent.reload import ConfigSubscribers


def test_a_reload_calls_the_subscribers_of_the_sections_that_changed():
    subs = ConfigSubscribers()
    got: list[tuple[str, object]] = []
    subs.subscribe("slos", lambda v: got.append(("breaches", v)))
    subs.subscribe("slos", lambda v: got.append(("pipeline", v)))
    subs.subscribe("services", lambda v: got.append(("resolver", v)))
    subs.subscribe("otlp_relays", lambda v: got.append(("relays", v)))
    old = Config(services=(ServiceRule("a", comm="a"),))
    new = Config(services=old.services, slos=(Slo("a", runq_p99=0.01),))
    assert subs.publish(old, new) == ["slos"]
    assert got == [("breaches", new.slos), ("pipeline", new.slos)]
    got.clear()
    assert subs.publish(new, new) == [] and got == []


def test_only_live_sections_take_subscribers_and_hangup_calls_its_own():
    subs = ConfigSubscribers()
    with pytest.raises(ValueError, match="'interval' does not change live"):
        subs.subscribe("interval", print)
    asked: list[int] = []
    subs.on_hangup(lambda: asked.append(1))
    subs.hangup()
    assert asked == [1]
