"""An Atropos trainer and Atropos rollout handlers, exactly as the spec describes them, against the app."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

SCORED_KEYS = {
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
}
BOTH = ["application/json", "application/msgpack"]
"""rollbuf's additions to /info (`content_types`, `max_read_ahead_batches`); Atropos clients read only the other
two keys."""


def gz_json(obj: Any) -> tuple[bytes, dict[str, str]]:
    """What BaseEnv._post_json_with_compression sends: json.dumps, gzip-9 when >= 1 KiB."""
    raw = json.dumps(obj).encode()
    return gzip.compress(raw), {"Content-Type": "application/json", "Content-Encoding": "gzip"}


async def status_env(client: httpx.AsyncClient, env_id: int) -> dict[str, Any]:
    """BaseEnv.get_status: a GET with a JSON body."""
    r = await client.request("GET", "/status-env", json={"env_id": env_id})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_before_registration(client: httpx.AsyncClient) -> None:
    assert (await client.get("/")).json() == {"message": "AtroposLib API"}
    assert (await client.get("/status")).json()["current_step"] == 0
    assert (await client.get("/info")).json() == {
        "batch_size": -1,
        "max_token_len": -1,
        "content_types": BOTH,
        "max_read_ahead_batches": 8,
    }
    assert (await client.get("/wandb_info")).json() == {"group": None, "project": None}
    assert (await client.get("/batch")).json() == {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }


async def test_full_atropos_round(client: httpx.AsyncClient) -> None:
    # trainer registers (an integral float is an integer, as in JSON Schema)
    r = await client.post("/register", json=registration(batch_size=16.0))
    assert r.status_code == 200
    assert isinstance(r.json()["uuid"], int)
    assert (await client.get("/info")).json() == {
        "batch_size": 16,
        "max_token_len": 512,
        "content_types": BOTH,
        "max_read_ahead_batches": 8,
    }
    assert (await client.get("/wandb_info")).json() == {"group": "g", "project": "p"}

    # an env that registers before the trainer's first /batch is told to wait
    r = await client.post("/register-env", json=env("math", group_size=4))
    assert r.json() == {"status": "wait for trainer to start"}

    # the trainer's first poll starts the run
    assert (await client.get("/batch")).json() == {"batch": None}

    r = await client.post("/register-env", json=env("math", group_size=4, min_batch_allocation=None))
    reg = r.json()
    assert reg["status"] == "success"
    assert reg["env_id"] == 0 and reg["wandb_name"] == "math_0"
    assert reg["checkpoint_dir"] == "ckpt" and reg["starting_step"] == 0
    assert reg["checkpoint_interval"] == 10 and reg["num_steps"] == 100
    r2 = (await client.post("/register-env", json=env("math", group_size=4))).json()
    assert r2["env_id"] == 1 and r2["wandb_name"] == "math_1"

    st = await status_env(client, 0)
    assert set(st) >= {
        "current_step",
        "queue_size",
        "unallocated_fraction",
        "self_queue_size",
        "max_group_size",
        "env_weight",
    }
    assert st["env_weight"] == pytest.approx(0.5)

    # one group via /scored_data (gzipped), three via /scored_data_list (gzipped)
    g0 = group(
        4,
        env_id=0,
        seed=1,
        messages=[[{"role": "user", "content": "hi"}]] * 4,
        generation_params={"temperature": 1.0},
        overrides=[{"a": 1}] * 4,
    )
    body, headers = gz_json(g0)
    r = await client.post("/scored_data", content=body, headers=headers)
    assert r.status_code == 200 and r.json() == {"status": "received"}
    body, headers = gz_json([group(4, env_id=i % 2, seed=10 + i) for i in range(3)])
    r = await client.post("/scored_data_list", content=body, headers=headers)
    assert r.json() == {"status": "received", "groups_processed": 3}

    status = (await client.get("/status")).json()
    assert status["current_step"] == 0 and status["queue_size"] == 4

    # the trainer polls, with gzip accepted like `requests` does
    r = await client.get("/batch", headers={"Accept-Encoding": "gzip, deflate"})
    assert r.headers.get("content-encoding") == "gzip"
    batch = r.json()["batch"]
    assert sum(len(g["tokens"]) for g in batch) == 16
    for g in batch:
        assert SCORED_KEYS <= set(g)
    sent = next(g for g in batch if g["messages"] is not None)
    assert sent["tokens"] == g0["tokens"] and sent["masks"] == g0["masks"] and sent["scores"] == g0["scores"]
    assert sent["messages"] == g0["messages"] and sent["generation_params"] == {"temperature": 1.0}
    assert sent["overrides"] == g0["overrides"]
    assert sent["inference_logprobs"] == g0["inference_logprobs"]  # float32-valued, so exact
    assert (await client.get("/status")).json()["current_step"] == 1
    assert (await client.get("/batch")).json() == {"batch": None}

    r = await client.post("/disconnect-env", json={"env_id": 1})
    assert r.json() == {"status": "success"}
    assert (await client.post("/disconnect-env", json={"env_id": 9})).json()["status"] == "failure"

    latest = (await client.get("/latest_example")).json()
    assert SCORED_KEYS <= set(latest)

    r = await client.get("/reset_data")
    assert r.text == "Reset successful"
    assert (await client.get("/info")).json() == {
        "batch_size": -1,
        "max_token_len": -1,
        "content_types": BOTH,
        "max_read_ahead_batches": 8,
    }


async def test_status_env_query_param(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration())
    await client.get("/batch")
    await client.post("/register-env", json=env())
    r = await client.get("/status-env", params={"env_id": 0})
    assert r.status_code == 200 and r.json()["current_step"] == 0
    assert (await client.get("/status-env", params={"env_id": 5})).status_code == 404


async def test_side_buffer_replies(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=8))
    await client.get("/batch")
    await client.post("/register-env", json=env(group_size=4))
    r = await client.post("/scored_data", json=group(2, env_id=0))
    assert r.json() == {"status": "buffered", "buffer_size": 2}
    r = await client.post("/scored_data_list", json=[group(1, env_id=0), group(4, env_id=0)])
    assert r.json() == {"status": "received", "groups_processed": 2, "buffered": 1, "last_buffer_size": 3}
    r = await client.post("/scored_data", json=group(2, env_id=0))
    assert r.json() == {"status": "buffered", "buffer_size": 1}  # 2 + 2 released, 1 still held
    assert (await client.get("/status")).json()["queue_size"] == 3
    batch = (await client.get("/batch")).json()["batch"]
    assert [len(g["tokens"]) for g in batch] == [4, 2, 2]  # queue order: the 4 went first


async def test_unregistered_env_id_null_is_accepted(client: httpx.AsyncClient) -> None:
    await client.post("/register", json=registration(batch_size=8))
    r = await client.post("/scored_data_list", json=[group(4, env_id=None, seed=i) for i in range(2)])
    assert r.status_code == 200
    batch = (await client.get("/batch")).json()["batch"]
    assert [g["env_id"] for g in batch] == [None, None]
