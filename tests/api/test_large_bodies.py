"""Large bodies are inflated, parsed and validated in a worker thread, small ones on the event loop; gzip
bodies with bytes after their end are refused."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import threading
from typing import Any

import httpx
import pytest

import api.http.body
import api.ingest.service
import api.ingest.submissions
import api.run.offloop
from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=64, max_token_len=4096))
    await client.get("/batch")
    assert (await client.post("/register-env", json=env(group_size=8, max_token_length=4096))).json()["env_id"] == 0


def spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Record the thread each call of `module.name` runs on."""
    threads: list[int] = []
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return threads


async def test_large_json_is_parsed_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await start(client)
    loop_thread = threading.get_ident()
    parsed = spy(monkeypatch, api.ingest.submissions, "read_groups")
    inflated = spy(monkeypatch, api.http.body, "gunzip")
    small = json.dumps(group(8, length=64, env_id=0)).encode()
    large = json.dumps([group(8, length=2048, env_id=0, seed=i) for i in range(4)]).encode()
    assert len(small) < api.run.offloop.INLINE_PARSE < len(large)
    assert (await client.post("/scored_data", content=small)).status_code == 200
    assert (await client.post("/scored_data_list", content=large)).status_code == 200
    gz = gzip.compress(large, compresslevel=1)
    assert len(gz) > api.http.body.INLINE_GZIP
    r = await client.post("/scored_data_list", content=gz, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200
    assert parsed[0] == loop_thread and parsed[1] != loop_thread and parsed[2] != loop_thread
    assert inflated == [inflated[0]] and inflated[0] != loop_thread
    assert (await client.get("/status")).json()["queue_size"] == 9


async def test_large_binary_is_validated_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await start(client)
    checked = spy(monkeypatch, api.ingest.submissions, "check_body")
    body = encode_submission_list(encode_submission(**group(8, length=4096, env_id=0, seed=i)) for i in range(4))
    assert len(body) > api.run.offloop.INLINE_PARSE
    r = await client.post("/scored_data_list", content=body, headers={"Content-Type": MSGPACK})
    assert r.status_code == 200
    assert checked[0] != threading.get_ident()


async def test_an_error_in_a_large_body_is_the_same_422(client: httpx.AsyncClient) -> None:
    await start(client)
    groups = [group(8, length=2048, env_id=0, seed=i) for i in range(4)]
    groups[3]["tokens"][1][7] = -3
    r = await client.post("/scored_data_list", json=groups)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", 3, "tokens", 1, 7]
    assert (await client.get("/status")).json()["queue_size"] == 0


@pytest.mark.parametrize("size", [100, 200_000])  # inflated on the loop, and in a thread
async def test_bytes_after_the_gzip_data_are_400(client: httpx.AsyncClient, size: int) -> None:
    await start(client)
    body = gzip.compress(json.dumps(group(8, length=max(8, size // 100), env_id=0)).encode(), compresslevel=0)
    r = await client.post("/scored_data", content=body + b"trailing", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert "8 bytes after the end of the gzip data" in r.json()["detail"]
    assert (await client.get("/status")).json()["queue_size"] == 0


def tiny_list(n: int) -> bytes:
    """`n` groups of two one-token sequences, as JSON: many objects for few bytes."""
    one = {"env_id": 0, "tokens": [[1], [2]], "masks": [[1], [1]], "scores": [0.0, 1.0]}
    return json.dumps([one] * n).encode()


@pytest.mark.parametrize("settings", ["memory", "sqlite"], indirect=True)  # PostgreSQL: 20 s, same code path
async def test_a_large_list_runs_no_garbage_collection_and_the_loop_answers_meanwhile(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 100,000 tiny groups the cyclic collector's full collections (each walking every object the list
    made, finding nothing) would stall the event loop 0.2-1.3 s each; none runs while a large list is
    ingested. And the loop answers another request while the list is decoded."""
    await start(client)
    body = tiny_list(20_000)
    assert len(body) > api.run.offloop.INLINE_PARSE
    decoding, probed = threading.Event(), threading.Event()
    real = api.ingest.submissions.decode
    collections: list[int] = []
    during: list[tuple[bool, int]] = []  # (collector on, collections) while the list was decoded

    def decode(*args: Any, **kwargs: Any) -> Any:
        decoding.set()
        probed.wait(30)  # the probe is answered while this request holds its worker thread
        before = len(collections)
        try:
            return real(*args, **kwargs)
        finally:
            during.append((gc.isenabled(), len(collections) - before))

    monkeypatch.setattr(api.ingest.submissions, "decode", decode)

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        posted = asyncio.create_task(client.post("/scored_data_list", content=body))
        while not decoding.is_set():
            await asyncio.sleep(0.01)
        assert (await client.get("/")).status_code == 200
        assert not posted.done()
        probed.set()
        reply = await posted
    finally:
        gc.callbacks.remove(count)
    assert reply.status_code == 200 and reply.json()["groups_processed"] == 20_000
    assert during == [(False, 0)]  # 20,000 groups made many collections before
    assert gc.isenabled()
    assert (await client.get("/status")).json()["queue_size"] == 20_000


@pytest.mark.parametrize("settings", ["memory", "sqlite"], indirect=True)
async def test_the_loop_answers_while_a_large_list_is_stored(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transaction storing 100,000 tiny groups, run on the event loop, leaves everyone without an answer
    for 6.7-8.8 s; a large list's transaction runs off it. A read made meanwhile waits for the
    whole list: it sees all of it or none."""
    await start(client)
    storing, probed = threading.Event(), threading.Event()
    real = api.ingest.service.submit_txn

    def submit_txn(*args: Any, **kwargs: Any) -> Any:
        storing.set()
        probed.wait(10)  # the probe is answered while this transaction is under way (before: the loop was held)
        return real(*args, **kwargs)

    monkeypatch.setattr(api.ingest.service, "submit_txn", submit_txn)
    posted = asyncio.create_task(client.post("/scored_data_list", content=tiny_list(20_000)))
    while not storing.is_set():
        await asyncio.sleep(0.01)  # polling interval
    assert (await client.get("/")).status_code == 200
    status = asyncio.create_task(client.get("/status"))
    assert not posted.done()
    probed.set()
    reply = await posted
    assert reply.status_code == 200 and reply.json()["groups_processed"] == 20_000
    assert (await status).json()["queue_size"] in (0, 20_000)
    assert (await client.get("/status")).json()["queue_size"] == 20_000


async def test_an_error_deep_in_a_large_list_names_its_index(client: httpx.AsyncClient) -> None:
    """A list is validated in slices (`api.http.body.VALIDATE_SLICE`): an error names its index in the whole list."""
    await start(client)
    groups = [{"env_id": 0, "tokens": [[1], [2]], "masks": [[1], [1]], "scores": [0.0, 1.0]} for _ in range(3000)]
    groups[2345]["scores"] = "high"
    r = await client.post("/scored_data_list", content=json.dumps(groups).encode())
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"][:3] == ["body", 2345, "scores"]
    assert (await client.get("/status")).json()["queue_size"] == 0
