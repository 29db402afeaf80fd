"""The binary path: msgpack ingest and batches beside JSON, with the same rules, replies and errors."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections import Counter
from dataclasses import replace
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from api.app import create_app
from api.config.settings import Settings
from api.store.base import ItemMeta, QueuedItem, Txn
from api.wire.records import (
    MSGPACK,
    decode,
    decode_batch,
    encode,
    encode_submission,
    encode_submission_list,
    split_records,
)
from tests.api.test_ingest import queued, start
from tests.factories import group

pytestmark = pytest.mark.anyio

BIN = {"Content-Type": MSGPACK}


def packed(**kw: Any) -> bytes:
    """A factory group (JSON shape) encoded for the binary path."""
    return encode_submission(**group(**kw))


def as_map(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)  # type: ignore[no-any-return]


def with_field(data: bytes, name: str, value: Any) -> bytes:
    m = as_map(data)
    m[name] = value
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


async def test_binary_group_is_served_like_the_json_one(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=8)
    body = group(4, length=[5, 9, 3, 7], env_id=0, seed=1, group_id="j", messages=[[{"role": "u", "content": "x"}]] * 4)
    r = await client.post("/scored_data", json=body)
    assert r.json() == {"status": "received"}
    r = await client.post("/scored_data", content=encode_submission(**{**body, "group_id": "b"}), headers=BIN)
    assert r.status_code == 200 and r.json() == {"status": "received"}, r.text
    from_json, from_binary = (await client.get("/batch")).json()["batch"]
    assert from_binary == {**from_json, "group_id": "b"}


async def test_canonical_records_are_stored_and_served_as_sent(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=8)
    sent = [packed(n=4, env_id=0, seed=i, policy_step=0, group_id=f"g{i}") for i in range(2)]
    r = await client.post("/scored_data_list", content=encode_submission_list(sent), headers=BIN)
    assert r.json() == {"status": "received", "groups_processed": 2}
    r = await client.get("/batch", params={"step": 0}, headers={"Accept": MSGPACK})
    assert r.headers["content-type"] == MSGPACK and r.headers["x-rollbuf-step"] == "0"
    assert "gzip" in r.request.headers["accept-encoding"] and "content-encoding" not in r.headers  # never gzipped
    assert split_records(r.content, array=True) == sent


async def test_server_stamps_the_step_when_absent(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=4)
    assert as_map(packed(n=4, env_id=0))["policy_step"] is None
    r = await client.post("/scored_data", content=packed(n=4, env_id=0), headers=BIN)
    assert r.status_code == 200, r.text
    [rec] = decode_batch((await client.get("/batch", headers={"Accept": MSGPACK})).content)
    assert rec.policy_step == 0 and rec.env_id == 0 and rec.seqs == 4


GOOD = packed(n=4, length=8, env_id=0)
N_TOKENS = 32
BAD_RECORDS = [
    (b"\x93\x01", ["body"], "msgpack"),
    (GOOD + b"\x00", ["body"], "after the end"),
    (msgpack.packb([1, 2]), ["body"], "msgpack map"),
    (with_field(GOOD, "v", 3), ["body", "v"], "version 3 is not supported"),
    (with_field(GOOD, "env_id", 7), ["body", "env_id"], "no environment with env_id 7"),
    (with_field(GOOD, "env_id", "0"), ["body", "env_id"], "must be an integer"),
    (with_field(GOOD, "policy_step", -1), ["body", "policy_step"], ">= 0"),
    (with_field(GOOD, "group_id", ""), ["body", "group_id"], "1 to 200 characters"),
    (with_field(GOOD, "lengths", b""), ["body", "lengths"], "at least one sequence"),
    (with_field(GOOD, "lengths", np.array([8, 8, 0, 16], "<i4").tobytes()), ["body", "lengths", 2], "empty"),
    (with_field(GOOD, "lengths", np.array([8, 8, 8, 600], "<i4").tobytes()), ["body", "lengths", 3], "of 512"),
    (with_field(GOOD, "lengths", np.array([8] * 17, "<i4").tobytes()), ["body", "lengths"], "at most 16"),
    (with_field(GOOD, "tokens", [1, 2, 3]), ["body", "tokens"], "msgpack bin of little-endian int32"),
    (with_field(GOOD, "tokens", b"\x00" * 7), ["body", "tokens"], "whole number of int32"),
    (with_field(GOOD, "tokens", b"\x00" * 4 * 31), ["body", "tokens", 3], "31 values for 32 tokens"),
    (with_field(GOOD, "masks", None), ["body", "masks"], "field required"),
    (with_field(GOOD, "tokens", np.arange(-1, N_TOKENS - 1, dtype="<i4").tobytes()), ["body", "tokens", 0, 0], ">= 0"),
    (with_field(GOOD, "policy_step", 999_999), ["body", "policy_step"], "ahead of the trainer, which is at step 0"),
    (with_field(GOOD, "scores", np.zeros(3).tobytes()), ["body", "scores"], "one per sequence"),
    (with_field(GOOD, "scores", np.array([0, 1, np.nan, 0.0]).tobytes()), ["body", "scores", 2], "finite"),
    (with_field(GOOD, "advantages", np.full(N_TOKENS, np.inf, "<f4").tobytes()), ["body", "advantages"], "finite"),
    (
        with_field(GOOD, "inference_logprobs", np.zeros(3, "<f4").tobytes()),
        ["body", "inference_logprobs", 0],
        "gets 3 of its 8",
    ),
    (with_field(GOOD, "meta", [1]), ["body", "meta"], "msgpack map"),
    (
        with_field(GOOD, "meta", {"messages": [[{"role": "user"}]]}),
        ["body", "meta", "messages"],
        "'role' and 'content'",
    ),
    (with_field(GOOD, "meta", {"distill_token_ids": [[[1]]] * 3}), ["body", "meta", "distill_token_ids"], "need one"),
    (with_field(GOOD, "meta", {"images": b"\x89PNG"}), ["body", "meta", "images"], "bytes (msgpack bin) cannot"),
    (
        with_field(GOOD, "meta", {"generation_params": {"t": msgpack.ExtType(5, b"x")}}),
        ["body", "meta", "generation_params", "t"],
        "ExtType cannot be served as JSON",
    ),
    (with_field(GOOD, "meta", {"images": [float("nan")]}), ["body", "meta", "images", 0], "finite"),
    (
        with_field(GOOD, "meta", {"distill_token_ids": [[[0] * 1025] + [[0]] * 7] + [[[0]] * 8] * 3}),
        ["body", "meta", "distill_token_ids", 0],
        "1025 candidates at one position; at most 1024",
    ),
]


@pytest.mark.parametrize(("data", "loc", "msg"), BAD_RECORDS)
async def test_bad_record_is_422_naming_field_and_rule(
    client: httpx.AsyncClient, data: bytes, loc: list[Any], msg: str
) -> None:
    await start(client)
    r = await client.post("/scored_data", content=data, headers=BIN)
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == loc and msg in err["msg"], err
    assert await queued(client) == 0


async def test_list_is_all_or_nothing_and_names_the_group(client: httpx.AsyncClient) -> None:
    await start(client)
    bad = with_field(GOOD, "scores", np.zeros(2).tobytes())
    body = encode_submission_list([packed(n=4, env_id=0, seed=i) for i in range(3)] + [bad])
    r = await client.post("/scored_data_list", content=body, headers=BIN)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", 3, "scores"]
    assert await queued(client) == 0


async def test_idempotency_by_group_id_and_header(client: httpx.AsyncClient) -> None:
    await start(client)
    body = packed(n=4, env_id=0, group_id="abc")
    assert (await client.post("/scored_data", content=body, headers=BIN)).json() == {"status": "received"}
    again = await client.post("/scored_data", content=body, headers=BIN)
    assert again.json() == {"status": "received", "duplicate": True}
    pair = encode_submission_list([body, packed(n=4, env_id=0, group_id="def")])
    r = await client.post("/scored_data_list", content=pair, headers=BIN)
    assert r.json() == {"status": "received", "groups_processed": 2, "duplicates": 1, "duplicate_at": [0]}
    for seed in (1, 1, 2):  # the same group under one key is a duplicate; another group under it, a 409
        r = await client.post(
            "/scored_data", content=packed(n=4, env_id=0, seed=seed), headers={**BIN, "Idempotency-Key": "k"}
        )
        assert r.status_code == (409 if seed == 2 else 200)
    assert await queued(client) == 3


async def test_gzip_bodies(client: httpx.AsyncClient) -> None:
    await start(client)
    headers = {**BIN, "Content-Encoding": "gzip"}
    r = await client.post("/scored_data", content=gzip.compress(packed(n=4, env_id=0)), headers=headers)
    assert r.status_code == 200, r.text
    many = encode_submission_list([packed(n=4, env_id=0, seed=i) for i in range(2)])
    r = await client.post("/scored_data_list", content=gzip.compress(many), headers=headers)
    assert r.json()["groups_processed"] == 2
    assert await queued(client) == 3


async def test_side_buffer_and_503_before_registration_as_json(client: httpx.AsyncClient) -> None:
    r = await client.post("/scored_data", content=packed(n=4, env_id=None), headers=BIN)
    assert r.status_code == 503 and "Retry-After" in r.headers
    await start(client)
    r = await client.post("/scored_data", content=packed(n=2, env_id=0), headers=BIN)
    assert r.json() == {"status": "buffered", "buffer_size": 2}


async def test_info_advertises_the_binary_encoding(client: httpx.AsyncClient) -> None:
    assert MSGPACK in (await client.get("/info")).json()["content_types"]


async def test_binary_batch_replies_other_than_a_batch_are_json(client: httpx.AsyncClient) -> None:
    accept = {"Accept": MSGPACK}
    r = await client.get("/batch", headers=accept)
    assert r.headers["content-type"] == "application/json" and r.json()["status"] == "error"
    await start(client, batch_size=8)
    r = await client.get("/batch", params={"step": 0, "wait": 0}, headers=accept)
    assert r.json() == {"batch": None}
    await client.post("/scored_data_list", content=encode_submission_list([GOOD, GOOD, GOOD, GOOD]), headers=BIN)
    assert len(decode_batch((await client.get("/batch", params={"step": 0}, headers=accept)).content)) == 2
    assert len(decode_batch((await client.get("/batch", params={"step": 1}, headers=accept)).content)) == 2
    r = await client.get("/batch", params={"step": 0}, headers=accept)
    assert r.status_code == 410 and "no longer available" in r.json()["detail"]


async def test_binary_rank_shares_cover_the_batch_once_and_match_json(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=16)
    lengths = [[8, 8, 8, 8], [300, 300, 300, 300], [20, 20, 20, 20], [50, 50, 50, 50]]
    groups = [packed(n=4, length=ls, seed=i, env_id=0, group_id=f"g{i}") for i, ls in enumerate(lengths)]
    await client.post("/scored_data_list", content=encode_submission_list(groups), headers=BIN)
    await client.get("/batch", params={"step": 0})
    seen: Counter[bytes] = Counter()
    for rank in range(3):
        params = {"step": 0, "rank": rank, "world_size": 3}
        share = decode_batch((await client.get("/batch", params=params, headers={"Accept": MSGPACK})).content)
        as_json = (await client.get("/batch", params=params)).json()["batch"]
        assert [r.group_id for r in share] == [g["group_id"] for g in as_json]
        for rec, g in zip(share, as_json, strict=True):
            assert [s.tolist() for s in rec.split(rec.tokens)] == g["tokens"]
            assert rec.meta.get("group_scores") == g.get("group_scores")
            for seq in rec.split(rec.tokens):
                seen[seq.tobytes()] += 1
    whole = [decode(g) for g in groups]
    assert seen == Counter(s.tobytes() for rec in whole for s in rec.split(rec.tokens))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_record(draw: st.DrawFn) -> bytes:
    """A valid record with a few keys replaced by arbitrary msgpack, or its bytes cut or flipped."""
    n = draw(st.sampled_from([4, 4, 1, 3]))
    m = as_map(packed(n=n, length=draw(st.lists(st.integers(1, 12), min_size=n, max_size=n)), env_id=0, policy_step=0))
    for key in draw(st.lists(st.sampled_from([*m, "extra"]), max_size=3)):
        m[key] = draw(msgpack_values)
    data = msgpack.packb(m, use_bin_type=True)
    if draw(st.booleans()):
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    return data  # type: ignore[no-any-return]


@hyp_settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated_record(), min_size=1, max_size=3), st.booleans(), st.integers(1, 5), st.integers(0, 4))
def test_no_server_errors_on_any_binary_body(records: list[bytes], as_list: bool, world: int, rank: int) -> None:
    async def probe() -> list[int]:
        app = create_app(Settings(store="memory://", max_batch_wait=0))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                await start(c, batch_size=4)  # a valid group of 4 forms a batch: shares get exercised too
                if as_list:
                    replies = [await c.post("/scored_data_list", content=encode_submission_list(records), headers=BIN)]
                else:
                    replies = [await c.post("/scored_data", content=r, headers=BIN) for r in records]
                replies.append(await c.get("/batch", params={"step": 0}, headers={"Accept": MSGPACK}))
                share = {"step": 0, "rank": min(rank, world - 1), "world_size": world}
                replies.append(await c.get("/batch", params=share, headers={"Accept": MSGPACK}))
                return [r.status_code for r in replies]

    for code in asyncio.run(probe()):
        assert code in (200, 422), code


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("extra", "loc", "msg"),
    [
        ({"images": nested(40)}, ["body", "images", *[0] * 32], "nested deeper than 32 levels"),
        ({"generation_params": {"seed": 10**30}}, ["body", "generation_params", "seed"], "64 bits"),
        ({"overrides": [{"s": "\\ud800"}] * 4}, ["body"], "Invalid JSON"),  # a lone surrogate: not JSON
    ],
)
async def test_json_metadata_that_json_cannot_print_back_is_refused(
    client: httpx.AsyncClient, extra: dict[str, Any], loc: list[Any], msg: str
) -> None:
    """Accepted with 200 before: then every JSON /batch holding the group answered 500, after taking it."""
    await start(client)
    body = json.dumps(group(4, length=8, env_id=0) | extra).replace("\\\\ud800", "\\ud800")
    r = await client.post("/scored_data", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    [err] = r.json()["errors"]
    assert err["loc"] == loc and msg in err["msg"], err
    assert (await client.get("/status")).json()["queue_size"] == 0
    assert (
        await client.post("/scored_data", json=group(4, length=8, env_id=0) | {"images": nested(30)})
    ).status_code == 200


async def test_a_batch_json_cannot_print_is_refused_before_the_step_moves(client: httpx.AsyncClient) -> None:
    """A group stored before ingest checked its metadata (written here straight into the store): the JSON
    /batch that would hold it fails before its transaction commits, so nothing is taken, and a msgpack
    trainer still gets the batch."""
    await start(client, batch_size=8)
    assert (await client.post("/scored_data", json=group(4, length=8, env_id=0, seed=1))).status_code == 200
    record = decode(packed(n=4, length=8, env_id=0, seed=2, policy_step=0))
    poison = encode(replace(record, meta={"images": b"\\x89PNG"}))
    service = client._transport.app.state.service  # type: ignore[attr-defined]

    def store_raw(txn: Txn) -> None:
        meta = ItemMeta(txn.next_item_id(), record.seqs, record.n_tokens, 0)
        txn.append(0, QueuedItem(meta, 1, poison))

    await service.store.transact(store_raw)
    for _ in range(2):  # the same answer every time: nothing was taken
        r = await client.get("/batch", params={"step": 0})
        assert r.status_code == 500 and "cannot be served as JSON" in r.json()["message"]
        status = (await client.get("/status")).json()
        assert (status["current_step"], status["queue_size"]) == (0, 2)
    r = await client.get("/batch", params={"step": 0}, headers={"Accept": MSGPACK})
    assert r.status_code == 200 and len(decode_batch(r.content)) == 2
    assert (await client.get("/status")).json()["current_step"] == 1
