"""Large bodies are inflated, parsed and validated in a worker thread, small ones on the event loop; gzip
bodies with bytes after their end are refused."""

from __future__ import annotations

import gzip
import json
import threading
from typing import Any

import httpx
import pytest

import api.body
import api.submissions
from api.records import MSGPACK, encode_submission, encode_submission_list
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
    parsed = spy(monkeypatch, api.submissions, "read_groups")
    inflated = spy(monkeypatch, api.body, "gunzip")
    small = json.dumps(group(8, length=64, env_id=0)).encode()
    large = json.dumps([group(8, length=2048, env_id=0, seed=i) for i in range(4)]).encode()
    assert len(small) < api.body.INLINE_PARSE < len(large)
    assert (await client.post("/scored_data", content=small)).status_code == 200
    assert (await client.post("/scored_data_list", content=large)).status_code == 200
    gz = gzip.compress(large, compresslevel=1)
    assert len(gz) > api.body.INLINE_GZIP
    r = await client.post("/scored_data_list", content=gz, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200
    assert parsed[0] == loop_thread and parsed[1] != loop_thread and parsed[2] != loop_thread
    assert inflated == [inflated[0]] and inflated[0] != loop_thread
    assert (await client.get("/status")).json()["queue_size"] == 9


async def test_large_binary_is_validated_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await start(client)
    checked = spy(monkeypatch, api.submissions, "check_body")
    body = encode_submission_list(encode_submission(**group(8, length=4096, env_id=0, seed=i)) for i in range(4))
    assert len(body) > api.body.INLINE_PARSE
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
