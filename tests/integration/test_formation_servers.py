"""Batch formation through real server processes on the stores that persist (SQLite, PostgreSQL): survivor groups all
train in exact mode and in token-budget mode, and a squatter env's minimum share holds batches back at most
`quiet_share_seconds`, then a trainer key disconnects it. Groups are posted directly (no runner), so each store
costs a server start or two."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests import pg
from tests.factories import env, group, registration
from tests.servers import running_server

RUNNER = "runner-secret-0123456789"
TRAINER = "trainer-secret-012345"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rollbuf.db'}"
    else:
        with pg.database() as name:
            yield pg.url_of(name)


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def survivor(size: int, i: int) -> dict[str, Any]:
    return group(size, length=4, seed=i, group_id=f"g{i}", logprobs=False)


def drain(c: httpx.Client, start: int) -> list[list[dict[str, Any]]]:
    batches = []
    for step in range(start, start + 1000):
        body = c.get("/batch", params={"step": step}).json()
        if body["batch"] is None:
            return batches
        batches.append(body["batch"])
    raise AssertionError("never drained")


@pytest.mark.parametrize("mode", ["exact", "token_budget", "trim"])
def test_survivor_groups_all_train(store: str, mode: str, tmp_path: Path) -> None:
    """G=64 with crashed rollouts left out (groups of 59-64), batch 256: in exact mode with its default
    no_exact_fill ("smaller") or with "trim" (every batch exactly 256, what is cut counted), and in token-budget
    mode (1024 tokens, 4 a sequence), every kept group is trained, each batch within its budgets, while whole
    groups keep coming for what is left."""
    budget: dict[str, Any] = {"max_batch_tokens": 1024} if mode == "token_budget" else {}
    if mode == "trim":
        budget["no_exact_fill"] = "trim"
    with running_server(store, tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        assert c.post("/register", json=registration(batch_size=256, max_token_len=64, **budget)).status_code == 200
        c.get("/batch", params={"step": 0})
        assert c.post("/register-env", json=env(group_size=64, variable_group_size=True)).status_code == 200
        rng = np.random.default_rng(33)
        sizes = [int(s) for s in np.clip(64 - rng.binomial(64, 0.04, 28), 59, 64)]
        assert c.post("/scored_data_list", json=[survivor(s, i) for i, s in enumerate(sizes)]).status_code == 200
        batches = drain(c, 0)
        assert c.get("/status").json()["queued_sequences"] < 256, "stopped while a batch could form"
        kept = {f"g{i}" for i in range(len(sizes))}
        for k in range(30):  # whole groups keep coming; the odd ones left are served with them
            if {g["group_id"] for b in batches for g in b} >= kept:
                break
            whole = [survivor(64, 1000 + 4 * k + j) for j in range(4)]
            assert c.post("/scored_data_list", json=whole).status_code == 200
            batches += drain(c, len(batches))
        served = [g["group_id"] for b in batches for g in b]
        assert len(served) == len(set(served)), "a group served twice"
        assert set(served) >= kept, "a kept group never trained"
        assert all(sum(len(g["tokens"]) for g in b) <= 256 for b in batches)
        assert all(sum(len(t) for g in b for t in g["tokens"]) <= 1024 for b in batches)
        if mode == "exact":
            assert any(sum(len(g["tokens"]) for g in b) == 256 for b in batches)
        if mode == "trim":
            assert all(sum(len(g["tokens"]) for g in b) == 256 for b in batches)
            size = {f"g{i}": s for i, s in enumerate(sizes)}
            cut = sum(size.get(g["group_id"], 64) - len(g["tokens"]) for b in batches for g in b)
            assert c.get("/status").json()["trimmed_sequences"] == {"math_0": cut} and cut > 0


def test_a_squatter_holds_batches_at_most_the_setting_and_a_trainer_key_disconnects_it(
    store: str, tmp_path: Path
) -> None:
    """An env key registers "squatter" with min_batch_allocation 1.0 and sends nothing: the trainer's long poll gets
    a batch once `quiet_share_seconds` (0.5 s here) runs out, with no data changed (its `wait` of 60 s bounds the
    hold from above without timing it); once the squatter queues its share and goes quiet again, the trainer's key
    disconnects it and the next batch forms at once."""
    keys = tmp_path / "keys"
    keys.write_text(f"runner env {RUNNER}\ntrainer trainer {TRAINER}\n")
    flags = ("--api-keys-file", str(keys), "--quiet-share-seconds", "0.5")
    with running_server(store, tmp_path / "server.log", *flags) as server, httpx.Client(base_url=server.url) as c:
        trainer, runner = auth(TRAINER), auth(RUNNER)
        assert c.post("/register", json=registration(batch_size=8), headers=trainer).status_code == 200
        c.get("/batch", params={"step": 0}, headers=trainer)
        for e in (env("math"), env("squatter", min_batch_allocation=1.0)):
            assert c.post("/register-env", json=e, headers=runner).json()["status"] == "success"
        math = [group(4, seed=i, group_id=f"m{i}", env_id=0) for i in range(6)]
        assert c.post("/scored_data_list", json=math, headers=runner).status_code == 200
        first = c.get("/batch", params={"step": 0}, headers=trainer).json()
        assert first["batch"] is None and "'squatter_0'" in first["blocked_reason"]
        held = c.get("/batch", params={"step": 0, "wait": 60}, headers=trainer, timeout=90).json()
        assert held["batch"] is not None, "the squatter held batches back past the long poll"
        status = c.get("/status", headers=trainer).json()
        assert status["min_share_releases"] == {"squatter_0": 1} and status["blocked_reason"] is None
        # Live again (its share queued: the episode ends), then short of it: it holds again, until the trainer's
        # key disconnects it.
        mine = [group(4, seed=10 + i, group_id=f"s{i}", env_id=1) for i in range(2)]
        assert c.post("/scored_data_list", json=mine, headers=runner).status_code == 200
        assert c.get("/batch", params={"step": 1}, headers=trainer).json()["batch"] is not None
        again = c.get("/batch", params={"step": 2}, headers=trainer).json()
        assert again["batch"] is None and "'squatter_0'" in again["blocked_reason"]
        reply = c.post("/disconnect-env", json={"env_id": 1}, headers=trainer)
        assert reply.status_code == 200 and reply.json()["status"] == "success", reply.text
        assert c.get("/batch", params={"step": 2}, headers=trainer).json()["batch"] is not None
        assert c.get("/status", headers=trainer).json()["min_share_releases"] == {"squatter_0": 1}
