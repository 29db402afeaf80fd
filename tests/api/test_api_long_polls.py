"""Waiting trainers are free: a `/batch?wait=` long-poll runs no store transaction while nothing changes, and
the change that can end it wakes it (2,000 of them once re-ran a write transaction every 0.5 s each)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.api.test_ingest import start
from tests.factories import group

pytestmark = pytest.mark.anyio


def count_transactions(client: httpx.AsyncClient) -> list[int]:
    """Count every transaction and read the app's store runs from now on."""
    store = client._transport.app.state.service.store  # type: ignore[attr-defined]
    ran = [0]
    transact, read = store.transact, store.read

    async def counted_transact(fn: Any, **kw: Any) -> Any:
        ran[0] += 1
        return await transact(fn, **kw)

    async def counted_read(fn: Any) -> Any:
        ran[0] += 1
        return await read(fn)

    store.transact, store.read = counted_transact, counted_read
    return ran


async def test_a_waiting_long_poll_runs_no_transaction(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=8)
    ran = count_transactions(client)
    wakeups = client._transport.app.state.service.wakeups  # type: ignore[attr-defined]
    changes = wakeups.count
    polls = [client.get("/batch", params={"wait": 1.5}) for _ in range(20)]
    replies = await asyncio.gather(*polls)
    assert [r.json() for r in replies] == [{"batch": None}] * 20
    changes = wakeups.count - changes  # commits the store saw meanwhile (SQLite's checkpointer, say)
    # One try each when the poll arrives; then none while it waits (a try every 0.5 s each, before), but for
    # a change that landed while its first try was under way, which it cannot know it saw.
    assert ran[0] <= 20 * (1 + changes), (ran[0], changes)


async def test_each_change_wakes_a_waiter_and_a_batch_wakes_the_next(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=4)
    ran = count_transactions(client)
    polls = [asyncio.create_task(client.get("/batch", params={"wait": 60})) for _ in range(3)]
    service = client._transport.app.state.service  # type: ignore[attr-defined]
    while service.wakeups.waiting < 3:  # all three are waiting (polling the test's own view, not the store)
        await asyncio.sleep(0.01)
    for i in range(3):
        assert (await client.post("/scored_data", json=group(4, env_id=0, seed=i))).status_code == 200
    replies = await asyncio.gather(*polls)  # each ends with a batch long before its 60 s
    assert sorted(r.json()["batch"][0]["tokens"][0][0] for r in replies) == sorted(
        group(4, env_id=0, seed=i)["tokens"][0][0] for i in range(3)
    )
    # 3 first tries, 3 ingests, at most two tries per waiter after, and the drop-bias monitor's one read after a
    # formed batch (at most one a second: the `drop_bias_watch` job)
    assert ran[0] <= 3 + 3 + 3 * 2 + 1


async def test_polls_reaching_their_deadline_together_run_no_formation(client: httpx.AsyncClient) -> None:
    """A deadline wakes nobody: the changes a poll slept through woke another waiter. 2,000 polls expiring
    together once passed on a wake each, every woken one re-running a formation (~1,100 store transactions)."""
    await start(client, batch_size=64)
    service = client._transport.app.state.service  # type: ignore[attr-defined]
    n, wait = 100, 2.0
    while True:
        polls = [asyncio.create_task(client.get("/batch", params={"wait": wait})) for _ in range(n)]
        while service.wakeups.waiting < n and not any(p.done() for p in polls):
            await asyncio.sleep(0.01)  # polling interval, until all wait
        if service.wakeups.waiting == n:
            break
        await asyncio.gather(*polls)  # a loaded machine took them in slower than they waited: again, longer
        wait *= 2
    changes = service.wakeups.count
    # A change none of them can form a batch of 64 from: every waiter's last try is older than it.
    assert (await client.post("/scored_data", json=group(4, env_id=0))).status_code == 200
    ran = count_transactions(client)
    replies = await asyncio.gather(*polls)
    assert [r.json()["batch"] for r in replies] == [None] * n
    changes = service.wakeups.count - changes  # the group, and commits the store saw meanwhile (SQLite's echo)
    # The woken waiter's try per change (and its retry if another lands meanwhile); 50 of 100, before.
    assert ran[0] <= 2 * changes, (ran[0], changes)
