"""`rollout_client.LeasedTasks` against the ASGI app (docs/tasks.md): tasks leased a batch at a time and mapped to
`Task`s carrying their lease, heartbeated while held, failed when discarded, handed back untried on close, and
None once the dataset is done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from rollout_client import LeasedTasks
from rollout_client.leases.tasks import lease_token

pytestmark = pytest.mark.anyio


@pytest.fixture
async def app_transport() -> AsyncIterator[httpx.ASGITransport]:
    app = create_app(Settings(store="memory://", task_lease_s=5.0))
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app)


async def rows(transport: httpx.ASGITransport) -> dict[int, dict]:  # type: ignore[type-arg]
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        got = (await c.get("/tasks/rows", params={"dataset": "d"})).json()["tasks"]
    return {r["index"]: r for r in got}


async def test_leases_are_heartbeated_failed_handed_back_and_end(app_transport: httpx.ASGITransport) -> None:
    async with httpx.AsyncClient(transport=app_transport, base_url="http://localhost") as c:
        tasks = [{"id": "a", "prompt": "1+1", "answer": "2", "level": 3}, "2+2", {"prompt": "3+3"}]
        assert (await c.post("/tasks/datasets", json={"name": "d", "tasks": tasks})).status_code == 200
    source = LeasedTasks("d", "http://localhost", batch=2, heartbeat_s=0.05, transport=app_transport)
    first = await source.anext_task()
    assert first is not None and (first.id, first.prompt, first.answer) == ("a", "1+1", "2")
    token = lease_token(first)
    assert first.meta["level"] == 3 and token is not None and token.startswith("task:d:0:0:1.")
    leased_until = (await rows(app_transport))[0]["expires_at"]
    deadline = time.monotonic() + 30
    while (await rows(app_transport))[0]["expires_at"] == leased_until:  # the heartbeat extends it
        assert time.monotonic() < deadline, "never heartbeated"
        await asyncio.sleep(0.05)
    source.discard(first)
    while (await rows(app_transport))[0]["state"] != "failed":
        assert time.monotonic() < deadline, "the discarded task never failed"
        await asyncio.sleep(0.05)
    second = await source.anext_task()
    assert second is not None and (second.id, second.prompt) == ("d:1", "2+2")
    source.report(second, 1.0)
    third = await source.anext_task()
    assert third is not None and third.prompt == "3+3"
    source.discard(third)
    await source.aclose()
    states = {i: r["state"] for i, r in (await rows(app_transport)).items()}
    assert states == {0: "failed", 1: "leased", 2: "failed"}

    other = LeasedTasks("d", "http://localhost", batch=2, poll_s=0.05, transport=app_transport)
    async with httpx.AsyncClient(transport=app_transport, base_url="http://localhost") as c:
        tokens = [lease_token(second)]
        assert (await c.post("/tasks/fail", json={"token": tokens[0], "reason": "x"})).json() == {"accepted": True}
    assert await other.anext_task() is None, "the dataset is done"
    await other.aclose()
