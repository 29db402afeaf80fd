"""`no_exact_fill: "trim"`: survivor groups served in batches of exactly batch_size, the newest
group taken cut to its first sequences, every per-sequence field cut alike in JSON and msgpack, served again from
the store as first served, and the cut sequences counted as left out. Every store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.wire.records import MSGPACK, decode_batch
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

ACCEPT = {"Accept": MSGPACK}


@pytest.fixture
async def now(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app with no wait for arrivals that could complete an exact fill: the policy applies at once."""
    app = create_app(settings.model_copy(update={"formation_arrival_wait_seconds": 0.0}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c


def survivor(size: int, i: int) -> dict[str, Any]:
    """A group with every per-sequence field: sequences of mixed lengths, floats, messages and overrides."""
    rng = np.random.default_rng(i)
    lengths = [int(n) for n in rng.integers(3, 7, size)]
    body = group(size, length=lengths, seed=i, group_id=f"g{i}")
    body["advantages"] = [[float(k) / 4 for k in range(n)] for n in lengths]
    body["ref_logprobs"] = [[-0.5] * n for n in lengths]
    body["messages"] = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{k}"}] for k in range(size)
    ]
    body["overrides"] = [{"seq": k} for k in range(size)]
    body["scores"] = [float(k % 3) for k in range(size)]
    return body


PER_SEQ = ("tokens", "masks", "scores", "advantages", "ref_logprobs", "inference_logprobs", "messages", "overrides")
PER_TOKEN = ("masks", "advantages", "ref_logprobs", "inference_logprobs")


def check_json(served: dict[str, Any], sent: dict[str, Any]) -> int:
    """A served group is its sent group's first sequences, every per-sequence field alike; returns how many."""
    n = len(served["tokens"])
    assert 1 <= n <= len(sent["tokens"])
    for name in PER_SEQ:
        assert len(served[name]) == n, name
        assert served[name] == sent[name][:n], name
    for name in PER_TOKEN:
        assert [len(row) for row in served[name]] == [len(row) for row in served["tokens"]], name
    return n


def check_binary(records: list[Any], batch: list[dict[str, Any]]) -> None:
    """The msgpack batch holds what the JSON one does: the same groups, cut alike."""
    assert [r.group_id for r in records] == [g["group_id"] for g in batch]
    for rec, g in zip(records, batch, strict=True):
        assert [t.tolist() for t in rec.split(rec.tokens)] == g["tokens"]
        assert [m.tolist() for m in rec.split(rec.masks)] == g["masks"]
        assert rec.scores.tolist() == g["scores"]
        for name in ("advantages", "ref_logprobs", "inference_logprobs"):
            assert [len(a) for a in rec.split(rec.floats[name])] == [len(t) for t in g["tokens"]], name
        assert rec.meta["messages"] == g["messages"] and rec.meta["overrides"] == g["overrides"]


async def serve_all(
    client: httpx.AsyncClient, sent: dict[str, dict[str, Any]], first: int = 0
) -> tuple[list[list[Any]], int]:
    """Every batch that forms from step `first`, each read as JSON, then again (kept, from the store) as JSON and
    as msgpack; and the sequences cut off."""
    batches: list[list[Any]] = []
    trimmed = 0
    for step in range(first, first + 100):
        body = (await client.get("/batch", params={"step": step})).json()
        if body["batch"] is None:
            return batches, trimmed
        batch = body["batch"]
        kept = [check_json(g, sent[g["group_id"]]) for g in batch]
        assert sum(kept) == 256, "not exactly batch_size"
        trimmed += sum(len(sent[g["group_id"]]["tokens"]) for g in batch) - 256
        again = (await client.get("/batch", params={"step": step})).json()["batch"]
        assert again == batch, "a kept batch served again differs"
        reply = await client.get("/batch", params={"step": step}, headers=ACCEPT)
        assert reply.status_code == 200 and reply.headers["content-type"] == MSGPACK
        check_binary(decode_batch(reply.content), batch)
        shares = [
            (await client.get("/batch", params={"step": step, "rank": r, "world_size": 2})).json()["batch"]
            for r in range(2)
        ]
        assert sum(len(g["tokens"]) for share in shares for g in share) == 256, "rank shares do not cover the cut"
        batches.append(batch)
    raise AssertionError("never drained")


async def start(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=256, max_token_len=64, no_exact_fill="trim"))
    await client.get("/batch", params={"step": 0})
    reply = await client.post("/register-env", json=env(group_size=64, variable_group_size=True))
    assert reply.json()["status"] == "success"


@pytest.mark.parametrize("sizes", [[59, 60, 61, 62, 63, 64] * 4 + [61, 59, 64], [63] * 9], ids=["59-64", "63s"])
async def test_survivor_groups_are_served_trimmed_to_exactly_batch_size(
    now: httpx.AsyncClient, sizes: list[int]
) -> None:
    await start(now)
    sent = {f"g{i}": survivor(s, i) for i, s in enumerate(sizes)}
    reply = await now.post("/scored_data_list", json=list(sent.values()))
    assert reply.status_code == 200, reply.text
    batches, trimmed = await serve_all(now, sent)
    assert batches, "no batch formed"
    served = [g["group_id"] for b in batches for g in b]
    assert len(served) == len(set(served)), "a group served twice"
    left = [s for gid, s in zip(sent, sizes, strict=True) if gid not in set(served)]
    status = (await now.get("/status")).json()
    assert status["queued_sequences"] == sum(left) < 256, "a group neither served nor queued"
    assert status["trimmed_sequences"] == {"math_0": trimmed} and trimmed > 0
    assert status["trimmed_batches"] == sum(
        any(len(g["tokens"]) < len(sent[g["group_id"]]["tokens"]) for g in b) for b in batches
    )
    assert status["smaller_batches"] == 0
    metrics = (await now.get("/metrics")).text
    assert f'rollbuf_sequences_trimmed_total{{env="math_0"}} {float(trimmed)}' in metrics
    # the run goes on: the groups left are served with later ones (an exact fill may pass them over, at most
    # `formation_due_after` batches); the sequences cut off a served group never are
    for k in range(30):
        if set(served) >= set(sent):
            break
        more = {f"g{100 + 4 * k + j}": survivor(64, 100 + 4 * k + j) for j in range(4)}
        assert (await now.post("/scored_data_list", json=list(more.values()))).status_code == 200
        sent.update(more)
        later, _ = await serve_all(now, sent, first=len(batches))
        batches += later
        served += [g["group_id"] for b in later for g in b]
    assert len(served) == len(set(served)), "a group served twice"
    assert set(served) >= {f"g{i}" for i in range(len(sizes))}, "a group never served"


async def test_register_names_the_field_of_an_unknown_policy(client: httpx.AsyncClient) -> None:
    reply = await client.post("/register", json=registration(no_exact_fill="cut"))
    assert reply.status_code == 422, reply.text
    locs = [e["loc"] for e in reply.json()["detail"]]
    assert ["body", "no_exact_fill"] in locs and "'trim'" in reply.text
