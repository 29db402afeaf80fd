"""The side buffer (groups of another size than their env's group_size) under its bounds: what it holds counts
against the queue limits and shows in every view, it holds at most so many groups and bytes per env, held
groups expire and are counted, and an env whose groups vary in size has them queued whole."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from api.config.settings import Settings
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient, **env_fields: Any) -> None:
    assert (await c.post("/register", json=registration(batch_size=8))).status_code == 200
    await c.get("/batch")
    reply = await c.post("/register-env", json=env("math", group_size=4, **env_fields))
    assert reply.json()["env_id"] == 0, reply.text


async def test_held_groups_show_in_every_view_and_are_bounded_per_env(settings: Settings) -> None:
    async with serving(settings, side_buffer_max_groups=3) as c:
        await start(c)
        for seed in range(3):  # groups of 3 never add up to 4
            r = await c.post("/scored_data", json=group(3, seed=seed))
            assert r.json() == {"status": "buffered", "buffer_size": 3 * (seed + 1)}
        refused = await c.post("/scored_data", json=group(3, seed=9))
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "env 0's side buffer" in refused.text and "side_buffer_max_groups" in refused.text
        assert (await c.post("/scored_data", json=group(4, seed=10))).json()["status"] == "received"  # whole: queued
        status = (await c.get("/status")).json()
        assert (status["queue_size"], status["held_groups"], status["held_sequences"]) == (1, 3, 9)
        assert status["held_tokens"] > 0 and status["held_bytes"] > 0
        [math] = (await c.get("/dashboard/data")).json()["envs"]
        assert (math["held_groups"], math["queue_groups"], math["backpressure"]) == (3, 1, 1)
        metrics = (await c.get("/metrics")).text
        assert 'rollbuf_side_buffer_groups{env="math_0"} 3.0' in metrics


async def test_held_groups_count_against_the_queue_limits(settings: Settings) -> None:
    async with serving(settings, max_queue_groups=3, max_env_queue_tokens=None) as c:
        await start(c)
        for seed in range(2):
            assert (await c.post("/scored_data", json=group(3, seed=seed))).json()["status"] == "buffered"
        assert (await c.post("/scored_data", json=group(4, seed=5))).status_code == 200
        full = await c.post("/scored_data", json=group(4, seed=6))
        assert full.status_code == 503 and "the queue holds 3 groups; the limit (max_queue_groups) is 3" in full.text
        env_status = (await c.get("/status-env", params={"env_id": 0})).json()
        assert env_status["queue_capacity_groups"] == 0 and env_status["self_queue_size"] == 1


async def test_a_half_group_completed_later_is_released_whole_and_served(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c)
        first = group(2, seed=1)
        assert (await c.post("/scored_data", json=first)).json() == {"status": "buffered", "buffer_size": 2}
        second = group(2, seed=2)
        assert (await c.post("/scored_data", json=second)).json() == {"status": "buffered", "buffer_size": 0}
        assert (await c.post("/scored_data", json=group(4, seed=3))).status_code == 200
        status = (await c.get("/status")).json()
        assert (status["queue_size"], status["held_groups"]) == (3, 0)
        batch = (await c.get("/batch")).json()["batch"]
        assert [g["tokens"] for g in batch[:2]] == [first["tokens"], second["tokens"]]  # oldest first


async def test_held_groups_expire_at_ingest_and_in_the_sweep_and_are_counted(settings: Settings) -> None:
    async with serving(settings, side_buffer_ttl_s=1e-6) as c:
        await start(c)
        assert (await c.post("/scored_data", json=group(3, seed=1))).json()["status"] == "buffered"
        # The next group to hold finds the first expired: dropped, not combined with it into a group of 4.
        assert (await c.post("/scored_data", json=group(1, seed=2))).json() == {"status": "buffered", "buffer_size": 1}
        # Nothing more arrives: the sweep (every second here) drops the last one on its own.
        status = await poll(c, lambda s: s["held_groups"] == 0)
        assert status["dropped"] == {"math_0": {"side_buffer_expired": 2}}
        metrics = (await c.get("/metrics")).text
        assert 'rollbuf_groups_dropped_total{env="math_0",reason="side_buffer_expired"} 2.0' in metrics


async def poll(c: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool], timeout: float = 15.0) -> dict[str, Any]:
    """/status until `done` holds (each call may start the sweep)."""
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = (await c.get("/status")).json()
        if done(status) or time.monotonic() > deadline:
            assert done(status), status
            return status
        await c.get("/batch", params={"wait": 0.2})


async def test_an_env_with_variable_group_sizes_has_each_group_queued_whole(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, variable_group_size=True)
        groups = [group(3, seed=1), group(4, seed=2), group(1, seed=3)]
        for g in groups:
            assert (await c.post("/scored_data", json=g)).json() == {"status": "received"}
        status = (await c.get("/status")).json()
        assert (status["queue_size"], status["held_groups"]) == (3, 0)
        batch = (await c.get("/batch")).json()["batch"]
        assert [g["tokens"] for g in batch] == [g["tokens"] for g in groups]  # as sent: never combined
