"""The ingest routes' direct lane (`api.routes.direct.DirectLane`): past Starlette's routing and inner
middleware, a request gets what those layers gave it: the app's error rendering, gzip of a large answer,
the route's name in metrics, and the router's answers for what the lane does not serve."""

from __future__ import annotations

import gzip

import pytest

from api.config.settings import Settings
from tests.asgi import serving
from tests.factories import env, group, registration
from tests.small_run import parse_metrics

pytestmark = pytest.mark.anyio
SETTINGS = Settings(store="memory://")


async def test_a_large_error_answer_is_gzipped_only_for_a_client_that_accepts_it() -> None:
    async with serving(SETTINGS) as c:
        plain = await c.post("/scored_data_list", json=[{}] * 20, headers={"Accept-Encoding": "identity"})
        zipped = await c.post("/scored_data_list", json=[{}] * 20, headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == zipped.status_code == 422
    assert "content-encoding" not in plain.headers and len(plain.content) > 1000
    assert zipped.headers["content-encoding"] == "gzip" and "accept-encoding" in zipped.headers["vary"].lower()
    assert zipped.json() == plain.json()  # httpx inflated it
    assert plain.json()["errors"][0]["loc"][:2] == ["body", 0]  # the app's handler: field and rule named


def _counts(text: str) -> dict[str, float]:
    """Requests to /scored_data by status (the process's registry: other tests' requests are counted too)."""
    name = "rollbuf_request_duration_seconds_count"
    return {
        dict(k[1])["status"]: v
        for k, v in parse_metrics(text).items()
        if k[0] == name and dict(k[1]).get("route") == "/scored_data"
    }


async def test_small_answers_go_as_they_are_and_are_counted_under_their_route() -> None:
    async with serving(SETTINGS, metrics=True) as c:
        await c.post("/register", json=registration())
        await c.get("/batch")
        env_id = (await c.post("/register-env", json=env())).json()["env_id"]
        before = _counts((await c.get("/metrics")).text)
        r = await c.post("/scored_data", json=group(4, env_id=env_id), headers={"Accept-Encoding": "gzip"})
        assert r.status_code == 200 and "content-encoding" not in r.headers and r.json()["status"] == "received"
        bad = await c.post("/scored_data", content=gzip.compress(b"{"), headers={"Content-Encoding": "gzip"})
        assert bad.status_code in (400, 422)
        after = _counts((await c.get("/metrics")).text)
    grew = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert grew == {"200": 1, str(bad.status_code): 1}


async def test_other_methods_on_an_ingest_path_are_the_routers() -> None:
    async with serving(SETTINGS) as c:
        r = await c.get("/scored_data")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
