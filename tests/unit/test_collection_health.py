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
