"""A server process validates submissions against the run state it saw last (no read of its own per request);
another process sharing the store may have changed the run since. These are two apps on one store (a SQLite
file, a PostgreSQL database), each with its own memory of the run: what one changes, the other obeys at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from tests import pg
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/shared.db"
    else:
        with pg.database() as name:
            yield pg.url_of(name)


@pytest.fixture
async def two(store_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with AsyncExitStack() as stack:
        clients = []
        for name in ("a", "b"):
            app = create_app(Settings(store=store_url))
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url=f"http://{name}.localhost")
                )
            )
        yield clients[0], clients[1]


async def start(client: httpx.AsyncClient, envs: int = 1, **reg: int) -> list[int]:
    assert (await client.post("/register", json=registration(batch_size=8, **reg))).status_code == 200
    assert (await client.get("/batch", params={"step": 0})).json() == {"batch": None}
    return [(await client.post("/register-env", json=env(f"e{i}", group_size=4))).json()["env_id"] for i in range(envs)]


async def test_limits_of_a_registration_made_through_another_process(
    two: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, b = two
    await start(a, max_token_len=64)
    assert (await b.post("/scored_data", json=group(4, length=48, seed=1))).status_code == 200  # b remembers 64
    await a.get("/reset_data")
    await start(a, max_token_len=32)
    refused = await b.post("/scored_data", json=group(4, length=48, seed=2))
    assert refused.status_code == 422, refused.text
    assert "32" in refused.json()["message"]
    await a.get("/reset_data")
    await start(a, max_token_len=128)
    assert (await b.post("/scored_data", json=group(4, length=100, seed=3))).status_code == 200
    assert (await a.get("/status")).json()["queue_size"] == 1


async def test_an_env_registered_through_another_process(two: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    a, b = two
    [first] = await start(a)
    assert (await b.post("/scored_data", json=group(4, env_id=first, seed=1))).status_code == 200
    second = (await a.post("/register-env", json=env("late", group_size=4))).json()["env_id"]
    for route, body in (
        ("/scored_data", group(4, env_id=second, seed=2)),
        ("/scored_data_list", [group(4, env_id=second, seed=3)]),
    ):
        r = await b.post(route, json=body)
        assert r.status_code == 200, r.text
    unknown = await b.post("/scored_data", json=group(4, env_id=second + 1, seed=4))
    assert unknown.status_code == 422 and unknown.json()["errors"][0]["loc"] == ["body", "env_id"]


async def test_groups_without_a_policy_step_are_stamped_with_the_step_they_are_stored_at(
    two: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, b = two
    await start(a)
    assert (await b.post("/scored_data", json=group(4, seed=1))).status_code == 200  # b remembers step 0
    assert (await a.post("/scored_data", json=group(4, seed=2))).status_code == 200
    assert (await a.get("/batch", params={"step": 0})).json()["batch"] is not None  # the step moves to 1, via a
    assert (await b.post("/scored_data", json=group(4, seed=3))).status_code == 200
    assert (await b.post("/scored_data", json=group(4, seed=4))).status_code == 200
    batch = (await b.get("/batch", params={"step": 1})).json()["batch"]
    assert [item["policy_step"] for item in batch] == [1, 1]
    # a's memory says step 1; b moved it to 2: a stamps 2, and a stale policy_step sent is still refused
    assert (await a.post("/scored_data", json=group(4, seed=5))).status_code == 200
    assert (await a.post("/scored_data", json=group(4, seed=6, policy_step=2))).status_code == 200
    ahead = await a.post("/scored_data", json=group(4, seed=7, policy_step=3))
    assert ahead.status_code == 422 and ahead.json()["errors"][0]["loc"] == ["body", "policy_step"]
    batch = (await b.get("/batch", params={"step": 2})).json()["batch"]
    assert [item["policy_step"] for item in batch] == [2, 2]
