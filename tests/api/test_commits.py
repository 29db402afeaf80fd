"""The commit protocol: a trainer registered with `acknowledge: "commit"` reads ahead and acknowledges with
POST /commit; batches from its last commit on are served again byte for byte, within a read-ahead bound that
answers 503 (and wakes on a commit); a trainer in the default mode (Atropos's) sees today's behaviour."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from api.config.settings import Settings
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

MSGPACK = {"Accept": "application/msgpack"}


async def start(c: httpx.AsyncClient, groups: int, **reg: Any) -> None:
    """A run of batches of one group of 4 (so batch N holds group N), `groups` of them queued."""
    assert (await c.post("/register", json=registration(batch_size=4, **reg))).status_code == 200
    await c.get("/batch", params={"step": reg.get("starting_step", 0)})
    assert (await c.post("/register-env", json=env(group_size=4))).status_code == 200
    for seed in range(groups):
        assert (await c.post("/scored_data", json=group(4, seed=seed, group_id=f"g{seed}"))).status_code == 200


async def batch(c: httpx.AsyncClient, step: int, **params: Any) -> httpx.Response:
    return await c.get("/batch", params={"step": step, **params}, headers=MSGPACK)


async def test_read_ahead_batches_are_served_again_byte_for_byte_until_committed(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, 6, acknowledge="commit")
        first = [(await batch(c, step)).content for step in range(4)]  # four read ahead, none committed
        assert all(first)
        again = [(await batch(c, step)).content for step in range(4)]
        assert again == first
        status = (await c.get("/status")).json()
        assert (status["current_step"], status["committed_step"], status["kept_batches"]) == (4, 0, 4)
        assert status["kept_bytes"] >= sum(len(b) for b in first) - 64
        reply = await c.post("/commit", json={"step": 2})
        assert reply.json() == {
            "committed_step": 2,
            "next_step": 4,
            "kept_batches": 2,
            "kept_bytes": reply.json()["kept_bytes"],
        }
        gone = await batch(c, 1)
        assert gone.status_code == 410 and "every batch before 2 was committed" in gone.text
        assert (await batch(c, 2)).content == first[2] and (await batch(c, 3)).content == first[3]
        assert (await c.post("/commit", json={"step": 1})).json()["committed_step"] == 2  # late or retried: no-op
        ahead = await c.post("/commit", json={"step": 5})
        assert ahead.status_code == 409 and ahead.json()["errors"][0]["loc"] == ["body", "step"]
        metrics = (await c.get("/metrics")).text
        assert "rollbuf_committed_step 2.0" in metrics and "rollbuf_kept_batches 2.0" in metrics


async def test_the_read_ahead_bound_answers_503_and_a_commit_ends_it(settings: Settings) -> None:
    async with serving(settings, max_read_ahead_batches=2) as c:
        await start(c, 5, acknowledge="commit")
        assert (await batch(c, 0)).status_code == (await batch(c, 1)).status_code == 200
        full = await batch(c, 2)
        assert full.status_code == 503 and full.headers["Retry-After"] == "2"
        assert full.json()["code"] == "read_ahead_full" and "max_read_ahead_batches" in full.text
        status = (await c.get("/status")).json()
        assert status["queue_size"] == 3  # nothing taken
        assert "read-ahead bound" in status["blocked_reason"]  # /status says what holds batches back (#33)
        waiting = asyncio.create_task(batch(c, 2, wait=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # long-polling at the bound
        await c.post("/commit", json={"step": 1})
        reply = await asyncio.wait_for(waiting, 10)  # the commit woke it
        assert reply.status_code == 200 and reply.headers["X-Rollbuf-Step"] == "2"
        assert (await c.get("/status")).json()["blocked_reason"] is None


async def test_without_commit_mode_asking_for_the_next_batch_acknowledges_as_before(settings: Settings) -> None:
    async with serving(settings, max_read_ahead_batches=1) as c:
        await start(c, 4)  # acknowledge: "next", the default
        b0 = (await batch(c, 0)).content
        assert (await batch(c, 0)).content == b0
        for step in (1, 2, 3):  # no read-ahead bound in this mode
            assert (await batch(c, step)).status_code == 200
        gone = await batch(c, 1)
        assert gone.status_code == 410 and "a later batch was asked for" in gone.text
        status = (await c.get("/status")).json()
        assert (status["committed_step"], status["kept_batches"]) == (3, 1)
        assert (await c.get("/batch")).json()["batch"] is None  # Atropos's call: no step, nothing kept


async def test_a_resumed_trainer_starts_from_its_checkpoint_and_data_parallel_ranks_share_a_commit(
    settings: Settings,
) -> None:
    async with serving(settings) as c:
        await start(c, 6, acknowledge="commit", starting_step=100)
        shares = {}
        for step in (100, 101, 102):
            for rank in (0, 1):
                r = await batch(c, step, rank=rank, world_size=2)
                shares[step, rank] = r.content
        await c.post("/commit", json={"step": 101})  # rank 0, after the checkpoint barrier
        # Rank 1 restarts from the checkpoint: the steps after it are served again, each rank its own share.
        for step in (101, 102):
            for rank in (0, 1):
                assert (await batch(c, step, rank=rank, world_size=2)).content == shares[step, rank]
        assert (await batch(c, 100, rank=1, world_size=2)).status_code == 410
        assert (await c.post("/commit", json={"step": 103})).json()["kept_batches"] == 0


async def test_atropos_style_polling_in_commit_mode_keeps_every_batch(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, 2, acknowledge="commit")
        first = (await c.get("/batch", headers=MSGPACK)).content
        assert (await batch(c, 0)).content == first  # formed without ?step=, kept all the same
        assert (await c.get("/status")).json()["kept_batches"] == 1


async def test_commit_needs_a_registered_trainer(settings: Settings) -> None:
    async with serving(settings) as c:
        reply = await c.post("/commit", json={"step": 0})
        assert reply.status_code == 409 and "POST /register first" in reply.text
