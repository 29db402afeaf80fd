"""The ledger row of a sealed per-rollout group names the slots that were resumed from another producer's turns
and the tokens that saved (`resumed`, `tokens_saved`; docs/ledger.md, docs/rollouts.md Lineage), through the ASGI
app on every store: on GET /ledger/groups/{id}, GET /ledger/steps/{n} and the export's `groups` table; null for a
group without a resume; never claimed by a body posted to /scored_data."""

from __future__ import annotations

import io
from typing import Any

import httpx
import msgpack
import pyarrow.parquet as pq
import pytest

from api.config.settings import Settings
from api.wire.records import encode_submission
from tests.api.test_api_rollouts import leased, opened, post, rollout, settled, start
from tests.api.test_api_turns import sent, turn
from tests.asgi import serving
from tests.factories import group

pytestmark = pytest.mark.anyio


async def ledger_row(c: httpx.AsyncClient, gid: str) -> dict[str, Any]:
    reply = await c.get(f"/ledger/groups/{gid}")
    assert reply.status_code == 200, reply.text
    [row] = reply.json()["groups"]
    return row  # type: ignore[no-any-return]


async def exported_groups(c: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """The export's `groups` table, by group id."""
    reply = await c.get("/export", params={"table": "groups"})
    assert reply.status_code == 200, reply.text
    return {r["group_id"]: r for r in pq.read_table(io.BytesIO(reply.content)).to_pylist()}


async def resumed_group(c: httpx.AsyncClient, gid: str) -> None:
    """Group `gid` of 2 slots sealed: p1 posts 2 turns of slot 0 (6 tokens) and lapses; p2 takes both slots'
    leases (slot 0 resumed with those turns, slot 1 restarted from its prompt) and finishes both."""
    await opened(c, gid, group_size=2, task="prompt")
    await sent(c, turn(gid, 0, 0))
    await sent(c, turn(gid, 0, 1))
    leases = sorted(await leased(c, "p2", 8), key=lambda x: x["slot"])
    assert [(x["slot"], x["prefix"] is None) for x in leases] == [(0, False), (1, True)]
    tail = {**turn(gid, 0, 2, producer="p2"), "score": 1.0, "after_turns": True}
    del tail["turn"]
    await post(c, tail)
    await post(c, rollout(gid, 1, producer="p2", score=0.0))
    assert (await settled(c, gid))["state"] == "sealed"


async def test_a_resumed_slot_is_named_by_its_sealed_groups_ledger_row(settings: Settings) -> None:
    """Slot 0 resumed (6 tokens carried) and slot 1 restarted: the row names slot 0 alone, wherever rows are shown,
    and keeps it through the group's batch and a restart of the server."""
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:
        await start(c, group_size=2)
        await resumed_group(c, "r1")
        row = await ledger_row(c, "r1")
        assert (row["resumed"], row["tokens_saved"], row["fate"]) == ([0], 6, "queued")
        batch = await c.get("/batch")
        assert batch.json()["batch"] is not None
        step = (await c.get("/status")).json()["current_step"] - 1
        [served] = (await c.get(f"/ledger/steps/{step}")).json()["groups"]
        assert (served["group_id"], served["fate"], served["resumed"], served["tokens_saved"]) == (
            "r1",
            "served",
            [0],
            6,
        )
        exported = (await exported_groups(c))["r1"]
        assert (exported["resumed"], exported["tokens_saved"]) == ([0], 6)
    if not settings.store.startswith("memory"):  # a memory store does not outlive its server
        async with serving(settings, rollout_sweep_every_s=3600.0) as c:
            again = await ledger_row(c, "r1")
            assert (again["resumed"], again["tokens_saved"]) == ([0], 6)


async def test_a_group_without_a_resume_has_null_in_its_ledger_row(settings: Settings) -> None:
    """A per-rollout group with a restart (a slot leased to p2 with no turn) but no resume, and a group posted
    whole: both rows say null, on GET /ledger and in the export."""
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:
        await start(c, group_size=2)
        await opened(c, "n1", group_size=2)
        await post(c, rollout("n1", 0))
        [lease] = await leased(c, "p2", 8)
        assert (lease["slot"], lease["prefix"]) == (1, None)
        await post(c, rollout("n1", 1, producer="p2", score=0.0))
        assert (await settled(c, "n1"))["state"] == "sealed"
        whole = await c.post("/scored_data", json=group(2, seed=3, group_id="w1"))
        assert whole.status_code == 200, whole.text
        for gid in ("n1", "w1"):
            row = await ledger_row(c, gid)
            assert (row["resumed"], row["tokens_saved"]) == (None, None), gid
        table = await exported_groups(c)
        assert [(table[g]["resumed"], table[g]["tokens_saved"]) for g in ("n1", "w1")] == [(None, None)] * 2


async def test_a_group_posted_whole_cannot_claim_resumes(settings: Settings) -> None:
    """Lineage fields in a /scored_data body, JSON or binary, are not the server's: the group is acknowledged as an
    Atropos group (its unknown fields ignored, as Atropos does) and its row says null. A whole group reusing a
    sealed group's id is refused (409) and leaves that group's row as it was."""
    claim = {"resumed": [0, 1], "tokens_saved": 99, "lineage": {"0": {"resumes": 1, "saved": 99}}}
    async with serving(settings, rollout_lease_s=0.001, rollout_sweep_every_s=3600.0) as c:
        await start(c, group_size=2)
        sent_json = await c.post("/scored_data", json={**group(2, seed=4, group_id="f1"), **claim})
        assert sent_json.json() == {"status": "received"}, sent_json.text
        record = msgpack.unpackb(encode_submission(**group(2, seed=5, group_id="f2")), raw=False)
        body = msgpack.packb({**record, **claim}, use_bin_type=True)
        sent_binary = await c.post("/scored_data", content=body, headers={"Content-Type": "application/msgpack"})
        assert sent_binary.json() == {"status": "received"}, sent_binary.text
        for gid in ("f1", "f2"):
            row = await ledger_row(c, gid)
            assert (row["resumed"], row["tokens_saved"]) == (None, None), gid
        await resumed_group(c, "r2")
        again = await c.post("/scored_data", json={**group(2, seed=6, group_id="r2"), **claim})
        assert again.status_code == 409, again.text
        row = await ledger_row(c, "r2")
        assert (row["resumed"], row["tokens_saved"], row["producer_id"]) == ([0], 6, "p1")
