"""/batch beyond Atropos: exactly-once per step, rank shares, weights, staleness, filters, blocked reasons."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest

from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(client: httpx.AsyncClient, envs: list[dict[str, Any]], **reg: Any) -> None:
    await client.post("/register", json=registration(**reg))
    await client.get("/batch", params={"step": reg.get("starting_step", 0)})
    for e in envs:
        assert (await client.post("/register-env", json=e)).json()["status"] == "success"


def ids(batch: list[dict[str, Any]]) -> list[str]:
    return [g["group_id"] for g in batch]


async def test_step_is_served_again_until_next_is_asked(client: httpx.AsyncClient) -> None:
    await start(client, [env(group_size=4)], batch_size=8, starting_step=5)
    await client.post("/scored_data_list", json=[group(4, seed=i, group_id=f"g{i}") for i in range(6)])
    first = (await client.get("/batch", params={"step": 5})).json()
    again = (await client.get("/batch", params={"step": 5})).json()
    assert ids(first["batch"]) == ids(again["batch"]) == ["g0", "g1"]
    assert (await client.get("/status")).json()["current_step"] == 6
    second = (await client.get("/batch", params={"step": 6})).json()
    assert ids(second["batch"]) == ["g2", "g3"]
    r = await client.get("/batch", params={"step": 5})
    assert r.status_code == 410 and "no longer available" in r.json()["detail"]
    r = await client.get("/batch", params={"step": 9})
    assert r.status_code == 409 and "next batch to form is 7" in r.json()["detail"]


async def test_rank_shares_cover_the_batch_once(client: httpx.AsyncClient) -> None:
    await start(client, [env(group_size=4)], batch_size=16)
    lengths = [[8, 8, 8, 8], [100, 100, 100, 100], [20, 20, 20, 20], [50, 50, 50, 50]]
    groups = [group(4, length=ls, seed=i, group_id=f"g{i}") for i, ls in enumerate(lengths)]
    await client.post("/scored_data_list", json=groups)
    whole = (await client.get("/batch", params={"step": 0})).json()["batch"]
    seen: Counter[tuple[int, ...]] = Counter()
    loads = []
    for rank in range(3):
        share = (await client.get("/batch", params={"step": 0, "rank": rank, "world_size": 3})).json()
        assert share["step"] == 0
        loads.append(sum(len(t) for g in share["batch"] for t in g["tokens"]))
        for g in share["batch"]:
            for t in g["tokens"]:
                seen[tuple(t)] += 1
    assert sorted(seen.values()) == [1] * 16
    assert set(seen) == {tuple(t) for g in whole for t in g["tokens"]}
    assert max(loads) <= 1.25 * sum(loads) / 3
    r = await client.get("/batch", params={"step": 0, "rank": 3, "world_size": 3})
    assert r.status_code == 422


async def test_weights_decide_the_mix(client: httpx.AsyncClient) -> None:
    await start(client, [env("a", 4, weight=3.0), env("b", 4, weight=1.0)], batch_size=16)
    for env_id in (0, 1):
        await client.post("/scored_data_list", json=[group(4, env_id=env_id, seed=i) for i in range(40)])
    served: Counter[int] = Counter()
    for step in range(8):
        batch = (await client.get("/batch", params={"step": step})).json()["batch"]
        served.update(g["env_id"] for g in batch)
    assert served[0] == 3 * served[1]


async def test_min_allocation_without_data_reports_a_reason(client: httpx.AsyncClient) -> None:
    await start(client, [env("a", 4), env("b", 4, min_batch_allocation=0.5)], batch_size=8)
    await client.post("/scored_data_list", json=[group(4, env_id=0, seed=i) for i in range(4)])
    r = (await client.get("/batch")).json()
    assert r["batch"] is None
    assert "min_batch_allocation" in r["blocked_reason"]
    assert "env 'b_0'" in (await client.get("/status")).json()["blocked_reason"]
    await client.post("/disconnect-env", json={"env_id": 1})
    assert len((await client.get("/batch")).json()["batch"]) == 2
    assert (await client.get("/status")).json()["blocked_reason"] is None


async def test_group_size_that_cannot_fill_is_warned_or_refused(client: httpx.AsyncClient) -> None:
    await start(client, [], batch_size=16)
    r = (await client.post("/register-env", json=env(group_size=3))).json()
    assert r["status"] == "success" and "does not divide batch_size 16" in r["warning"]
    r2 = await client.post("/register-env", json=env(group_size=32))
    assert r2.status_code == 422 and r2.json()["detail"][0]["loc"] == ["body", "group_size"]


async def test_stale_groups_are_dropped_and_counted(client: httpx.AsyncClient) -> None:
    await start(client, [env(group_size=4)], batch_size=4, max_staleness=1, starting_step=10)
    await client.post("/scored_data_list", json=[group(4, policy_step=s, group_id=f"s{s}") for s in (3, 9, 10)])
    batch = (await client.get("/batch", params={"step": 10})).json()["batch"]
    assert ids(batch) == ["s9"]
    status = (await client.get("/status")).json()
    assert status["dropped"] == {"math_0": {"stale": 1}} and status["queue_size"] == 1


async def test_filters_drop_and_count(client: httpx.AsyncClient) -> None:
    await start(client, [env(group_size=4)], batch_size=4, drop_zero_variance=True, min_score=0.0)
    await client.post(
        "/scored_data_list",
        json=[group(4, scores=[1.0] * 4), group(4, scores=[-1.0, -2.0, -1.0, -1.0]), group(4, group_id="ok")],
    )
    status = (await client.get("/status")).json()
    assert status["dropped"] == {"math_0": {"zero_variance": 1, "score_range": 1}}
    assert ids((await client.get("/batch")).json()["batch"]) == ["ok"]


async def test_conflicting_registration_is_409(client: httpx.AsyncClient) -> None:
    assert (await client.post("/register", json=registration())).status_code == 200
    assert (await client.post("/register", json=registration())).status_code == 200  # identical: fine
    r = await client.post("/register", json=registration(batch_size=64))
    assert r.status_code == 409 and "batch_size" in r.json()["detail"]


async def test_token_budget(client: httpx.AsyncClient) -> None:
    await start(client, [env(group_size=2)], batch_size=64, max_batch_tokens=100, min_batch_fill=0.8)
    await client.post("/scored_data_list", json=[group(2, length=20, seed=i) for i in range(5)])
    batch = (await client.get("/batch")).json()["batch"]
    assert sum(len(t) for g in batch for t in g["tokens"]) == 80


async def test_long_poll_returns_when_data_arrives(client: httpx.AsyncClient) -> None:
    import asyncio

    await start(client, [env(group_size=4)], batch_size=4)
    poll = asyncio.create_task(client.get("/batch", params={"wait": 30}))
    await asyncio.sleep(0)  # let the poll start waiting before data arrives
    assert not poll.done()
    await client.post("/scored_data", json=group(4, group_id="late"))
    r = await asyncio.wait_for(poll, timeout=30)
    assert ids(r.json()["batch"]) == ["late"]
