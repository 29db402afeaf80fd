"""RolloutClient: retry logic against scripted transports, then every call against the real app in-process
(both stores) and a real server process (the sync twin)."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

import httpx
import orjson
import pytest

from api.wire.records import MSGPACK, decode_batch
from api.wire.replay import ReusePolicy
from api.wire.schema import ScoredData
from rollout_client import Rejected, RetriesExhausted, RolloutClient, SyncRolloutClient, Unavailable
from rollout_client.client import encode_json
from tests.factories import group, registration
from tests.servers import running_server

pytestmark = pytest.mark.anyio


def scripted(replies: list[httpx.Response | Exception], seen: list[httpx.Request]) -> RolloutClient:
    """A client whose transport answers `replies` in order (an exception is raised as the transport's)."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://localhost")
    return RolloutClient(http_client=http, retry_deadline=5.0, prefer_binary=False)


def _group_id(request: httpx.Request) -> str:
    raw = request.content
    body = gzip.decompress(raw) if request.headers.get("content-encoding") == "gzip" else raw
    return str(ScoredData.model_validate_json(body).group_id)


async def test_submit_retries_503_and_connection_errors_with_one_group_id() -> None:
    seen: list[httpx.Request] = []
    busy = httpx.Response(503, json={"detail": "queue full", "code": "unavailable"}, headers={"Retry-After": "0"})
    replies: list[httpx.Response | Exception] = [
        busy,
        httpx.ConnectError("refused"),
        httpx.Response(200, json={"status": "received"}),
    ]
    async with scripted(replies, seen) as client:
        reply = await client.submit(ScoredData.model_validate(group(4, env_id=0)))
    assert reply.status == "received"
    assert len(seen) == 3
    assert len({_group_id(r) for r in seen}) == 1, "every retry carries the same group id"


async def test_submit_list_retries_503_with_each_groups_id_chosen_once() -> None:
    seen: list[httpx.Request] = []
    busy = httpx.Response(503, json={"detail": "queue full", "code": "unavailable"}, headers={"Retry-After": "0"})
    done = httpx.Response(200, json={"status": "received", "groups_processed": 2, "duplicates": 1, "duplicate_at": [1]})
    async with scripted([busy, httpx.ConnectError("refused"), done], seen) as client:
        client.env_id = 3
        groups = [ScoredData.model_validate(group(4, env_id=None, seed=i)) for i in range(2)]
        reply = await client.submit_list(groups)
        client.env_id = None  # registered by hand: nothing to disconnect
    assert reply.duplicate_at == [1] and len(seen) == 3
    bodies = [orjson.loads(gzip.decompress(r.content)) for r in seen]
    assert {r.url.path for r in seen} == {"/scored_data_list"}
    assert all(b == bodies[0] for b in bodies), "every retry sends the same ids"
    assert [g["env_id"] for g in bodies[0]] == [3, 3] and len({g["group_id"] for g in bodies[0]}) == 2


async def test_submit_list_can_leave_a_503_to_its_caller() -> None:
    """`retry_unavailable=False` (the runner's lists): a full queue's 503 is raised at once, for the groups to
    go alone; a connection error is still retried."""
    seen: list[httpx.Request] = []
    busy = httpx.Response(503, json={"detail": "queue full", "code": "queue_full"}, headers={"Retry-After": "1"})
    async with scripted([httpx.ConnectError("refused"), busy], seen) as client:
        groups = [ScoredData.model_validate(group(4, env_id=0, seed=i)) for i in range(2)]
        with pytest.raises(Unavailable) as info:
            await client.submit_list(groups, retry_unavailable=False)
    assert info.value.status == 503 and len(seen) == 2


async def test_4xx_is_not_retried_and_names_the_field() -> None:
    seen: list[httpx.Request] = []
    detail = [{"loc": ["body", "masks", 0], "msg": "masks[0] has 7 entries but tokens[0] has 8", "type": "value_error"}]
    async with scripted([httpx.Response(422, json={"detail": detail, "code": "invalid"})], seen) as client:
        with pytest.raises(Rejected, match=r"body\.masks\.0: masks\[0\] has 7 entries") as info:
            await client.submit(ScoredData.model_validate(group(4, env_id=0)))
    assert info.value.status == 422 and len(seen) == 1


async def test_retries_stop_at_the_deadline() -> None:
    seen: list[httpx.Request] = []
    busy = httpx.Response(503, json={"detail": "queue full"}, headers={"Retry-After": "0"})
    async with scripted([busy] * 1000, seen) as client:
        with pytest.raises(RetriesExhausted, match="queue full") as info:
            await client.submit(ScoredData.model_validate(group(4, env_id=0)), deadline=0.3)
    assert len(seen) >= 2
    assert isinstance(info.value.__cause__, Exception)


def test_json_bodies_are_gzipped_from_1_kib() -> None:
    small, small_headers = encode_json(ScoredData(tokens=[[1]], masks=[[1]], scores=[1.0]))
    big, big_headers = encode_json(ScoredData.model_validate(group(8, length=64, env_id=0)))
    assert "Content-Encoding" not in small_headers and orjson.loads(small)["tokens"] == [[1]]
    assert big_headers["Content-Encoding"] == "gzip"


# ----------------------------------------------------------------------------------------- the real app


async def start_trainer(http: httpx.AsyncClient, **kw: int) -> None:
    assert (await http.post("/register", json=registration(**kw))).status_code == 200
    await http.get("/batch")


async def test_register_waits_for_the_trainer_then_submits(client: httpx.AsyncClient) -> None:
    waits: list[str] = []
    rc = RolloutClient(http_client=client)
    registering = asyncio.create_task(rc.register("math", 4, on_wait=waits.append))
    while len(waits) < 2:  # it keeps waiting politely while there is no trainer
        await asyncio.sleep(0.01)
    assert not registering.done()
    assert (await client.post("/register", json=registration(batch_size=8))).status_code == 200
    while not any("first batch" in w for w in waits):
        await asyncio.sleep(0.01)
    await client.get("/batch")
    reg = await registering
    assert rc.env_id == reg.env_id == 0 and rc.binary, "the server offers msgpack and the client takes it"

    body = ScoredData.model_validate(group(4, env_id=None, group_id="g-1"))
    assert (await rc.submit(body)).status == "received"
    again = await rc.submit(body)
    assert again.duplicate, "a resubmission with the same group id is not stored twice"
    status = await rc.status()
    assert (status.self_queue_size, status.max_group_size) == (1, 4)

    rc.binary = False  # the JSON path, gzipped, stores the same thing
    await rc.submit(ScoredData.model_validate(group(4, length=64, env_id=None, group_id="g-2")))
    batch = (await client.get("/batch", headers={"Accept": MSGPACK})).content
    assert (await client.get("/status")).json()["queue_size"] == 0
    assert batch  # two groups of 4 made one batch of 8
    await rc.disconnect()
    assert rc.env_id is None


async def test_rejected_submission_names_the_field(client: httpx.AsyncClient) -> None:
    await start_trainer(client, batch_size=8, max_token_len=16)
    async with RolloutClient(http_client=client) as rc:
        await rc.register("math", 4)
        for binary in (True, False):
            rc.binary = binary
            with pytest.raises(Rejected) as info:
                await rc.submit(ScoredData.model_validate(group(4, length=32, env_id=None)))
            assert info.value.status == 422 and "tokens" in str(info.value), str(info.value)


async def test_binary_submission_keeps_every_field(client: httpx.AsyncClient) -> None:
    await start_trainer(client, batch_size=4)
    async with RolloutClient(http_client=client) as rc:
        await rc.register("math", 4)
        body = group(4, env_id=None, overrides=[{"turns": [1]}] * 4, policy_step=0)
        sent = ScoredData.model_validate({**body, "token_weight_versions": [[0] * len(t) for t in body["tokens"]]})
        await rc.submit(sent)
        [rec] = decode_batch((await client.get("/batch", headers={"Accept": MSGPACK})).content)
    assert rec.split(rec.tokens)[0].tolist() == sent.tokens[0]
    assert rec.meta["overrides"] == sent.overrides and rec.group_id is not None
    assert rec.weight_versions is not None and rec.split(rec.weight_versions)[0].tolist() == [0] * len(sent.tokens[0])


async def test_an_env_registered_with_max_token_staleness_gets_its_old_tokens_masked(
    client: httpx.AsyncClient,
) -> None:
    await start_trainer(client, batch_size=4)
    async with RolloutClient(http_client=client) as rc:
        await rc.register("math", 4, max_token_staleness=0)
        await rc.submit(ScoredData.model_validate(group(4, env_id=None, seed=1)))
        assert (await client.get("/batch")).json()["batch"] is not None  # the trainer is at step 1 now
        body = group(4, length=4, env_id=None, seed=2, policy_step=0)
        body["token_weight_versions"] = [[0, 0, 0, 1]] * 4  # trained: the last two; of weights 0: the third
        await rc.submit(ScoredData.model_validate(body))
        [served] = (await client.get("/batch")).json()["batch"]
    assert [row[2:] for row in served["masks"]] == [[-100, row[3]] for row in body["masks"]]
    assert (await client.get("/status")).json()["stale_tokens_masked"] == {"math_0": 4}


async def test_an_env_sends_its_own_reuse_policy_and_none_without_one() -> None:
    seen: list[httpx.Request] = []
    info = httpx.Response(200, json={"batch_size": 8, "max_token_len": 64})
    registered = {"env_id": 0, "wandb_name": "m_0", "checkpoint_dir": "c", "starting_step": 0}
    ok = httpx.Response(200, json={**registered, "checkpoint_interval": 1, "num_steps": 1})
    bye = httpx.Response(200, json={"status": "disconnected"})
    async with scripted([info, ok, info, ok, bye], seen) as client:
        await client.register("m", 4, reuse=ReusePolicy(max_served=1))
        await client.register("m", 4)
    sent = [orjson.loads(r.content) for r in seen if r.url.path == "/register-env"]
    assert sent[0]["reuse"] == {"max_served": 1, "max_reused_share": 0.5, "order": "oldest"}
    assert "reuse" not in sent[1]


def test_sync_twin_against_a_server_process(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server:
        with httpx.Client(base_url=server.url) as http:
            http.post("/register", json=registration(batch_size=8))
            http.get("/batch")
        with SyncRolloutClient(server.url) as rc:
            reg = rc.register("math", 4)
            assert rc.submit(ScoredData.model_validate(group(4, env_id=None))).status == "received"
            assert rc.status().self_queue_size == 1
            env_id = reg.env_id
        with httpx.Client(base_url=server.url) as http:
            body = http.post("/disconnect-env", json={"env_id": env_id}).json()
            assert body["status"] == "success"  # disconnecting is idempotent; the client did it on exit


async def test_a_turn_is_posted_retried_as_a_duplicate_and_refused_once_its_lease_passed(
    client: httpx.AsyncClient,
) -> None:
    await start_trainer(client, batch_size=4)
    async with RolloutClient(http_client=client) as rc:
        await rc.register("math", 2)
        spec = {"group_id": "t", "env_id": rc.env_id, "producer_id": "p1", "group_size": 2, "deadline_s": 60}
        assert (await client.post("/rollouts/open", json=spec)).status_code == 200
        first = await rc.post_turn("t", 0, "p1", 0, [1, 2], [-100, 2], tool_results=[{"ok": True}], snapshot=b"\x00st")
        assert (first.status, first.turns, first.tokens) == ("accepted", 1, 2)
        again = await rc.post_turn("t", 0, "p1", 0, [1, 2], [-100, 2], tool_results=[{"ok": True}], snapshot=b"\x00st")
        assert again.status == "duplicate"
        assert (await rc.post_turn("t", 0, "p1", 1, [3], [3], snapshot="s3://bucket/t-0-1")).turns == 2
        read = (await client.get("/rollouts/turns", params={"group_id": "t", "slot": 0})).json()
        assert read["items"][0]["tool_results"] == [{"ok": True}]
        assert read["snapshot"]["uri"] == "s3://bucket/t-0-1", "the last snapshot"
        with pytest.raises(Rejected) as refused:
            await rc.post_turn("t", 0, "p2", 2, [4], [4])
        assert refused.value.status == 409 and "held by producer 'p1'" in str(refused.value)
