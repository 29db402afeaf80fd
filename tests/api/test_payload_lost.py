"""A queued group whose payload bytes the SQLite store lost (a segment's tail after a power loss under
`synchronous=NORMAL`) is dropped as `payload_lost`, logged and counted, and formation goes on with the rest; a
kept batch whose bytes were lost since is refused with a 500 that names it, and a later step moves on; a
retained payload lost is answered by GET /ledger as `data_lost` and left out of the export, beside the rest."""

from __future__ import annotations

import io
import logging
import sqlite3
from pathlib import Path

import httpx
import pytest

from api.config.settings import Settings
from api.store.sqlite.segments import segment_dir
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient) -> None:
    assert (await c.post("/register", json=registration(batch_size=8))).status_code == 200
    await c.get("/batch", params={"step": 0})
    assert (await c.post("/register-env", json=env("math", group_size=4))).status_code == 200


async def post(c: httpx.AsyncClient, gid: str, seed: int) -> None:
    body = group(4, length=256, seed=seed, group_id=gid)
    assert (await c.post("/scored_data", json=body)).status_code == 200


def lose(db: Path, nth: int) -> tuple[int, int, int]:
    """Overwrite the segment bytes of the `nth` payload stored, as a power loss can leave them; its item,
    segment and offset."""
    with sqlite3.connect(db) as conn:
        item, segment, pos = conn.execute(
            "SELECT item_id, segment, pos FROM payloads ORDER BY item_id LIMIT 1 OFFSET ?", (nth,)
        ).fetchone()
    assert segment is not None, "the payload is in a segment"
    with open(segment_dir(db) / f"{segment:08d}.seg", "r+b") as f:
        f.seek(pos)
        f.write(b"\0" * 64)
    return item, segment, pos


async def fate(c: httpx.AsyncClient, gid: str) -> tuple[str, str | None]:
    [row] = (await c.get(f"/ledger/groups/{gid}")).json()["groups"]
    return row["fate"], row["reason"]


async def test_a_lost_payload_is_dropped_and_a_batch_forms_of_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "rollbuf.db"
    async with serving(Settings(store=f"sqlite:///{db}")) as c:
        await start(c)
        for seed, gid in enumerate("ABC"):
            await post(c, gid, seed)
        item, segment, pos = lose(db, 0)
        with caplog.at_level(logging.ERROR, logger="rollbuf"):
            reply = await c.get("/batch", params={"step": 0})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["batch"]) == 2
        fates = [await fate(c, gid) for gid in "ABC"]
        assert fates == [("dropped", "payload_lost"), ("served", None), ("served", None)]
        status = (await c.get("/status")).json()
        assert status["dropped"] == {"math_0": {"payload_lost": 1}} and status["queue_size"] == 0
        [logged] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert f"item {item}" in logged and f"{segment:08d}.seg" in logged and f"at {pos} " in logged
        await post(c, "D", 3)  # nothing stuck: the next batch forms as ever
        await post(c, "E", 4)
        assert len((await c.get("/batch", params={"step": 1})).json()["batch"]) == 2


async def test_a_kept_batch_with_a_lost_payload_is_refused_by_name_and_a_later_step_moves_on(tmp_path: Path) -> None:
    db = tmp_path / "rollbuf.db"
    async with serving(Settings(store=f"sqlite:///{db}")) as c:
        await start(c)
        for seed, gid in enumerate("AB"):
            await post(c, gid, seed)
        assert (await c.get("/batch", params={"step": 0})).status_code == 200
        item, _, _ = lose(db, 1)
        again = await c.get("/batch", params={"step": 0})
        assert again.status_code == 500
        message = again.json()["message"]
        assert "batch 0 cannot be served again" in message and f"[{item}]" in message and "batch 1" in message
        for seed, gid in enumerate("CD", start=2):
            await post(c, gid, seed)
        assert len((await c.get("/batch", params={"step": 1})).json()["batch"]) == 2


async def test_a_lost_retained_payload_is_named_by_the_ledger_and_left_out_of_the_export(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    db = tmp_path / "rollbuf.db"
    async with serving(Settings(store=f"sqlite:///{db}", retain_steps=10)) as c:
        await start(c)
        for seed, gid in enumerate("AB"):
            await post(c, gid, seed)
        assert len((await c.get("/batch", params={"step": 0})).json()["batch"]) == 2
        assert (await c.get("/batch", params={"step": 1})).status_code == 200  # batch 0 acknowledged: retained
        item, _, _ = lose(db, 0)
        with caplog.at_level(logging.WARNING, logger="rollbuf.ledger"):
            step = await c.get("/ledger/steps/0", params={"data": "true"})
        assert step.status_code == 200, step.text
        rows = {g["group_id"]: g for g in step.json()["groups"]}
        assert rows["A"]["data"] is None and rows["A"]["data_lost"] is True
        assert rows["B"]["data"] is not None and rows["B"].get("data_lost") is None
        assert f"[{item}]" in caplog.text
        [named] = (await c.get("/ledger/groups/B", params={"data": "true"})).json()["groups"]
        assert named["data"] is not None
        exported = await c.get("/export", params={"table": "sequences"})
        assert exported.status_code == 200
        sequences = pq.read_table(io.BytesIO(exported.content)).to_pylist()
        assert {s["group_id"] for s in sequences} == {"B"} and len(sequences) == 4
