"""The blob tier through the API, on every store (docs/payloads.md): large `images` and `distill_*` values stored
once per key by content, served in batches byte for byte as sent, charged to the key that sent them, refused with
503 past the budgets, collected once nothing refers to them (after their batch is acknowledged, after retention)."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from api.app import create_app
from api.config.settings import Settings
from api.run.blobs import BlobTier
from api.service import Service
from api.wire.blobs import EXT_TYPE, MARKER, refs_in
from api.wire.records import MSGPACK, encode_submission, msgpack_array_header
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio
SECRETS = {"env-1": "env-one-secret-0123456789", "env-2": "env-two-secret-0123456789", "trainer": "trainer-0123456789a"}
KEYS = "; ".join(f"{name} {name.split('-')[0]} {secret}" for name, secret in SECRETS.items())
IMAGE = base64.b64encode(np.random.default_rng(0).bytes(96 * 1024)).decode()
"""A 128 KiB image as a handler sends it (base64 text): above `blob_min_bytes`."""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[key]}"}


@asynccontextmanager
async def app_of(settings: Settings, tmp_path: Path, **update: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    s = settings.model_copy(update={"blob_dir": tmp_path / "blobs", "max_batch_wait": 0, **update})
    app = create_app(s)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app


def tier(app: FastAPI) -> BlobTier:
    service: Service = app.state.service
    assert service.blobs is not None
    return service.blobs


def blob_files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "blobs").rglob("*") if p.is_file() and p.parent.name != "tmp")


async def start(c: httpx.AsyncClient, group_size: int = 4, batch_size: int = 8, **keys: Any) -> None:
    trainer = keys.get("trainer", {})
    assert (await c.post("/register", json=registration(batch_size=batch_size), headers=trainer)).status_code == 200
    await c.get("/batch", params={"step": 0}, headers=trainer)  # the run starts: envs may register
    for name in keys.get("envs", ["env"]):
        h = auth(name) if keys.get("envs") else {}
        assert (await c.post("/register-env", json=env(name, group_size), headers=h)).json()["status"] == "success"


def with_image(seed: int, n: int = 4, image: str = IMAGE) -> bytes:
    """A canonical binary group (stored as sent) whose n siblings each carry the same image."""
    body = group(n, seed=seed, logprobs=False)
    return encode_submission(
        body["tokens"], body["masks"], body["scores"], env_id=0, policy_step=0, group_id=f"g{seed}", images=[image] * n
    )


async def collect(app: FastAPI, tmp_path: Path) -> int:
    """A collection, with every blob file as if written past the grace period."""
    old = time.time() - 2 * tier(app).limits.grace - 1
    for f in blob_files(tmp_path):
        os.utime(f, (old, old))
    service: Service = app.state.service
    return (await tier(app).collect(service.store)).objects


async def test_groups_are_served_byte_for_byte_as_sent_and_their_image_is_stored_once(
    settings: Settings, tmp_path: Path
) -> None:
    async with app_of(settings, tmp_path) as (c, app):
        await start(c)
        sent = [with_image(1), with_image(2)]
        for body in sent:
            r = await c.post("/scored_data", content=body, headers={"Content-Type": MSGPACK})
            assert r.status_code == 200, r.text
        files = blob_files(tmp_path)
        assert len(files) == 1  # 8 siblings over 2 groups: one blob
        assert files[0].stat().st_size < len(IMAGE) + 16
        stored = await app.state.service.store.read(lambda t: list(t.payloads_with(MARKER)))
        assert len(stored) == 2 and all(len(p) < len(IMAGE) for p in stored)  # the rows hold references only
        r = await c.get("/batch?step=0", headers={"Accept": MSGPACK})
        assert r.content == msgpack_array_header(2) + b"".join(sent)  # as a server without the tier serves it
        again = await c.get("/batch?step=0", headers={"Accept": MSGPACK})
        assert again.content == r.content
        js = orjson.loads((await c.get("/batch?step=0")).content)["batch"]
        assert [g["images"] for g in js] == [[IMAGE] * 4] * 2
        stats = tier(app).stats
        assert (stats.written_objects, stats.deduplicated) == (1, 7)


async def test_json_groups_and_distill_rows_round_trip(settings: Settings, tmp_path: Path) -> None:
    rows = [[[k, k + 1]] * 8 for k in range(4)]
    logprobs = [[[-0.25 * k] * 200 for _ in range(8)] for k in range(4)]
    body = group(4, seed=3, images=IMAGE, distill_token_ids=rows, distill_logprobs=logprobs)
    async with app_of(settings, tmp_path, blob_min_bytes=1024) as (c, _):
        await start(c, batch_size=4)
        assert (await c.post("/scored_data", json=body)).status_code == 200
        assert len(blob_files(tmp_path)) == 5  # the image and 4 rows of logprobs (the ids are small)
        served = orjson.loads((await c.get("/batch?step=0")).content)["batch"][0]
        assert served["images"] == IMAGE
        assert served["distill_logprobs"] == logprobs and served["distill_token_ids"] == rows


async def test_blobs_are_collected_once_their_batch_is_acknowledged(settings: Settings, tmp_path: Path) -> None:
    async with app_of(settings, tmp_path) as (c, app):
        await start(c, batch_size=4)
        post = {"Content-Type": MSGPACK}
        assert (await c.post("/scored_data", content=with_image(1), headers=post)).status_code == 200
        assert await collect(app, tmp_path) == 0 and len(blob_files(tmp_path)) == 1  # queued: referenced
        assert (await c.get("/batch?step=0")).json()["batch"]
        assert await collect(app, tmp_path) == 0  # kept for batch 0 until batch 1 is asked for
        assert (await c.get("/batch?step=1")).json()["batch"] is None
        assert await collect(app, tmp_path) == 1 and blob_files(tmp_path) == []
        assert tier(app).stats.collected_objects == 1


async def test_retained_payloads_keep_their_blobs_and_the_ledger_shows_them_inline(
    settings: Settings, tmp_path: Path
) -> None:
    async with app_of(settings, tmp_path, retain_steps=100) as (c, app):
        await start(c, batch_size=4)
        assert (await c.post("/scored_data", content=with_image(1), headers={"Content-Type": MSGPACK})).is_success
        await c.get("/batch?step=0")
        await c.get("/batch?step=1")
        assert await collect(app, tmp_path) == 0 and len(blob_files(tmp_path)) == 1  # retained: referenced
        [row] = (await c.get("/ledger/groups/g1?data=true")).json()["groups"]
        assert row["data"]["images"] == [IMAGE] * 4


async def test_the_budget_refuses_with_503_and_stores_nothing(settings: Settings, tmp_path: Path) -> None:
    budget = {"max_blob_bytes": len(IMAGE) + 1024, "max_blob_bytes_per_key": len(IMAGE) + 1024}
    async with app_of(settings, tmp_path, **budget) as (c, app):
        await start(c, batch_size=4)
        post = {"Content-Type": MSGPACK}
        assert (await c.post("/scored_data", content=with_image(1), headers=post)).status_code == 200
        assert (await c.post("/scored_data", content=with_image(2), headers=post)).status_code == 200  # same image
        other = with_image(3, image=IMAGE[::-1])
        r = await c.post("/scored_data", content=other, headers=post)
        assert r.status_code == 503 and r.json()["code"] == "blobs_full" and "max_blob_bytes" in r.json()["detail"]
        assert int(r.headers["Retry-After"]) >= 1
        counts = await app.state.service.store.read(lambda t: t.counts())
        assert sum(q.groups for q in counts.values()) == 2
        assert len(blob_files(tmp_path)) == 1 and tier(app).stats.refused == 1


async def test_another_key_sending_the_same_bytes_gets_its_own_blob_and_budget(
    settings: Settings, tmp_path: Path
) -> None:
    """A blob is never shared between keys (unless the operator says so): a key that sends bytes another key
    stored is charged for them and learns nothing (no write skipped, no reference to the other key's file)."""
    keyed = {"api_keys": SecretStr(KEYS), "max_blob_bytes": 4 * len(IMAGE), "max_blob_bytes_per_key": len(IMAGE) + 1024}
    async with app_of(settings, tmp_path, **keyed) as (c, app):
        await start(c, batch_size=4, trainer=auth("trainer"), envs=["env-1", "env-2"])
        for name, env_id in (("env-1", 0), ("env-2", 1)):
            record = encode_submission(
                [[1, 2]] * 4, [[1, 2]] * 4, [1.0, 0.0, 1.0, 0.0], env_id=env_id, policy_step=0, images=[IMAGE] * 4
            )
            r = await c.post("/scored_data", content=record, headers={"Content-Type": MSGPACK, **auth(name)})
            assert r.status_code == 200, r.text
        files = blob_files(tmp_path)
        assert len(files) == 2 and len({f.parent.parent.name for f in files}) == 2  # one per key
        assert tier(app).stats.written_objects == 2
        big = encode_submission([[1]] * 4, [[1]] * 4, [1.0, 0, 1, 0], env_id=0, policy_step=0, images=[IMAGE[::-1]] * 4)
        r = await c.post("/scored_data", content=big, headers={"Content-Type": MSGPACK, **auth("env-1")})
        assert r.status_code == 503 and "max_blob_bytes_per_key" in r.json()["detail"]


async def test_the_operator_may_share_blobs_across_keys(settings: Settings, tmp_path: Path) -> None:
    shared = {"api_keys": SecretStr(KEYS), "blob_shared_across_keys": True}
    async with app_of(settings, tmp_path, **shared) as (c, app):
        await start(c, batch_size=4, trainer=auth("trainer"), envs=["env-1", "env-2"])
        for name, env_id in (("env-1", 0), ("env-2", 1)):
            record = encode_submission(
                [[1, 2]] * 4, [[1, 2]] * 4, [1.0, 0.0, 1.0, 0.0], env_id=env_id, policy_step=0, images=[IMAGE] * 4
            )
            r = await c.post("/scored_data", content=record, headers={"Content-Type": MSGPACK, **auth(name)})
            assert r.status_code == 200, r.text
        assert tier(app).stats.written_objects == 1  # the operator chose to share


async def test_a_forged_reference_to_another_keys_blob_is_refused(settings: Settings, tmp_path: Path) -> None:
    """A producer cannot send a reference (a msgpack ext value) to read back a blob it never sent: 422 naming the
    field, and nothing is stored."""
    async with app_of(settings, tmp_path, api_keys=SecretStr(KEYS)) as (c, app):
        await start(c, batch_size=4, trainer=auth("trainer"), envs=["env-1", "env-2"])
        sent = encode_submission([[1]] * 4, [[1]] * 4, [1.0, 0, 1, 0], env_id=0, policy_step=0, images=[IMAGE] * 4)
        assert (
            await c.post("/scored_data", content=sent, headers={"Content-Type": MSGPACK, **auth("env-1")})
        ).is_success
        [stored] = await app.state.service.store.read(lambda t: list(t.payloads_with(MARKER)))
        [ref, *_] = refs_in(stored)
        forged = msgpack.packb(
            {**msgpack.unpackb(sent), "env_id": 1, "meta": {"images": msgpack.ExtType(EXT_TYPE, ref.pack()[3:])}}
        )
        r = await c.post("/scored_data", content=forged, headers={"Content-Type": MSGPACK, **auth("env-2")})
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "meta", "images"], r.text
        assert len(await app.state.service.store.read(lambda t: list(t.payloads_with(MARKER)))) == 1


async def test_a_batch_whose_blobs_are_gone_is_not_taken(settings: Settings, tmp_path: Path) -> None:
    """An operator who moves `blob_dir` (or removes its files) under queued groups: /batch answers 500 `blob_lost`
    naming the directory, nothing is taken, and the batch is served whole once the files are back."""
    async with app_of(settings, tmp_path) as (c, _):
        await start(c, batch_size=4)
        sent = with_image(1)
        assert (await c.post("/scored_data", content=sent, headers={"Content-Type": MSGPACK})).status_code == 200
        os.rename(tmp_path / "blobs", tmp_path / "moved")
        r = await c.get("/batch", headers={"Accept": MSGPACK})
        assert r.status_code == 500 and r.json()["code"] == "blob_lost" and str(tmp_path / "blobs") in r.text
        os.rename(tmp_path / "moved", tmp_path / "blobs")
        r = await c.get("/batch", headers={"Accept": MSGPACK})
        assert r.content == msgpack_array_header(1) + sent


async def test_status_and_metrics_show_the_tier(settings: Settings, tmp_path: Path) -> None:
    async with app_of(settings, tmp_path) as (c, app):
        await start(c, batch_size=8)
        for seed in (1, 2):
            assert (
                await c.post("/scored_data", content=with_image(seed), headers={"Content-Type": MSGPACK})
            ).is_success
        await collect(app, tmp_path)  # counts the files and the references; collects nothing (all queued)
        blobs = (await c.get("/status")).json()["blobs"]
        assert blobs["objects"] == 1 and blobs["references"] == 8 and blobs["dedup_ratio"] == 8.0
        assert (blobs["written"], blobs["deduplicated"], blobs["collected"]) == (1, 7, 0)
        assert blobs["bytes"] == blobs["written_bytes"] > len(IMAGE)
        text = (await c.get("/metrics")).text
        assert "rollbuf_blob_objects 1.0" in text and "rollbuf_blob_dedup_ratio 8.0" in text
        assert 'rollbuf_blob_events_total{event="deduplicated"} 7.0' in text


async def test_a_server_without_the_tier_or_without_blobs_shows_none(settings: Settings, tmp_path: Path) -> None:
    async with app_of(settings, tmp_path) as (c, app):
        assert app.state.service.blobs is not None
        assert (await c.get("/status")).json()["blobs"]["objects"] == 0
        assert "rollbuf_blob_" not in (await c.get("/metrics")).text  # as the rollout families: none until used
    async with app_of(settings, tmp_path, blobs=False) as (c, app):
        assert app.state.service.blobs is None
        assert (await c.get("/status")).json().get("blobs") is None
        assert "rollbuf_blob_" not in (await c.get("/metrics")).text
