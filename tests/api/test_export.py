"""GET /export on every store: a scripted run whose filters and staleness bound drop groups, exported as
Parquet and read back with pyarrow, `datasets`, pandas, Polars and DuckDB: the tokens and masks of every
served sequence are what /batch served, byte for byte; every acknowledged group is in the ledger's table
once, with its fate."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import datasets
import duckdb
import httpx
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.export import PARQUET
from api.wire.records import MSGPACK, decode_batch
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

Served = dict[str, list[tuple[bytes, bytes]]]
"""Per group id, per sequence: (tokens, masks) as /batch served them (int32 bytes)."""


async def post(c: httpx.AsyncClient, name: str, env_id: int, seed: int, **extra: Any) -> None:
    reply = await c.post("/scored_data", json=group(4, env_id=env_id, seed=seed, group_id=name, **extra))
    assert reply.status_code == 200, reply.text


async def batch(c: httpx.AsyncClient, served: Served) -> list[str]:
    reply = await c.get("/batch", headers={"accept": MSGPACK})
    assert reply.headers["content-type"] == MSGPACK, reply.text
    names = []
    for rec in decode_batch(reply.content):
        assert rec.group_id is not None
        pairs = zip(rec.split(rec.tokens), rec.split(rec.masks), strict=True)
        served[rec.group_id] = [(t.tobytes(), m.tobytes()) for t, m in pairs]
        names.append(rec.group_id)
    return names


async def scripted_run(c: httpx.AsyncClient) -> Served:
    """Two batches of two groups; a zero-variance group, two groups gone stale and one still queued."""
    reg = registration(batch_size=8, drop_zero_variance=True, max_staleness=0)
    assert (await c.post("/register", json=reg)).status_code == 200
    await c.get("/batch")
    for name in ("math", "code"):
        assert (await c.post("/register-env", json=env(name, 4))).status_code == 200
    served: Served = {}
    for i in range(4):
        await post(c, f"g{i}", i % 2, seed=i)
    await post(c, "zv", 0, seed=9, scores=[1.0] * 4)  # dropped at ingest: zero variance
    assert sorted(await batch(c, served)) == ["g0", "g1"]  # step 0; g2, g3 (policy step 0) are stale from step 1 on
    for i in range(2):
        await post(c, f"n{i}", i, seed=10 + i)
    assert sorted(await batch(c, served)) == ["n0", "n1"]  # step 1
    await post(c, "q0", 0, seed=20)
    return served


async def export(c: httpx.AsyncClient, table: str) -> bytes:
    reply = await c.get("/export", params={"table": table})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == PARQUET
    return reply.content


def i32(values: list[int]) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def assert_sequences_match(rows: list[dict[str, Any]], served: Served) -> None:
    by_group: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_group.setdefault(row["group_id"], []).append(row)
    for name, seqs in served.items():
        got = sorted(by_group[name], key=lambda r: r["seq"])
        assert [
            (np.asarray(r["tokens"], "<i4").tobytes(), np.asarray(r["masks"], "<i4").tobytes()) for r in got
        ] == seqs
        assert {r["fate"] for r in got} == {"served"}
    assert sorted(by_group) == ["g0", "g1", "g2", "g3", "n0", "n1", "zv"]  # kept: served and dropped, not queued
    assert {(r["group_id"], r["drop_reason"]) for r in rows if r["fate"] == "dropped"} == {
        ("g2", "stale"),
        ("g3", "stale"),
        ("zv", "zero_variance"),
    }
    assert {(r["group_id"], r["trained_step"]) for r in rows if r["fate"] == "served"} == {
        ("g0", 0),
        ("g1", 0),
        ("n0", 1),
        ("n1", 1),
    }


async def test_the_export_reads_back_as_served(settings: Settings, tmp_path: Path) -> None:
    async with serving(settings, retain_steps=100) as c:
        served = await scripted_run(c)
        data = await export(c, "sequences")
        table = pq.read_table(io.BytesIO(data))
        assert_sequences_match(table.to_pylist(), served)

        path = tmp_path / "sequences.parquet"
        path.write_bytes(data)
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
        assert_sequences_match(list(ds), served)
        frame = table.to_pandas()
        assert frame.groupby("env")["seq"].count().to_dict() == {"code_0": 12, "math_0": 16}
        assert_sequences_match(pl.read_parquet(path).to_dicts(), served)
        with duckdb.connect() as db:
            cur = db.execute("SELECT * FROM read_parquet(?)", [str(path)])
            names = [d[0] for d in cur.description]
            assert_sequences_match([dict(zip(names, row, strict=True)) for row in cur.fetchall()], served)

        groups = pq.read_table(io.BytesIO(await export(c, "groups"))).to_pylist()
        fates = {g["group_id"]: (g["fate"], g["trained_step"], g["drop_reason"]) for g in groups}
        assert len(groups) == len(fates) == 8  # every acknowledged group once
        assert fates == {
            "g0": ("served", 0, None),
            "g1": ("served", 0, None),
            "n0": ("served", 1, None),
            "n1": ("served", 1, None),
            "g2": ("dropped", None, "stale"),
            "g3": ("dropped", None, "stale"),
            "zv": ("dropped", None, "zero_variance"),
            "q0": ("queued", None, None),
        }
        steps = pq.read_table(io.BytesIO(await export(c, "steps"))).to_pylist()
        assert [s["step"] for s in steps] == [0, 1]
        assert [sorted(m["env"] for m in s["mix"]) for s in steps] == [["code_0", "math_0"]] * 2
        by_id = {g["group"]: g["group_id"] for g in groups}
        assert [sorted(by_id[i] for i in s["groups"]) for s in steps] == [["g0", "g1"], ["n0", "n1"]]


async def test_without_retention_the_ledger_is_exported_without_sequences(settings: Settings) -> None:
    """Retention off (the default): no payload outlives its fate, so the sequences table is empty, and valid."""
    async with serving(settings) as c:
        await scripted_run(c)
        sequences = pq.read_table(io.BytesIO(await export(c, "sequences")))
        assert sequences.num_rows == 0 and "tokens" in sequences.column_names
        groups = pq.read_table(io.BytesIO(await export(c, "groups"))).to_pylist()
        assert len(groups) == 8 and not any(g["kept"] for g in groups)


async def test_export_names_the_extra_when_pyarrow_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an import of an uninstalled package does
    async with serving(Settings(store="memory://")) as c:
        reply = await c.get("/export")
        assert reply.status_code == 501
        assert reply.json()["code"] == "not_installed" and "rollbuf[export]" in reply.json()["message"]
        bad = await c.get("/export", params={"table": "nope"})
        assert bad.status_code == 422 and bad.json()["errors"][0]["loc"] == ["query", "table"]


async def test_exports_at_once_are_bounded() -> None:
    """A first export held open (its client reads nothing after the first chunk) takes the one slot there is."""
    app = create_app(Settings(store="memory://", max_exports=1))
    first_chunk, release = anyio.Event(), anyio.Event()
    statuses: list[int] = []

    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await release.wait()  # then the client is gone
        return {"type": "http.disconnect"}

    async def slow_client(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif message["type"] == "http.response.body" and not first_chunk.is_set():
            first_chunk.set()
            await release.wait()

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": "/export",
        "raw_path": b"/export",
        "query_string": b"",
        "headers": [(b"host", b"localhost")],
        "client": ("127.0.0.1", 1),
        "server": ("localhost", 80),
        "scheme": "http",
        "root_path": "",
    }
    async with app.router.lifespan_context(app), anyio.create_task_group() as tg:
        tg.start_soon(app, scope, receive, slow_client)
        await first_chunk.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            second = await c.get("/export")
            assert second.status_code == 503 and "max_exports" in second.text and "Retry-After" in second.headers
            release.set()
            with anyio.fail_after(10):
                while (await c.get("/export")).status_code != 200:  # room again once the first one has ended
                    await anyio.sleep(0.01)
    assert statuses == [200]


def test_the_service_never_imports_pyarrow() -> None:
    code = "import sys, api.app, api.cli; api.app.create_app(); print('pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


async def test_a_page_of_the_export_is_bounded_by_bytes(settings: Settings) -> None:
    """A page was 256 groups' payloads whatever their size (300 groups of 1 MB images grew the server by 2.5 GB):
    a page now holds at most `page_bytes` of payloads (at least one group), and the export is the same."""
    from api.export.stream import ExportLimits, pages, parquet_stream

    app = create_app(settings.model_copy(update={"retain_steps": 100}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            served = await scripted_run(c)
            store = app.state.service.store
            small = ExportLimits(page_bytes=1)
            sizes = [len(page.payloads) async for page in pages("sequences", store, small)]
            assert max(sizes) == 1 and sum(sizes) == 7  # one payload a page: 7 pages, not one
            data = b"".join([chunk async for chunk in parquet_stream("sequences", store, small)])
            assert_sequences_match(pq.read_table(io.BytesIO(data)).to_pylist(), served)
