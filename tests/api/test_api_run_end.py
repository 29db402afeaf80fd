"""The end of a run fed by datasets, through the ASGI app on every store (docs/tasks.md, "The end of a dataset"):
several datasets, several epochs, a dataset beside a free env, and a trainer of exact batch sizes. Groups of 4
towards batches of 8 or 12 leave a tail short of a batch: it is served (or left out) only once nothing else can
arrive, then every dataset is done and `/batch` and `/status` say the run is finished."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from api.config.settings import Settings
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient, batch_size: int, variable: bool = False, **reg: Any) -> None:
    assert (await c.post("/register", json=registration(batch_size=batch_size, **reg))).status_code == 200
    await c.get("/batch")
    made = await c.post("/register-env", json=env(group_size=4, variable_group_size=variable))
    assert made.status_code == 200, made.text


async def dataset(c: httpx.AsyncClient, name: str, n: int, **spec: Any) -> None:
    made = await c.post("/tasks/datasets", json={"name": name, "tasks": [{"q": i} for i in range(n)], **spec})
    assert made.status_code == 200, made.text


_seed = iter(range(10_000))


async def produce(c: httpx.AsyncClient, name: str, n: int, sizes: tuple[int, ...] = ()) -> None:
    """Lease `n` tasks of dataset `name` and send each one's group under its lease: of 4, or of `sizes`."""
    reply = (await c.post("/tasks/lease", json={"dataset": name, "producer_id": "p", "n": n})).json()
    assert len(reply["leases"]) == n, reply
    for x, size in zip(reply["leases"], sizes or (4,) * n, strict=True):
        sent = await c.post("/scored_data", json=group(size, seed=next(_seed), group_id=x["token"]))
        assert sent.status_code == 200, sent.text


async def batch(c: httpx.AsyncClient) -> dict[str, Any]:
    return (await c.get("/batch")).json()  # type: ignore[no-any-return]


async def sizes(c: httpx.AsyncClient) -> list[int]:
    """The batches formed from here until none forms, by their sequences."""
    out = []
    while (got := (await batch(c))["batch"]) is not None:
        out.append(sum(len(g["tokens"]) for g in got))
    return out


async def views(c: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in (await c.get("/tasks")).json()}


async def test_two_datasets_end_together_with_a_last_smaller_batch(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, batch_size=8)
        await dataset(c, "a", 3)
        await dataset(c, "b", 2)
        await produce(c, "a", 3)
        assert await sizes(c) == [8], "a's tail (one group) waits: b may still send"
        last = await batch(c)
        assert last == {"batch": None}, last
        a = (await views(c))["a"]
        assert (a["counts"], a["done"]) == ({"trained": 2, "submitted": 1}, False)
        assert not (await c.get("/status")).json()["finished"]
        await produce(c, "b", 2)
        assert await sizes(c) == [8, 4], "once b is exhausted too, the tail is served as a last smaller batch"
        last = await batch(c)
        assert last == {"batch": None, "finished": True}, last
        status = (await c.get("/status")).json()
        assert status["finished"] and status["smaller_batches"] == 1 and status["queue_size"] == 0
        assert {d["name"]: (d["counts"], d["done"]) for d in status["tasks"]} == {
            "a": ({"trained": 3}, True),
            "b": ({"trained": 2}, True),
        }


async def test_two_epochs_end_once_the_last_epoch_is_out(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c, batch_size=12)
        await dataset(c, "d", 5, epochs=2)
        await produce(c, "d", 5)
        assert await sizes(c) == [12], "epoch 0's tail waits for epoch 1"
        await produce(c, "d", 5)
        assert await sizes(c) == [12, 12, 4]
        assert (await batch(c)).get("finished") is True
        rows = (await c.get("/tasks/rows", params={"dataset": "d"})).json()["tasks"]
        assert sorted((r["epoch"], r["index"], r["state"]) for r in rows) == [
            (e, i, "trained") for e in (0, 1) for i in range(5)
        ]
        assert (await views(c))["d"]["done"]


async def test_a_dataset_beside_a_free_env_ends_with_the_run_only_once_the_free_env_cannot_send(
    settings: Settings,
) -> None:
    async with serving(settings) as c:
        await start(c, batch_size=8)
        free = (await c.post("/register-env", json=env("free", group_size=4))).json()["env_id"]
        await dataset(c, "d", 3)
        await produce(c, "d", 3)
        assert await sizes(c) == [8], "the tail waits: the free env (no producer heartbeats for it) may send"
        assert (await views(c))["d"]["done"] is False
        assert (await c.post("/scored_data", json=group(4, env_id=free, seed=1))).status_code == 200
        assert await sizes(c) == [8], "the dataset's tail trains beside the free env's group"
        assert (await views(c))["d"]["done"], "every task trained: the dataset is done"
        assert (await c.post("/scored_data", json=group(4, env_id=free, seed=2))).status_code == 200
        last = await batch(c)
        assert last == {"batch": None} and not (await c.get("/status")).json()["finished"], "the run goes on"
        assert (await c.post("/disconnect-env", json={"env_id": free})).status_code == 200
        assert await sizes(c) == [4], "nothing else can arrive: what is queued is served"
        assert (await batch(c)).get("finished") is True
        assert (await c.get("/status")).json()["finished"]


async def test_a_trainer_of_exact_batch_sizes_leaves_a_partial_group_out_as_the_tail(settings: Settings) -> None:
    """Under "wait" a group sealed below G (3 of 4, queued whole: `variable_group_size`) makes no exact batch of 8:
    at the end it is left out, said so, and its task dropped, not retried; the dataset is done all the same."""
    async with serving(settings) as c:
        await start(c, batch_size=8, variable=True, no_exact_fill="wait")
        await dataset(c, "d", 3, max_retries=2)
        await produce(c, "d", 3, sizes=(4, 3, 4))
        assert await sizes(c) == [8]
        last = await batch(c)
        assert last["batch"] is None and last["finished"] is True, last
        assert "the run's tail: 1 queued group (3 sequences, sizes [3])" in last["blocked_reason"], last
        assert "no_exact_fill is 'wait'" in last["blocked_reason"], last
        status = (await c.get("/status")).json()
        assert status["finished"] and "run_tail" in status["blocked_reason"], status
        assert [r.get("run_tail") for r in status["dropped"].values()] == [1], status["dropped"]
        [view] = status["tasks"]
        assert (view["counts"], view["done"]) == ({"trained": 2, "dropped": 1}, True), "not retried"
        rows = (await c.get("/tasks/rows", params={"dataset": "d"})).json()["tasks"]
        assert [(r["reason"], r["retries"]) for r in rows if r["state"] == "dropped"] == [("run_tail", 0)]
        again = await batch(c)
        assert again["finished"] is True and "run_tail" in (await c.get("/status")).json()["blocked_reason"]
