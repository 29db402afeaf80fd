"""Bounds on what one request can make the server hold or compute: request bytes across requests, data-parallel
ranks, env names, the example kept for /latest_example."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.http.body_cost import decoded_cost
from api.ingest.service import LATEST_MAX_BYTES
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=8, max_token_len=1 << 20))
    await client.get("/batch")
    assert (await client.post("/register-env", json=env(group_size=4, max_token_length=1 << 20))).json()["env_id"] == 0


@pytest.fixture
async def tight(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    """Bodies up to 1 MB (2 MB inflated), 3 MB of them held at once."""
    bounded = settings.model_copy(
        update={"max_body_bytes": 1 << 20, "max_decompressed_bytes": 2 << 20, "max_inflight_bytes": 3 << 20}
    )
    app = create_app(bounded)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app.state.body_budget


async def test_past_the_inflight_budget_a_body_is_refused_with_503_and_every_byte_is_given_back(
    tight: tuple[httpx.AsyncClient, object],
) -> None:
    client, budget = tight
    await start(client)
    body = json.dumps(group(4, length=64, env_id=0)).encode()
    held = budget.hold()  # type: ignore[attr-defined]
    held.take((3 << 20) - len(body) + 1)  # as if other requests held all but len(body) - 1 bytes
    r = await client.post("/scored_data", content=body)
    assert r.status_code == 503 and r.json()["code"] == "busy" and "max_inflight_bytes" in r.json()["message"]
    assert int(r.headers["Retry-After"]) >= 1
    held.give(1)  # room for the body's bytes, not for what decoding them costs (api.http.body_cost)
    r = await client.post("/scored_data", content=body)
    assert r.status_code == 503 and r.json()["code"] == "busy" and "max_inflight_bytes" in r.json()["message"]
    held.give(decoded_cost(body, "application/json") - len(body))
    assert (await client.post("/scored_data", content=body)).status_code == 200
    held.release()
    # Whatever a request ends with (stored, refused, invalid, bad gzip), it gives back what it took.
    await client.post("/scored_data", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    await client.post("/scored_data", content=b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"})
    await client.post("/scored_data_list", content=b"[{}]")
    await client.post("/scored_data", content=gzip.compress(b" " * (3 << 20)), headers={"Content-Encoding": "gzip"})
    assert budget.held == 0  # type: ignore[attr-defined]
    assert (await client.get("/status")).json()["queue_size"] == 2


def test_the_budget_holds_any_one_valid_request() -> None:
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        Settings(store="memory://", max_body_bytes=1000, max_decompressed_bytes=1000, max_inflight_bytes=1999)


async def test_world_size_is_bounded(client: httpx.AsyncClient) -> None:
    """`world_size=5000000` once took 11 s and 1.3 GB: one heap entry and one share per rank."""
    await start(client)
    r = await client.get("/batch", params={"rank": 0, "world_size": 5_000_000})
    assert r.status_code == 422
    assert r.json()["errors"][0]["loc"] == ["query", "world_size"] and "4096" in r.json()["message"]
    assert (await client.get("/batch", params={"rank": 4095, "world_size": 4096})).status_code == 200


async def test_env_names_are_bounded(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration())
    await client.get("/batch")
    r = await client.post("/register-env", json=env(name="x" * 201))
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "desired_name"]
    assert (await client.post("/register-env", json=env(name="x" * 200))).status_code == 200


async def test_the_latest_example_is_a_bounded_copy(client: httpx.AsyncClient) -> None:
    """One 12 MB group once kept 374 MB alive for /latest_example: the whole request it came in."""
    await start(client)
    small = group(4, length=8, env_id=0)
    assert (await client.post("/scored_data", json=small)).status_code == 200
    large = group(4, length=LATEST_MAX_BYTES // 8, env_id=0, seed=1)
    assert (await client.post("/scored_data", json=large)).status_code == 200
    assert (await client.get("/latest_example")).json()["tokens"] == small["tokens"]


async def test_metadata_counts_against_the_queue_byte_limit(settings: Settings) -> None:
    """120 groups of 4 x 1 token with 2 MB of `images` each once stored 240 MB under a 1,000-token limit. (Without
    the blob tier: with it, large values are held to `max_blob_bytes` instead, tests/api/test_api_blobs.py.)"""
    limits = {"max_queue_tokens": 1000, "max_queue_bytes": 5 << 20, "blobs": False}
    bounded = settings.model_copy(update=limits)
    app = create_app(bounded)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            await start(client)
            answers = []
            for i in range(6):
                heavy = group(4, length=1, env_id=0, seed=i) | {"images": "x" * (1 << 20)}
                answers.append((await client.post("/scored_data", json=heavy)).status_code)
            assert answers == [200] * 4 + [503] * 2
            status = (await client.get("/status")).json()
            assert status["queue_size"] == 4 and 4 << 20 < status["queued_bytes"] <= 5 << 20
            refused = await client.post("/scored_data", json=heavy)
            assert "max_queue_bytes" in refused.json()["message"] and refused.headers["Retry-After"]


async def test_distillation_candidates_per_position_are_bounded(client: httpx.AsyncClient) -> None:
    await start(client)
    ok = group(4, length=2, env_id=0) | {"distill_token_ids": [[[0] * 1024, [1]]] * 4}
    assert (await client.post("/scored_data", json=ok)).status_code == 200
    wide = group(4, length=2, env_id=0, seed=1) | {"distill_logprobs": [[[0.0], [0.0]]] * 3 + [[[0.0], [0.0] * 1025]]}
    r = await client.post("/scored_data", json=wide)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "distill_logprobs", 3]


async def test_refusals_are_counted_without_a_write_each(settings: Settings) -> None:
    """A handler retrying into a full queue once ran one write transaction per 503 (7,671 refusals grew the
    SQLite WAL to 959 MB): they are counted in memory and written together."""
    app = create_app(settings.model_copy(update={"max_queue_groups": 1}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            await start(client)
            assert (await client.post("/scored_data", json=group(4, env_id=0))).status_code == 200
            service = app.state.service
            service.ingest.refusals_flush_s = 3600  # written at shutdown, then: a machine under load takes its time
            store = service.store
            committed = 0
            real = store.transact

            async def counting(fn: Any, **kw: Any) -> Any:
                nonlocal committed
                result = await real(fn, **kw)
                committed += 1
                return result

            store.transact = counting
            for i in range(50):
                r = await client.post("/scored_data", json=group(4, env_id=0, seed=i + 1))
                assert r.status_code == 503
            assert committed == 0  # each refusal's own transaction was rolled back; none wrote a count
            metrics = (await client.get("/metrics")).text
            assert 'rollbuf_backpressure_rejections_total{env="math_0"} 50.0' in metrics
    assert committed == 1  # at shutdown, all 50 in one write
    app = create_app(settings)  # and the written counts are what a restarted server shows (durable stores)
    if settings.store != "memory://":
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
                metrics = (await client.get("/metrics")).text
                assert 'rollbuf_backpressure_rejections_total{env="math_0"} 50.0' in metrics


async def test_lone_surrogates_in_names_are_a_422(client: httpx.AsyncClient) -> None:
    """JSON's `\\ud800` escape decodes to a string no store or JSON reply can hold: it was a 500."""
    reg = json.dumps(registration()).replace('"g"', '"g\\ud800"', 1).encode()
    r = await client.post("/register", content=reg, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["errors"][0]["loc"][:1] == ["body"]
    await client.post("/register", json=registration())
    await client.get("/batch")
    named = json.dumps(env(name="math\\ud800")).replace("\\\\ud800", "\\ud800").encode()
    r = await client.post("/register-env", content=named, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "desired_name"]
