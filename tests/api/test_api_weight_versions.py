"""Per-token weight versions (`token_weight_versions`) through the ASGI app on every store: stored and served beside
the masks on both encodings, refused with a 422 naming the field and the rule (nothing queued), groups without
them served to Atropos trainers byte for byte as before, and the owner rule unchanged."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from api.config.settings import Settings
from api.wire.records import MSGPACK, decode_batch, encode_submission
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient, **extra: Any) -> None:
    assert (await c.post("/register", json=registration(batch_size=4))).status_code == 200
    await c.get("/batch")
    assert (await c.post("/register-env", json=env(group_size=4, **extra))).json()["status"] == "success"


def versions_of(body: dict[str, Any], step: int = 0) -> list[list[int]]:
    """Prompt positions from one version, the completion's second half from the next (an episode across a sync)."""
    return [[step] * (len(t) - len(t) // 4) + [step + 1] * (len(t) // 4) for t in body["tokens"]]


async def advance(c: httpx.AsyncClient, steps: int) -> None:
    """Serve `steps` batches of plain groups, so the trainer's step is `steps`."""
    for i in range(steps):
        assert (await c.post("/scored_data", json=group(4, env_id=0, seed=100 + i))).status_code == 200
        assert (await c.get("/batch")).json()["batch"] is not None


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
async def test_versions_round_trip_on_both_encodings(client: httpx.AsyncClient, encoding: str) -> None:
    await start(client)
    await advance(client, 1)
    body = group(4, length=[5, 8, 3, 6], env_id=0, seed=1, policy_step=0)
    body["token_weight_versions"] = versions_of(body)
    if encoding == "json":
        r = await client.post("/scored_data", json=body)
    else:
        raw = encode_submission(**body)
        r = await client.post("/scored_data", content=raw, headers={"Content-Type": MSGPACK})
    assert r.status_code == 200, r.text
    [served] = (await client.get("/batch?step=1")).json()["batch"]
    assert served["token_weight_versions"] == body["token_weight_versions"]
    assert served["masks"] == body["masks"] and served["policy_step"] == 0
    binary = await client.get("/batch?step=1", headers={"Accept": MSGPACK})
    [rec] = decode_batch(binary.content)
    assert rec.weight_versions is not None
    assert [v.tolist() for v in rec.split(rec.weight_versions)] == body["token_weight_versions"]


async def test_a_group_without_versions_is_served_to_atropos_as_before(client: httpx.AsyncClient) -> None:
    """The reply an Atropos trainer reads holds exactly the keys it did, in their order, printed alike: built here
    from what the handler sent, it is the reply byte for byte."""
    await start(client)
    body = group(4, length=[5, 8, 3, 6], env_id=0, seed=2)
    assert (await client.post("/scored_data", json=body)).status_code == 200
    reply = await client.get("/batch")
    keys = [
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "inference_logprobs",
        "messages",
        "generation_params",
        "overrides",
        "group_overrides",
        "images",
        "distill_token_ids",
        "distill_logprobs",
    ]
    expected = {k: body.get(k) for k in keys}
    expected.update(env_id=0, policy_step=0, group_id=None)
    assert reply.content == orjson.dumps({"batch": [expected]})
    assert b"token_weight_versions" not in reply.content


BAD_VERSIONS = [
    (lambda v: [v[0], v[1][:-1], v[2], v[3]], ["body", "token_weight_versions", 1], "lengths must match"),
    (lambda v: v[:3], ["body", "token_weight_versions"], "3 rows for 4 sequences"),
    (lambda v: [v[0], v[1], [*v[2][:-1], -1], v[3]], ["body", "token_weight_versions", 2, 7], "must be >= 0, got -1"),
    (lambda v: [v[0], [*v[1][:-1], 2**31], v[2], v[3]], ["body", "token_weight_versions"], "int32"),
    (lambda v: [v[0], v[1], v[2], [*v[3][:-1], 2]], ["body", "token_weight_versions", 3, 7], "2 is ahead of the"),
    (lambda v: [v[0], v[1], v[2], [*v[3][:-1], "1"]], ["body", "token_weight_versions", 3, 7], "integer"),
    (lambda v: 5, ["body", "token_weight_versions"], "list"),
]


@pytest.mark.parametrize(("change", "loc", "msg"), BAD_VERSIONS)
async def test_bad_versions_are_422_naming_the_field_and_nothing_is_queued(
    client: httpx.AsyncClient, change: Any, loc: list[Any], msg: str
) -> None:
    await start(client)
    await advance(client, 1)  # the trainer is at step 1: versions 0 and 1 are fine, 2 is ahead
    body = group(4, env_id=0, seed=3)
    body["token_weight_versions"] = change(versions_of(body))
    r = await client.post("/scored_data", json=body)
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"][: len(loc)] == loc and msg in err["msg"], err
    assert (await client.get("/status")).json()["queue_size"] == 0


async def test_versions_ahead_of_the_trainer_are_422_on_the_binary_path_too(client: httpx.AsyncClient) -> None:
    await start(client)
    body = group(4, env_id=0, seed=4)
    versions = versions_of(body)  # the trainer is at step 0: the last quarter of each sequence, at 1, is ahead
    r = await client.post(
        "/scored_data",
        content=encode_submission(**body, token_weight_versions=versions),
        headers={"Content-Type": MSGPACK},
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["loc"] == ["body", "token_weight_versions", 0, 6]
    assert (await client.get("/status")).json()["queue_size"] == 0


async def test_a_list_with_versions_is_all_or_nothing(client: httpx.AsyncClient) -> None:
    await start(client)
    good = group(4, env_id=0, seed=5)
    good["token_weight_versions"] = [[0] * len(t) for t in good["tokens"]]
    bad = group(4, env_id=0, seed=6)
    bad["token_weight_versions"] = [[0] * len(t) for t in bad["tokens"]][:2]
    r = await client.post("/scored_data_list", json=[good, bad])
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", 1, "token_weight_versions"]
    assert (await client.get("/status")).json()["queue_size"] == 0
    accepted = await client.post("/scored_data_list", json=[good, good])
    assert accepted.json()["groups_processed"] == 2
    assert (await client.get("/status")).json()["queue_size"] == 2


async def test_a_retry_with_other_versions_under_the_same_group_id_is_a_conflict(client: httpx.AsyncClient) -> None:
    await start(client)
    await advance(client, 1)
    body = group(4, env_id=0, seed=7, group_id="g-1")
    body["token_weight_versions"] = versions_of(body)
    assert (await client.post("/scored_data", json=body)).status_code == 200
    assert (await client.post("/scored_data", json=body)).json()["duplicate"] is True
    body["token_weight_versions"] = [[0] * len(t) for t in body["tokens"]]
    assert (await client.post("/scored_data", json=body)).status_code == 409


async def test_another_keys_env_is_refused_alike_with_versions() -> None:
    """A group with versions into another key's env is answered as one without (the env is unknown to it)."""
    secrets = {
        "env-1": "env-one-secret-0123456789",
        "env-2": "env-two-secret-0123456789",
        "trainer": "trainer-secret-0123456789",
    }
    keys = "; ".join(f"{name} {name.split('-')[0]} {secret}" for name, secret in secrets.items())

    def as_(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {secrets[name]}"}

    async with serving(Settings(store="memory://", api_keys=keys, max_batch_wait=0)) as c:
        assert (await c.post("/register", json=registration(batch_size=4), headers=as_("trainer"))).status_code == 200
        await c.get("/batch", headers=as_("trainer"))
        mine = (await c.post("/register-env", json=env(group_size=4), headers=as_("env-1"))).json()["env_id"]
        plain = group(4, env_id=mine, seed=8)
        versioned = {**plain, "token_weight_versions": [[0] * len(t) for t in plain["tokens"]]}
        without = await c.post("/scored_data", json=plain, headers=as_("env-2"))
        refused = await c.post("/scored_data", json=versioned, headers=as_("env-2"))
        assert refused.status_code == without.status_code == 422, refused.text  # as an env that does not exist
        assert refused.json() == without.json() and refused.json()["errors"][0]["loc"] == ["body", "env_id"]
        assert (await c.post("/scored_data", json=versioned, headers=as_("env-1"))).status_code == 200
        [served] = (await c.get("/batch", headers=as_("trainer"))).json()["batch"]
        assert served["token_weight_versions"] == versioned["token_weight_versions"]


async def test_a_rollout_post_checks_its_versions_and_the_sealed_group_serves_them(settings: Settings) -> None:
    """A per-rollout post's versions are a row of its group: one per token (422), none ahead of the trainer (409),
    part of its content (a repost with others is a 409); the group sealed from its slots serves them in slot order."""
    async with serving(settings) as c:
        await start(c)
        await advance(c, 1)  # the trainer is at step 1
        body = {"group_id": "g1", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600.0}
        assert (await c.post("/rollouts/open", json=body)).status_code == 200
        post = {"group_id": "g1", "slot": 0, "producer_id": "p1", "tokens": [5, 6, 7], "masks": [-100, 6, 7]}
        post["score"] = 1.0
        short = await c.post("/rollouts/post", json={**post, "token_weight_versions": [0, 0]})
        assert short.status_code == 422 and short.json()["errors"][0]["loc"] == ["body", "token_weight_versions"]
        ahead = await c.post("/rollouts/post", json={**post, "token_weight_versions": [0, 1, 2]})
        assert ahead.status_code == 409, ahead.text
        assert ahead.json()["errors"][0]["loc"] == ["body", "token_weight_versions", 2]
        assert (await c.post("/rollouts/post", json={**post, "token_weight_versions": [0, 0, 1]})).status_code == 200
        assert (await c.post("/rollouts/post", json={**post, "token_weight_versions": [0, 0, 1]})).status_code == 200
        other = await c.post("/rollouts/post", json={**post, "token_weight_versions": [0, 1, 1]})
        assert other.status_code == 409, other.text  # another content for an acknowledged slot
        for slot in (1, 2, 3):
            rollout = {**post, "slot": slot, "tokens": [5, 6, 7 + slot], "masks": [-100, 6, 7 + slot]}
            reply = await c.post("/rollouts/post", json={**rollout, "token_weight_versions": [1, 1, slot % 2]})
            assert reply.status_code == 200, reply.text
        [served] = (await c.get("/batch")).json()["batch"]
        assert served["token_weight_versions"] == [[0, 0, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]]


async def test_tokens_older_than_the_envs_max_token_staleness_are_served_masked(client: httpx.AsyncClient) -> None:
    """At step 3 with `max_token_staleness` 1, the trained tokens of weights 0 and 1 are served with -100 (the others
    as sent), counted per env in /status and /metrics; the group keeps its `policy_step`, and the batch served again
    is the same bytes."""
    await start(client, max_token_staleness=1)
    await advance(client, 3)
    body = group(4, length=8, env_id=0, seed=9, policy_step=0)
    body["token_weight_versions"] = [[0, 0, 0, 1, 1, 2, 3, 3]] * 4  # masks: -100 on the first 4 (the prompt)
    assert (await client.post("/scored_data", json=body)).status_code == 200
    first = await client.get("/batch?step=3")  # asked by step: kept for serving again
    [served] = first.json()["batch"]
    expected = [
        [-100 if v < 2 else m for m, v in zip(row, body["token_weight_versions"][0], strict=True)]
        for row in body["masks"]
    ]
    assert served["masks"] == expected and served["tokens"] == body["tokens"] and served["policy_step"] == 0
    assert served["token_weight_versions"] == body["token_weight_versions"]
    assert (await client.get("/status")).json()["stale_tokens_masked"] == {"math_0": 4}  # position 4 of each
    metrics = (await client.get("/metrics")).text
    assert 'rollbuf_tokens_stale_masked_total{env="math_0"} 4.0' in metrics
    again = await client.get("/batch?step=3")
    assert again.content == first.content
    binary = [await client.get("/batch?step=3", headers={"Accept": MSGPACK}) for _ in range(2)]
    assert binary[0].content == binary[1].content
    [rec] = decode_batch(binary[0].content)
    assert [m.tolist() for m in rec.split(rec.masks)] == expected
    assert (await client.get("/status")).json()["stale_tokens_masked"] == {"math_0": 4}  # counted once
