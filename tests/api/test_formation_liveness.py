"""Batches form whenever any choice could: survivor groups behind the window, no exact fill at all, and minimum
shares of envs that go quiet. Every store."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from api.app import create_app
from api.config.settings import Settings
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


@pytest.fixture
async def quick(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app with a quiet minimum share released after 0.3 s, and keys for an env, a trainer and an admin."""
    keys = "runner env runner-secret-0123456789; trainer trainer trainer-secret-012345"
    app = create_app(settings.model_copy(update={"quiet_share_seconds": 0.3, "api_keys": SecretStr(keys)}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c


RUNNER = {"Authorization": "Bearer runner-secret-0123456789"}
TRAINER = {"Authorization": "Bearer trainer-secret-012345"}


async def start(
    client: httpx.AsyncClient, envs: list[dict[str, Any]], headers: dict[str, str] | None = None, **reg: Any
) -> None:
    await client.post("/register", json=registration(**reg), headers=TRAINER if headers else None)
    await client.get("/batch", params={"step": 0}, headers=TRAINER if headers else None)
    for e in envs:
        assert (await client.post("/register-env", json=e, headers=headers)).json()["status"] == "success"


def survivor(size: int, i: int) -> dict[str, Any]:
    return group(size, length=4, seed=i, group_id=f"g{i}", logprobs=False)


async def drain(client: httpx.AsyncClient, start: int = 0) -> list[list[dict[str, Any]]]:
    batches = []
    for step in range(start, start + 1000):
        body = (await client.get("/batch", params={"step": step})).json()
        if body["batch"] is None:
            return batches
        batches.append(body["batch"])
    raise AssertionError("never drained")


@pytest.mark.parametrize("crash", [0.02, 0.10])
async def test_survivor_groups_all_train_in_exact_mode(client: httpx.AsyncClient, crash: float) -> None:
    """G=64, each rollout crashing with probability `crash`, groups of at least 48 kept (min_group_size), batch 256:
    every kept group is trained, in batches of exactly 256 whenever a choice adds up, else (no_exact_fill
    "smaller", the default) the fullest batch under it."""
    await start(client, [env(group_size=64, variable_group_size=True)], batch_size=256, max_token_len=64)
    rng = np.random.default_rng(int(crash * 100))
    sizes = [int(s) for s in 64 - rng.binomial(64, crash, 48) if s >= 48]
    reply = await client.post("/scored_data_list", json=[survivor(s, i) for i, s in enumerate(sizes)])
    assert reply.status_code == 200, reply.text
    batches = await drain(client)
    left = (await client.get("/status")).json()["queued_sequences"]
    assert left == sum(sizes) - sum(len(g["tokens"]) for b in batches for g in b) < 256, "stopped too early"
    for k in range(30):  # the run goes on: whole groups keep coming, and the odd ones left are served with them
        served = {g["group_id"] for b in batches for g in b}
        if served >= {f"g{i}" for i in range(len(sizes))}:
            break
        await client.post("/scored_data_list", json=[survivor(64, 1000 + 4 * k + j) for j in range(4)])
        batches += await drain(client, start=len(batches))
    served_list = [g["group_id"] for b in batches for g in b]
    assert len(served_list) == len(set(served_list)), "a group served twice"
    assert set(served_list) >= {f"g{i}" for i in range(len(sizes))}, "a kept group never trained"
    assert all(sum(len(g["tokens"]) for g in b) <= 256 for b in batches)
    exact = sum(sum(len(g["tokens"]) for g in b) == 256 for b in batches)
    assert (await client.get("/status")).json()["smaller_batches"] == len(batches) - exact
    assert exact > 0


@pytest.mark.parametrize("crash", [0.02, 0.10])
async def test_survivor_groups_all_train_in_token_budget_mode(client: httpx.AsyncClient, crash: float) -> None:
    """The same survivors under a token budget (`max_batch_tokens`): taken as they are, every kept group trains,
    each batch within both budgets; only a remainder under `min_batch_fill` waits for the next groups."""
    await start(
        client, [env(group_size=64, variable_group_size=True)], batch_size=256, max_token_len=64, max_batch_tokens=1024
    )
    rng = np.random.default_rng(7 + int(crash * 100))
    sizes = [int(s) for s in 64 - rng.binomial(64, crash, 48) if s >= 48]
    reply = await client.post("/scored_data_list", json=[survivor(s, i) for i, s in enumerate(sizes)])
    assert reply.status_code == 200, reply.text
    batches = await drain(client)
    for k in range(30):  # whole groups keep coming: the remainder is served with them
        if {g["group_id"] for b in batches for g in b} >= {f"g{i}" for i in range(len(sizes))}:
            break
        await client.post("/scored_data_list", json=[survivor(64, 1000 + 4 * k + j) for j in range(4)])
        batches += await drain(client, start=len(batches))
    served = [g["group_id"] for b in batches for g in b]
    assert len(served) == len(set(served)), "a group served twice"
    assert set(served) >= {f"g{i}" for i in range(len(sizes))}, "a kept group never trained"
    for b in batches:
        assert sum(len(g["tokens"]) for g in b) <= 256
        assert sum(len(t) for g in b for t in g["tokens"]) <= 1024


async def test_odd_groups_ahead_of_whole_ones_do_not_stop_the_run(client: httpx.AsyncClient) -> None:
    """The issue's queue, under "wait": five odd groups fill the window; the four 64s behind them form a batch."""
    await start(
        client, [env(group_size=64, variable_group_size=True)], batch_size=256, max_token_len=64, no_exact_fill="wait"
    )
    for i, s in enumerate([59, 60, 61, 62, 63, 64, 64, 64, 64]):
        await client.post("/scored_data", json=survivor(s, i))
    body = (await client.get("/batch", params={"step": 0})).json()
    assert [g["group_id"] for g in body["batch"]] == ["g5", "g6", "g7", "g8"]
    assert (await client.get("/status")).json()["passed_over"] == {"math_0": 1}


async def test_no_exact_fill_at_all_is_said_or_served_smaller(client: httpx.AsyncClient) -> None:
    await start(
        client, [env(group_size=64, variable_group_size=True)], batch_size=256, max_token_len=64, no_exact_fill="wait"
    )
    for i in range(5):
        await client.post("/scored_data", json=survivor(63, i))
    body = (await client.get("/batch", params={"step": 0})).json()
    reason = "no choice of the 5 queued groups (sizes [63]) adds up to exactly batch_size 256"
    assert body["batch"] is None and reason in body["blocked_reason"] and "no_exact_fill" in body["blocked_reason"]
    assert reason in (await client.get("/status")).json()["blocked_reason"]


async def test_a_quiet_minimum_share_holds_batches_at_most_the_setting_and_a_trainer_disconnects_it(
    quick: httpx.AsyncClient,
) -> None:
    await start(quick, [env("math"), env("squatter", min_batch_allocation=1.0)], headers=RUNNER, batch_size=8)
    await quick.post("/scored_data_list", json=[group(4, seed=i, group_id=f"g{i}") for i in range(4)], headers=RUNNER)
    first = (await quick.get("/batch", params={"step": 0}, headers=TRAINER)).json()
    assert first["batch"] is None and "'squatter_0'" in first["blocked_reason"]
    # the long poll forms again when the hold runs out (0.3 s), though no data changed
    body = (await quick.get("/batch", params={"step": 0, "wait": 10}, headers=TRAINER)).json()
    assert body["batch"] is not None
    status = (await quick.get("/status", headers=TRAINER)).json()
    assert status["min_share_releases"] == {"squatter_0": 1} and status["blocked_reason"] is None
    metrics = (await quick.get("/metrics", headers=TRAINER)).text
    assert 'rollbuf_min_share_releases_total{env="squatter_0"} 1.0' in metrics
    # the trainer's key may disconnect any env (an env key only its own)
    reply = await quick.post("/disconnect-env", json={"env_id": 1}, headers=TRAINER)
    assert reply.status_code == 200 and reply.json()["status"] == "success", reply.text
    envs = {e["name"]: e["connected"] for e in (await quick.get("/dashboard/data", headers=TRAINER)).json()["envs"]}
    assert envs["squatter_0"] is False


async def test_a_quiet_minimum_share_s_hold_is_shown_while_it_lasts_and_its_release_logged_once(
    quick: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """While the squatter's minimum holds a batch back, /status `min_share_holds`, the dashboard's data and
    `rollbuf_batch_blocked_seconds` show it; its release is logged once for the episode, however many batches
    form without it after."""
    await start(quick, [env("math"), env("squatter", min_batch_allocation=1.0)], headers=RUNNER, batch_size=8)
    await quick.post("/scored_data_list", json=[group(4, seed=i, group_id=f"g{i}") for i in range(8)], headers=RUNNER)
    assert (await quick.get("/batch", params={"step": 0}, headers=TRAINER)).json()["batch"] is None
    status = (await quick.get("/status", headers=TRAINER)).json()
    assert list(status["min_share_holds"]) == ["squatter_0"] and status["min_share_holds"]["squatter_0"] >= 0
    metrics = (await quick.get("/metrics", headers=TRAINER)).text
    assert 'rollbuf_batch_blocked_seconds{env="squatter_0"}' in metrics
    envs = {e["name"]: e for e in (await quick.get("/dashboard/data", headers=TRAINER)).json()["envs"]}
    assert "holding_seconds" in envs["squatter_0"] and envs["math_0"]["holding_seconds"] == 0
    with caplog.at_level(logging.WARNING):
        for step in range(2):  # released once the hold runs out (0.3 s); the next batch forms without it too
            body = (await quick.get("/batch", params={"step": step, "wait": 10}, headers=TRAINER)).json()
            assert body["batch"] is not None
    released = [r for r in caplog.records if "its minimum no longer holds them" in r.getMessage()]
    assert len(released) == 1 and "'squatter_0'" in released[0].getMessage()
    assert (await quick.get("/status", headers=TRAINER)).json()["min_share_releases"] == {"squatter_0": 1}


async def test_token_mode_names_a_minimum_share_and_its_stale_drops_as_what_blocks(client: httpx.AsyncClient) -> None:
    """Token budget 1,000, batch_size 64: math queues a full token budget in 12 sequences, and code (minimum 0.25)
    queues only groups too stale to train. The reply and /status name code's minimum and its stale drops (it was
    reported as waiting for data: fewer than batch_size sequences were queued)."""
    await start(
        client,
        [env("math"), env("code", min_batch_allocation=0.25)],
        batch_size=64,
        max_batch_tokens=1000,
        max_staleness=0,
    )
    math = [group(4, length=100, seed=i, env_id=0) for i in range(3)]
    code = [group(4, length=10, seed=10 + i, env_id=1) for i in range(4)]
    assert (await client.post("/scored_data_list", json=math + code)).status_code == 200
    assert (await client.get("/batch", params={"step": 0})).json()["batch"] is not None  # step 0 -> 1
    math = [group(4, length=100, seed=20 + i, env_id=0) for i in range(3)]
    stale = [group(4, length=10, seed=30 + i, env_id=1, policy_step=0) for i in range(2)]
    assert (await client.post("/scored_data_list", json=math + stale)).status_code == 200
    body = (await client.get("/batch", params={"step": 1})).json()
    reason = "env 'code_0' has 0 sequences queued (2 stale groups dropped just now)"
    assert body["batch"] is None and reason in body["blocked_reason"], body
    assert reason in (await client.get("/status")).json()["blocked_reason"]


async def test_a_run_whose_producers_stop_trains_what_is_queued(settings: Settings) -> None:
    """Groups of 6 and 8 towards 64 with no exact fill queued: formation waits for arrivals that could complete one,
    but only `formation_arrival_wait_seconds` with nothing arriving; then "smaller" serves the fullest batch under
    64, so a run whose producers stopped does not leave up to two batches' worth queued for good."""
    app = create_app(settings.model_copy(update={"formation_arrival_wait_seconds": 0.3}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            await start(client, [env(group_size=8, variable_group_size=True)], batch_size=64, max_token_len=64)
            sizes = [6] * 7 + [8] * 3  # 66 sequences: no choice adds up to 64, one more 6 or 8 could
            reply = await client.post("/scored_data_list", json=[survivor(s, i) for i, s in enumerate(sizes)])
            assert reply.status_code == 200, reply.text
            first = (await client.get("/batch", params={"step": 0})).json()
            assert first["batch"] is None, first  # waiting for arrivals, not a stall: nothing else says so
            body = (await client.get("/batch", params={"step": 0, "wait": 10})).json()  # the long-poll rechecks
            assert body["batch"] is not None, body
            assert sum(len(g["tokens"]) for g in body["batch"]) == 60
            status = (await client.get("/status")).json()
            assert status["queued_sequences"] == 6 and status["smaller_batches"] == 1, status
