"""The ledger read back over HTTP, and retention on every store: retained payloads of served and dropped groups
are readable as served, byte for byte, until the bound in steps or bytes prunes them (and nothing else); the
ledger's own rows are pruned past their bounds, open fates never; with the ledger off nothing is written."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.ledger.rules import RETAINED, LedgerSettings
from api.service import Service
from api.wire.records import MSGPACK, encode_submission
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def serving(settings: Settings, **update: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Service]]:
    app = create_app(settings.model_copy(update=update))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app.state.service


async def start(c: httpx.AsyncClient) -> None:
    assert (await c.post("/register", json=registration(batch_size=8, drop_zero_variance=True))).status_code == 200
    await c.get("/batch", params={"step": 0})
    assert (await c.post("/register-env", json=env("math", group_size=4))).status_code == 200


async def post(c: httpx.AsyncClient, gid: str, **fields: Any) -> dict[str, Any]:
    body = group(4, seed=sum(map(ord, gid)), group_id=gid, **fields)
    assert (await c.post("/scored_data", json=body)).status_code == 200
    return body


async def row(c: httpx.AsyncClient, gid: str, data: bool = True) -> dict[str, Any]:
    reply = await c.get(f"/ledger/groups/{gid}", params={"data": data})
    assert reply.status_code == 200, reply.text
    [only] = reply.json()["groups"]
    return only  # type: ignore[no-any-return]


async def retained_bytes(service: Service) -> int:
    return await service.store.read(lambda t: t.get_counts(RETAINED).get("bytes", 0))


async def test_retained_groups_read_back_as_served_until_their_steps_pass(settings: Settings) -> None:
    async with serving(settings, retain_steps=1) as (c, service):
        await start(c)
        sent = {gid: await post(c, gid) for gid in ("A0", "A1", "A2", "A3", "A4", "A5")}
        sent["Z/0"] = await post(c, "Z/0", scores=[1.0] * 4)  # dropped by the filter: its payload kept all the same
        served = {}
        for step in range(3):
            for g in (await c.get("/batch", params={"step": step})).json()["batch"]:
                served[g["group_id"]] = g
        assert sorted(served) == ["A0", "A1", "A2", "A3", "A4", "A5"]
        for gid in ("A0", "A3", "A5"):
            got = await row(c, gid)
            assert got["kept"] and got["data"] == served[gid], gid  # as /batch served it: tokens, masks, all
        z = await row(c, "Z/0")
        assert (z["fate"], z["reason"], z["kept"]) == ("dropped", "zero_variance", True)
        assert z["data"]["tokens"] == sent["Z/0"]["tokens"] and z["data"]["masks"] == sent["Z/0"]["masks"]
        assert await retained_bytes(service) == sum([(await row(c, g, False))["bytes"] for g in sent])

        assert await service.ledger.prune() == (5, 0)  # steps 0 and 1 are past the bound (step 3 is next), 2 is not
        for gid in ("A0", "A1", "A2", "A3", "Z/0"):
            got = await row(c, gid)
            assert (got["kept"], got["data"]) == (False, None), gid
            assert got["fate"] in ("served", "dropped")  # the row stays: only the payload went
        assert (await row(c, "A4"))["data"] == served["A4"]
        assert await retained_bytes(service) == sum([(await row(c, g, False))["bytes"] for g in ("A4", "A5")])
        assert await service.ledger.prune() == (0, 0)  # nothing more to prune


async def test_a_byte_budget_keeps_the_newest_that_fit(settings: Settings) -> None:
    async with serving(settings, retain_bytes=1) as (c, service):
        await start(c)
        for gid in ("A0", "A1", "A2", "A3"):
            await post(c, gid)
        await c.get("/batch", params={"step": 0})
        await c.get("/batch", params={"step": 1})  # batch 0 acknowledged: retained; batch 1 is still kept
        payloads, _ = await service.ledger.prune()
        assert payloads == 2  # batch 0's two groups, over the budget; batch 1's are part of a kept batch
        assert [(await row(c, g))["kept"] for g in ("A0", "A1", "A2", "A3")] == [False, False, True, True]
        assert (await row(c, "A2"))["data"] is not None


async def test_without_retention_no_payload_outlives_its_batch(settings: Settings) -> None:
    async with serving(settings) as (c, service):
        await start(c)
        for gid in ("A0", "A1", "Z"):
            await post(c, gid, **({"scores": [1.0] * 4} if gid == "Z" else {}))
        await c.get("/batch", params={"step": 0})
        await c.get("/batch", params={"step": 1})
        assert [(await row(c, g))["kept"] for g in ("A0", "Z")] == [False, False]
        ids = [(await row(c, g))["id"] for g in ("A0", "A1", "Z")]
        assert await service.store.read(lambda t: t.ledger.kept_payloads(ids)) == {}
        assert await retained_bytes(service) == 0


async def test_the_ledgers_own_rows_are_pruned_past_their_bounds(settings: Settings) -> None:
    async with serving(settings, ledger_max_groups=2, ledger_max_steps=1) as (c, service):
        await start(c)
        for gid in ("A0", "A1", "A2", "A3", "Q0", "Q1"):
            await post(c, gid)
        await c.get("/batch", params={"step": 0})
        await c.get("/batch", params={"step": 1})
        _, rows = await service.ledger.prune()
        assert rows == 4  # the served ones: Q0 and Q1 are queued, their rows stay whatever the bound
        for gid in ("A0", "A3"):
            assert (await c.get(f"/ledger/groups/{gid}")).status_code == 404
        assert (await row(c, "Q1"))["fate"] == "queued"
        assert (await c.get("/ledger/steps/0")).status_code == 404  # step 2 is next: only step 1's row stays
        assert (await c.get("/ledger/steps/1")).json()["groups"] == []  # its groups' rows are gone


async def test_with_the_ledger_off_nothing_is_written(settings: Settings) -> None:
    async with serving(settings, ledger=False) as (c, service):
        await start(c)
        await post(c, "A0")
        await post(c, "A1")
        assert len((await c.get("/batch", params={"step": 0})).json()["batch"]) == 2
        assert (await c.get("/ledger/groups/A0")).status_code == 404
        assert (await c.get("/ledger/steps/0")).status_code == 404
        assert await service.store.read(lambda t: t.ledger.scan(-1, 10)) == []


async def test_retention_turned_off_lets_go_of_what_it_kept(settings: Settings) -> None:
    async with serving(settings, retain_steps=100) as (c, service):
        await start(c)
        for gid in ("A0", "A1", "A2", "A3"):
            await post(c, gid)
        await c.get("/batch", params={"step": 0})
        await c.get("/batch", params={"step": 1})
        assert await service.ledger.prune() == (0, 0)  # within 100 steps
        service.ledger.settings = LedgerSettings()  # as a restart without retain_steps would have it
        assert await service.ledger.prune() == (2, 0)  # batch 0's; batch 1 is still kept for serving again
        assert [(await row(c, g))["kept"] for g in ("A0", "A1", "A2", "A3")] == [False, False, True, True]
        assert (await row(c, "A2"))["data"] is not None
        assert await retained_bytes(service) == sum([(await row(c, g, False))["bytes"] for g in ("A2", "A3")])


async def test_a_plain_atropos_trainer_acknowledges_what_it_asked_past(settings: Settings) -> None:
    """An Atropos trainer loops on `GET /batch` (next mode, no `step`): asking for batch N+1 acknowledges N, so
    `retain_bytes` bounds what is kept (it kept every served payload: committed_step stayed 0)."""
    async with serving(settings, retain_bytes=1) as (c, service):
        assert (await c.post("/register", json=registration(batch_size=8))).status_code == 200
        assert (await c.get("/batch")).json()["batch"] is None  # the run starts
        assert (await c.post("/register-env", json=env("math", group_size=4))).status_code == 200
        for gid in ("A0", "A1", "A2", "A3", "A4", "A5"):
            await post(c, gid)
        for _ in range(3):
            assert len((await c.get("/batch")).json()["batch"]) == 2
        assert (await c.get("/status")).json()["committed_step"] == 2  # asking for batch 2 acknowledged 0 and 1
        assert await service.ledger.prune() == (
            4,
            0,
        )  # batches 0 and 1, over the budget; batch 2 is not acknowledged yet
        assert [(await row(c, g))["kept"] for g in ("A0", "A3", "A4", "A5")] == [False, False, True, True]
        assert await retained_bytes(service) == sum([(await row(c, g, False))["bytes"] for g in ("A4", "A5")])


async def test_a_step_beyond_64_bits_is_refused_on_every_store(settings: Settings) -> None:
    async with serving(settings) as (c, _):
        await start(c)
        assert (await c.get(f"/ledger/steps/{2**63 - 1}")).status_code == 404
        for step in (2**63, 2**64, 10**30):
            reply = await c.get(f"/ledger/steps/{step}")
            assert reply.status_code == 422, (step, reply.text)  # was 500 on SQLite
            assert reply.json()["detail"][0]["loc"] == ["path", "step"]


async def test_the_ledger_and_the_export_name_each_groups_producer(settings: Settings) -> None:
    """A group's `producer_id` (JSON or msgpack) is kept in its ledger row, read back by /ledger and the export's
    groups table; it is not served to the trainer, and a group without one (an Atropos handler's) has null."""
    async with serving(settings) as (c, _):
        await start(c)
        await post(c, "J", producer_id="host-1-abc")
        binary = encode_submission(**group(4, seed=2, group_id="B", producer_id="h\u00f4te-2"))
        assert (await c.post("/scored_data", content=binary, headers={"Content-Type": MSGPACK})).status_code == 200
        await post(c, "N")
        for body, headers in [
            (orjson.dumps(group(4, seed=3, producer_id="bad\x00id")), {"Content-Type": "application/json"}),
            (encode_submission(**group(4, seed=3, producer_id="")), {"Content-Type": MSGPACK}),
        ]:
            refused = await c.post("/scored_data", content=body, headers=headers)
            assert refused.status_code == 422 and "producer_id" in refused.text, refused.text
        producers = {"J": "host-1-abc", "B": "h\u00f4te-2", "N": None}
        assert {gid: (await row(c, gid, False))["producer_id"] for gid in producers} == producers
        served = (await c.get("/batch", params={"step": 0})).json()["batch"]
        assert served and not any("producer_id" in g for g in served)
        step = (await c.get("/ledger/steps/0")).json()
        assert {g["group_id"]: g["producer_id"] for g in step["groups"]} == {
            g["group_id"]: producers[g["group_id"]] for g in served
        }
        exported = await c.get("/export", params={"table": "groups"})
        assert exported.status_code == 200, exported.text
        groups = pq.read_table(io.BytesIO(exported.content)).to_pylist()
        assert {g["group_id"]: g["producer_id"] for g in groups} == producers
