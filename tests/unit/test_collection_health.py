"""/livez turns 503 while collections keep failing, and back once one succeeds."""

from agent.api.routes import AgentState, Api
from agent.config import Config
from agent.daemon import FAILED_POLLS_UNHEALTHY, CollectionHealth
from agent.store.store import Store


def livez(api: Api) -> tuple[int, bytes]:
    r = api.handle("GET", "/livez")
    return r.status, r.body


def test_a_run_of_failed_collections_fails_livez_and_a_success_clears_it():
    state = AgentState(config=Config(), store=Store(60.0), registry=None, describe_services=list)
    api, health = Api(state), CollectionHealth(state)
    assert livez(api)[0] == 200
    for _ in range(FAILED_POLLS_UNHEALTHY - 1):
        health.failed(OSError("map read failed"))
    assert livez(api)[0] == 200          # retried intervals are not a failure yet
    health.failed(OSError("map read failed"))
    status, body = livez(api)
    assert status == 503 and b"collections failed (OSError: map read failed)" in body
    health.succeeded()
    assert livez(api)[0] == 200
    # A success in between starts the count again.
    for _ in range(FAILED_POLLS_UNHEALTHY - 1):
        health.failed(OSError("x"))
    health.succeeded()
    health.failed(OSError("x"))
    assert livez(api)[0] == 200


def test_readyz_turns_503_while_the_self_check_finds_waits_lost_and_livez_stays_200():
    state = AgentState(config=Config(), store=Store(60.0), registry=None, describe_services=list)
    api = Api(state)
    state.ready = True
    assert api.handle("GET", "/readyz").status == 200
    state.degraded = "the BPF programs saw 5000 runq waits in the last 5 intervals but 2000 reached the agent"
    r = api.handle("GET", "/readyz")
    assert r.status == 503 and r.body == b"not ready: " + state.degraded.encode() + b"\n"
    assert livez(api)[0] == 200
    state.degraded = None
    assert api.handle("GET", "/readyz").status == 200
