"""Reused group ids: the same content again is a duplicate (200), different content a 409; on both stores
and both encodings."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from api.wire.records import MSGPACK, encode_submission
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=8))
    await client.get("/batch")
    assert (await client.post("/register-env", json=env(group_size=4))).json()["status"] == "success"


async def queued(client: httpx.AsyncClient) -> int:
    return (await client.get("/status")).json()["queue_size"]  # type: ignore[no-any-return]


def binary(body: dict[str, Any]) -> bytes:
    meta = {k: v for k, v in body.items() if k not in ("tokens", "masks", "scores", "env_id", "group_id")}
    lps = meta.pop("inference_logprobs", None)
    return encode_submission(
        body["tokens"],
        body["masks"],
        body["scores"],
        env_id=body["env_id"],
        group_id=body.get("group_id"),
        inference_logprobs=lps,
        **meta,
    )


async def test_same_id_same_content_is_a_duplicate(client: httpx.AsyncClient) -> None:
    await start(client)
    body = group(4, env_id=0, group_id="task-17", messages=[[{"role": "user", "content": "hi", "x": 1}]] * 4)
    assert (await client.post("/scored_data", json=body)).json() == {"status": "received"}
    reordered = dict(reversed(body.items()))  # key order is not content
    reordered["messages"] = [[dict(reversed(m[0].items()))] for m in body["messages"]]
    gz = gzip.compress(json.dumps(reordered).encode())
    r = await client.post("/scored_data", content=gz, headers={"Content-Encoding": "gzip"})
    assert r.json() == {"status": "received", "duplicate": True}
    r = await client.post("/scored_data", content=binary(body), headers={"Content-Type": MSGPACK})
    assert r.json() == {"status": "received", "duplicate": True}
    assert await queued(client) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b["tokens"][0].__setitem__(0, b["tokens"][0][0] + 1),
        lambda b: b["masks"][1].__setitem__(3, 1),
        lambda b: b["scores"].__setitem__(2, 0.5),
        lambda b: b["inference_logprobs"][3].__setitem__(7, -0.125),
        lambda b: b.__setitem__("overrides", [{"temperature": 0.5}] * 4),
        lambda b: b.__setitem__("policy_step", 0),
    ],
    ids=["token", "mask", "score", "logprob", "overrides", "policy_step"],
)
async def test_same_id_different_content_is_409_and_stores_nothing(client: httpx.AsyncClient, change: Any) -> None:
    await start(client)
    body = group(4, env_id=0, group_id="task-17")
    assert (await client.post("/scored_data", json=body)).status_code == 200
    other = json.loads(json.dumps(body))
    change(other)
    r = await client.post("/scored_data", json=other)
    assert r.status_code == 409, r.text
    assert r.json()["code"] == "conflict"
    assert "group_id 'task-17' of env_id 0 was used before for a group with different content" in r.json()["detail"]
    r = await client.post("/scored_data", content=binary(other), headers={"Content-Type": MSGPACK})
    assert r.status_code == 409, r.text
    # In a list, nothing of the list is stored, and the 409 names the group.
    r = await client.post("/scored_data_list", json=[group(4, env_id=0, seed=5, group_id="new"), other])
    assert r.status_code == 409 and r.json()["detail"].startswith("body[1]: group_id 'task-17'")
    assert await queued(client) == 1
    # Ids are scoped by env: the same id in another env is another group.
    assert (await client.post("/scored_data", json={**other, "env_id": None})).json() == {"status": "received"}


async def test_one_id_twice_in_one_list(client: httpx.AsyncClient) -> None:
    await start(client)
    a = group(4, env_id=0, group_id="g")
    r = await client.post("/scored_data_list", json=[a, a])
    assert r.json() == {"status": "received", "groups_processed": 2, "duplicates": 1, "duplicate_at": [1]}
    assert await queued(client) == 1
    b = group(4, env_id=0, seed=3, group_id="h")
    c = group(4, env_id=0, seed=4, group_id="h")
    r = await client.post("/scored_data_list", json=[b, c])
    assert r.status_code == 409 and "by body[0] of this request" in r.json()["detail"]
    assert await queued(client) == 1


async def test_any_group_id_is_a_key(client: httpx.AsyncClient) -> None:
    """Group ids are text as the client sent it: NUL (which PostgreSQL text cannot hold), quotes, backslashes."""
    await start(client)
    ids = ["a\x00b", "a\\x00b", "\x01lead", '{"q",\\}', "ünï"]
    for i, gid in enumerate(ids):
        assert (await client.post("/scored_data", json=group(4, env_id=0, seed=i, group_id=gid))).status_code == 200
    for i, gid in enumerate(ids):
        r = await client.post("/scored_data", json=group(4, env_id=0, seed=i, group_id=gid))
        assert r.json() == {"status": "received", "duplicate": True}, gid
    assert await queued(client) == len(ids)
