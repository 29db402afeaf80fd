"""How `rollout_client.LeasedTasks` ends its leases, against the ASGI app (docs/tasks.md): a task handed back goes
to the front untried (no retry used), a failed one records the producer's reason (cut to what the server stores),
and a lease is lost, counted once and heard by `on_lost`, when its end passes without a heartbeat (then handed
back at once) or when a heartbeat answers null for it (then its task, if not started, is skipped); while its group
is on its way, the server's reply decides instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.wire.tasks import REASON_MAX
from rollout_client import LeasedTasks
from rollout_client.leases.tasks import lease_token

pytestmark = pytest.mark.anyio

GUARD_S = 30.0


@pytest.fixture
async def app(request: pytest.FixtureRequest) -> AsyncIterator[httpx.ASGITransport]:
    """The app with leases of `request.param` seconds and a dataset "d" of 4 tasks."""
    app = create_app(Settings(store="memory://", task_lease_s=request.param))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            tasks = [f"{i}+{i}" for i in range(4)]
            assert (await c.post("/tasks/datasets", json={"name": "d", "tasks": tasks})).status_code == 200
        yield transport


async def rows(transport: httpx.ASGITransport) -> dict[int, dict[str, Any]]:
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        got = (await c.get("/tasks/rows", params={"dataset": "d"})).json()["tasks"]
    return {r["index"]: r for r in got}


async def until(cond: Callable[[], Any], what: str) -> None:
    """Poll `cond` (a coroutine function or a plain one); fail after GUARD_S."""
    deadline = time.monotonic() + GUARD_S
    while not (await got if asyncio.iscoroutine(got := cond()) else got):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("app", [30.0], indirect=True, ids=["long-leases"])
async def test_a_task_handed_back_goes_to_the_front_untried_and_a_failure_keeps_its_reason(
    app: httpx.ASGITransport,
) -> None:
    source = LeasedTasks("d", "http://localhost", batch=2, transport=app)
    first, second = await source.anext_task(), await source.anext_task()
    assert first is not None and second is not None
    source.hand_back(first)
    source.fail(second, "env_error: ValueError: " + "x" * (3 * REASON_MAX))

    async def ended() -> bool:
        states = await rows(app)
        return bool(states[0]["state"] == "waiting" and states[1]["state"] == "failed")

    await until(ended, "both leases to end")
    states = await rows(app)
    assert states[0]["retries"] == 0 and states[0]["reason"] is None, "untried: no retry used, no failure recorded"
    assert states[1]["reason"].startswith("env_error: ValueError: xxx") and len(states[1]["reason"]) == REASON_MAX
    again = await source.anext_task()
    assert again is not None and again.prompt == first.prompt, "the task handed back is leased first"
    assert source.lost == 0
    await source.aclose()


@pytest.mark.parametrize("app", [0.5], indirect=True, ids=["short-leases"])
async def test_a_lease_whose_end_passes_without_a_heartbeat_is_lost_and_handed_back(
    app: httpx.ASGITransport,
) -> None:
    source = LeasedTasks("d", "http://localhost", batch=1, heartbeat_s=3600, transport=app)  # no heartbeat comes
    heard: list[str] = []
    source.on_lost(heard.append)
    task = await source.anext_task()
    assert task is not None and source.holds(task)
    await until(lambda: not source.holds(task), "the lease to pass its end")
    assert source.lost == 1 and heard == [lease_token(task)]
    await until(_state(app, 0, "waiting"), "the lost lease to be handed back to the front")
    source.hand_back(task)
    source.fail(task, "too late")  # lost: nothing of it is this producer's to end
    assert (await rows(app))[0]["state"] == "waiting" and source.lost == 1
    await source.aclose()


@pytest.mark.parametrize("app", [30.0], indirect=True, ids=["long-leases"])
async def test_a_lease_a_heartbeat_answers_null_for_is_lost_and_its_task_skipped(app: httpx.ASGITransport) -> None:
    source = LeasedTasks("d", "http://localhost", batch=2, heartbeat_s=0.05, transport=app)
    heard: list[str] = []
    source.on_lost(heard.append)
    started = await source.anext_task()
    assert started is not None and len(source._ready) == 1
    waiting = source._ready[0]
    async with httpx.AsyncClient(transport=app, base_url="http://localhost") as c:
        for task in (started, waiting):  # another hand hands them back: the server gives them to the next lease
            reply = await c.post("/tasks/fail", json={"token": lease_token(task), "reason": None})
            assert reply.json() == {"accepted": True}
    await until(lambda: source.lost == 2, "the heartbeat to say both leases are lost")
    assert set(heard) == {lease_token(started), lease_token(waiting)} and len(heard) == 2
    assert not source.holds(started) and not source.holds(waiting)
    nxt = await source.anext_task()
    assert nxt is not None and lease_token(nxt) not in heard, "the lost lease's task was skipped, not handed out"
    await source.aclose()


@pytest.mark.parametrize("app", [30.0], indirect=True, ids=["long-leases"])
async def test_while_a_group_is_on_its_way_its_reply_decides_whether_the_lease_was_lost(
    app: httpx.ASGITransport,
) -> None:
    source = LeasedTasks("d", "http://localhost", batch=2, heartbeat_s=0.05, transport=app)
    heard: list[str] = []
    source.on_lost(heard.append)
    acked, refused = await source.anext_task(), await source.anext_task()
    assert acked is not None and refused is not None
    assert source.sending(acked) and source.sending(refused)
    async with httpx.AsyncClient(transport=app, base_url="http://localhost") as c:
        for task in (acked, refused):  # the heartbeat now answers null, as it does once a group is submitted
            reply = await c.post("/tasks/fail", json={"token": lease_token(task), "reason": None})
            assert reply.json() == {"accepted": True}
    await until(lambda: not source.holds(acked) and not source.holds(refused), "the heartbeat to answer null")
    assert source.lost == 0 and heard == [], "not counted while the groups are on their way"
    source.report(acked, 1.0)  # acknowledged: the null was its own submission
    source.lose(refused)  # refused with a 409: lost
    source.lose(refused)
    assert source.lost == 1 and heard == [lease_token(refused)]
    assert not source.sending(refused), "a lost lease's group is not sent"
    await source.aclose()


def _state(app: httpx.ASGITransport, index: int, state: str) -> Callable[[], Any]:
    async def check() -> bool:
        return bool((await rows(app))[index]["state"] == state)

    return check
