"""Two replicas (two apps, each with its own PostgreSQL store) on one database behave as one process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from tests import pg
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


@pytest.fixture
async def replicas(dbname: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with AsyncExitStack() as stack:
        clients = []
        for name in ("a", "b"):
            app = create_app(Settings(store=pg.url_of(dbname)))
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url=f"http://{name}.localhost")
                )
            )
        yield clients[0], clients[1]


async def start(a: httpx.AsyncClient, batch_size: int = 8) -> list[int]:
    assert (await a.post("/register", json=registration(batch_size=batch_size))).status_code == 200
    assert (await a.get("/batch", params={"step": 0})).json() == {"batch": None}
    return [(await a.post("/register-env", json=env(f"e{i}", group_size=4))).json()["env_id"] for i in range(2)]


async def test_a_batch_is_the_same_bytes_whichever_replica_serves_it(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, b = replicas
    env_ids = await start(a)
    for i in range(4):
        r = await (a, b)[i % 2].post("/scored_data", json=group(4, env_id=env_ids[i % 2], seed=i, group_id=f"g{i}"))
        assert r.status_code == 200
    binary = {"Accept": "application/msgpack"}
    first = await b.get("/batch", params={"step": 0}, headers=binary)
    again = await a.get("/batch", params={"step": 0}, headers=binary)
    assert first.status_code == again.status_code == 200
    assert first.content == again.content and first.headers["X-Rollbuf-Step"] == "0"
    as_json = [(await c.get("/batch", params={"step": 0})).content for c in (a, b)]
    assert as_json[0] == as_json[1]
    # Asking either replica for step 1 acknowledges step 0 on both.
    await a.get("/batch", params={"step": 1})
    assert (await b.get("/batch", params={"step": 0})).status_code == 410


async def test_a_group_id_seen_by_one_replica_is_a_duplicate_on_the_other(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, b = replicas
    env_ids = await start(a)
    body = group(4, env_id=env_ids[0], seed=1, group_id="once")
    assert (await a.post("/scored_data", json=body)).json() == {"status": "received"}
    assert (await b.post("/scored_data", json=body)).json() == {"status": "received", "duplicate": True}
    assert (await b.get("/status")).json()["queue_size"] == 1


async def test_replicas_forming_batches_at_once_serve_every_group_once(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, b = replicas
    env_ids = await start(a)
    posts = [
        (a, b)[i % 2].post("/scored_data", json=group(4, env_id=env_ids[i % 2], seed=i, group_id=f"g{i}"))
        for i in range(40)
    ]
    assert {r.status_code for r in await asyncio.gather(*posts)} == {200}
    replies = await asyncio.gather(*((a, b)[i % 2].get("/batch") for i in range(24)))
    batches = [r.json()["batch"] for r in replies]
    served = [g["group_id"] for batch in batches if batch for g in batch]
    assert sorted(served) == sorted(f"g{i}" for i in range(40)), "every group served exactly once"
    assert sum(1 for batch in batches if batch) == 20
    assert all(sum(len(g["tokens"]) for g in batch) == 8 for batch in batches if batch)
    assert (await b.get("/status")).json()["current_step"] == 20


async def test_a_long_poll_wakes_for_data_queued_through_another_replica(
    replicas: tuple[httpx.AsyncClient, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting long-poll re-checks on no timer: only the other replica's NOTIFY can end this one."""
    a, b = replicas
    env_ids = await start(a)
    poll = asyncio.create_task(a.get("/batch", params={"step": 0, "wait": 60}))
    for i in range(2):
        await asyncio.sleep(0.2)  # let the long-poll start waiting first (if it did not, it still passes)
        await b.post("/scored_data", json=group(4, env_id=env_ids[0], seed=i, group_id=f"g{i}"))
    r = await asyncio.wait_for(poll, 120)
    assert r.json()["batch"] is not None and len(r.json()["batch"]) == 2
