"""Tasks leased from rollbuf through the ASGI app on every store (docs/tasks.md): a dataset registered inline,
in pages or from a file; leases, heartbeats and failures; a group sent under a lease marks its task submitted,
then trained in its batch's step; the views (/tasks, /tasks/rows, /status, /metrics) and the bounds."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.tasks import leases as tl
from api.tasks.records import Dataset
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(c: httpx.AsyncClient, batch_size: int = 4) -> None:
    assert (await c.post("/register", json=registration(batch_size=batch_size))).status_code == 200
    await c.get("/batch")
    assert (await c.post("/register-env", json=env(group_size=4))).status_code == 200


async def lease(c: httpx.AsyncClient, n: int, producer: str = "p1") -> dict:  # type: ignore[type-arg]
    reply = await c.post("/tasks/lease", json={"dataset": "math", "producer_id": producer, "n": n})
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def test_leased_tasks_are_submitted_then_trained_in_their_step(settings: Settings) -> None:
    async with serving(settings) as c:
        await start(c)
        spec = {"name": "math", "tasks": [{"q": i} for i in range(3)], "max_retries": 1, "env": "math"}
        made = await c.post("/tasks/datasets", json=spec)
        assert made.status_code == 200, made.text
        assert (made.json()["size"], made.json()["sealed"]) == (3, True)
        assert (await c.post("/tasks/datasets", json=spec)).status_code == 200, "a retry is answered as the first"
        assert (await c.post("/tasks/datasets", json={**spec, "seed": 1})).status_code == 409
        first = await lease(c, 2)
        assert [x["task"] for x in first["leases"]] == [{"q": 0}, {"q": 1}] and not first["done"]
        a, b = (x["token"] for x in first["leases"])
        beat = await c.post("/tasks/heartbeat", json={"tokens": [a, "task:math:0:2:9"]})
        assert beat.json()["expires_at"]["task:math:0:2:9"] is None and beat.json()["expires_at"][a] is not None
        assert (await c.post("/tasks/fail", json={"token": b, "reason": "env crashed"})).json() == {"accepted": True}
        assert (await c.post("/tasks/fail", json={"token": b, "reason": "again"})).json() == {"accepted": False}
        second = await lease(c, 5)
        assert [x["index"] for x in second["leases"]] == [1, 2], "the failed task is retried first"
        tokens = [a] + [x["token"] for x in second["leases"]]
        for i, token in enumerate(tokens):
            sent = await c.post("/scored_data", json=group(4, seed=i, group_id=token))
            assert sent.status_code == 200, sent.text
        assert (await c.get("/batch")).json()["batch"] is not None
        [view] = (await c.get("/tasks")).json()
        assert view["counts"] == {"served": 1, "submitted": 2, "retried": 1}, "trained once acknowledged"
        assert (await lease(c, 1))["done"] is False, "submitted tasks may still be dropped and retried"
        await c.get("/batch")
        await c.get("/batch")
        assert (await c.get("/tasks")).json()[0]["counts"] == {"trained": 2, "served": 1, "retried": 1}
        await c.get("/batch")  # asking for the next batch acknowledges the last
        status = (await c.get("/status")).json()
        assert status["tasks"][0]["counts"] == {"trained": 3, "retried": 1} and status["tasks"][0]["done"]
        rows = (await c.get("/tasks/rows", params={"dataset": "math", "limit": 2})).json()
        assert [(r["index"], r["state"], r["step"]) for r in rows["tasks"]] == [(0, "trained", 0), (1, "trained", 1)]
        rest = await c.get("/tasks/rows", params={"dataset": "math", "after_epoch": 0, "after_index": 1})
        assert [r["index"] for r in rest.json()["tasks"]] == [2] and rest.json()["next"] is None
        assert rows["tasks"][1]["reason"] == "failed: env crashed" and rows["tasks"][1]["retries"] == 1
        exported = await c.get("/export", params={"table": "tasks"})
        table = pq.read_table(io.BytesIO(exported.content)).to_pylist()
        assert [(t["index"], t["state"], t["step"], t["retries"]) for t in table] == [
            (0, "trained", 0, 0),
            (1, "trained", 1, 1),
            (2, "trained", 2, 0),
        ]
        assert {t["group"] for t in table} == {r["ledger_id"] for r in rows["tasks"] + rest.json()["tasks"]}
        metrics = (await c.get("/metrics")).text
        assert 'rollbuf_tasks{dataset="math",state="trained"} 3.0' in metrics
        assert 'rollbuf_task_events_total{dataset="math",event="retried"} 1.0' in metrics


async def test_with_commit_mode_a_task_is_trained_once_its_step_is_committed(settings: Settings) -> None:
    async with serving(settings) as c:
        assert (await c.post("/register", json=registration(batch_size=4, acknowledge="commit"))).status_code == 200
        assert (await c.get("/batch", params={"step": 0})).json() == {"batch": None}
        assert (await c.post("/register-env", json=env(group_size=4))).status_code == 200
        assert (await c.post("/tasks/datasets", json={"name": "math", "tasks": [0, 1]})).status_code == 200
        for i, x in enumerate((await lease(c, 2))["leases"]):
            sent = await c.post("/scored_data", json=group(4, seed=i, group_id=x["token"]))
            assert sent.status_code == 200, sent.text
        for step in (0, 1):
            assert (await c.get("/batch", params={"step": step})).json()["batch"] is not None
        assert (await c.get("/tasks")).json()[0]["counts"] == {"served": 2}
        assert (await c.get("/batch", params={"step": 0})).json()["batch"] is not None, "served again: same step"
        assert (await c.post("/commit", json={"step": 1})).status_code == 200
        [view] = (await c.get("/tasks")).json()
        assert view["counts"] == {"trained": 1, "served": 1} and view["done"], "done: every task is in a batch"
        rows = (await c.get("/tasks/rows", params={"dataset": "math"})).json()["tasks"]
        assert [(r["state"], r["step"]) for r in rows] == [("trained", 0), ("served", 1)]
        assert (await c.post("/commit", json={"step": 2})).status_code == 200
        assert (await c.get("/tasks")).json()[0]["counts"] == {"trained": 2}


async def test_pages_files_and_bounds(settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text("".join(f'{{"q": {i}}}\n' for i in range(7)) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\nnot json\n')
    async with serving(settings, task_files_dir=tmp_path, task_page_size=3, task_max_leases_per_producer=2) as c:
        await start(c)
        read = await c.post("/tasks/datasets", json={"name": "file", "path": "d.jsonl", "order": "shuffled"})
        assert (read.json()["size"], read.json()["sealed"]) == (7, True), read.text
        outside = await c.post("/tasks/datasets", json={"name": "x", "path": "../../etc/passwd"})
        assert outside.status_code == 422
        bad = await c.post("/tasks/datasets", json={"name": "bad", "path": "bad.jsonl"})
        assert bad.status_code == 422 and "task 1 is not JSON" in bad.text
        assert (await c.post("/tasks/datasets", json={"name": "math", "tasks": [1, 2], "last": False})).is_success
        assert (
            await c.post("/tasks/pages", json={"dataset": "math", "first": 2, "tasks": [1, 2, 3, 4]})
        ).status_code == 422
        past = await c.post("/tasks/pages", json={"dataset": "math", "first": 5, "tasks": [3]})
        assert past.status_code == 409 and past.json()["errors"][0]["loc"] == ["body", "first"], past.text
        missing = await c.post("/tasks/datasets", json={"name": "y", "path": "no-such.jsonl"})
        assert missing.status_code == 404 and missing.json()["errors"][0]["loc"] == ["body", "path"]
        assert (await c.post("/tasks/pages", json={"dataset": "nope", "first": 0, "tasks": [3]})).status_code == 404
        assert len((await lease(c, 5))["leases"]) == 2, "the cursor waits at the pages stored so far"
        page = await c.post("/tasks/pages", json={"dataset": "math", "first": 2, "tasks": [3], "last": True})
        assert page.json()["size"] == 3 and page.json()["sealed"]
        assert (await lease(c, 5))["leases"] == [], "a producer holds at most task_max_leases_per_producer"
        assert [x["task"] for x in (await lease(c, 5, producer="p2"))["leases"]] == [3]
        shuffled = await c.post("/tasks/lease", json={"dataset": "file", "producer_id": "p3", "n": 2})
        assert all(0 <= x["index"] < 7 for x in shuffled.json()["leases"])
        assert (await c.post("/tasks/lease", json={"dataset": "nope", "producer_id": "p"})).status_code == 404
        assert (await c.post("/tasks/fail", json={"token": "not-a-token"})).json() == {"accepted": False}


async def test_a_file_another_process_reads_is_a_409_until_its_claim_lapses(settings: Settings, tmp_path: Path) -> None:
    """A registration in another server process (a worker, a replica) reading the file holds a claim in the store:
    the same registration here is a 409 saying how far it got, and goes on from there once the claim lapsed (its
    reader died)."""
    (tmp_path / "d.jsonl").write_text("".join(f'{{"q": {i}}}\n' for i in range(7)))
    app = create_app(settings.model_copy(update={"task_files_dir": tmp_path, "task_page_size": 3}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            store = app.state.service.store
            body = {"name": "file", "path": "d.jsonl"}
            await store.transact(lambda txn: tl.register(txn, Dataset(name="file", sealed=False)))
            await store.transact(
                lambda txn: tl.add_tasks(txn, "file", 0, ['{"q": 0}', '{"q": 1}', '{"q": 2}'], last=False)
            )
            await store.transact(lambda txn: tl.claim_reading(txn, "file", "elsewhere", time.time()))
            busy = await c.post("/tasks/datasets", json=body)
            assert busy.status_code == 409 and "3 tasks stored so far" in busy.text, busy.text
            lapsed = time.time() - tl.READ_CLAIM_S - 1  # claimed that long ago, never renewed: its reader died
            await store.transact(lambda txn: txn.set_value(tl.READING + "file", json.dumps(["elsewhere", lapsed])))
            done = await c.post("/tasks/datasets", json=body)
            assert (done.json()["size"], done.json()["sealed"]) == (7, True), done.text
            tasks = []
            for _ in range(3):  # a page (task_page_size) a lease
                leased = await c.post("/tasks/lease", json={"dataset": "file", "producer_id": "p", "n": 3})
                tasks += [x["task"] for x in leased.json()["leases"]]
            assert tasks == [{"q": i} for i in range(7)], "each line once, at its index"
            assert await store.read(lambda txn: txn.get_value(tl.READING + "file")) is None, "a claim left behind"


async def test_a_server_without_files_or_ledger_refuses(settings: Settings) -> None:
    async with serving(settings, ledger=False) as c:
        assert (await c.post("/tasks/datasets", json={"name": "math", "tasks": []})).status_code == 409
    async with serving(settings) as c:
        assert (await c.post("/tasks/datasets", json={"name": "m", "path": "x.jsonl"})).status_code == 409
        assert (await c.get("/tasks")).json() == []
        assert (await c.get("/status")).json()["tasks"] == []


async def test_a_weighted_curriculum_from_parquet_and_orders_that_wait_for_the_last_page(
    settings: Settings, tmp_path: Path
) -> None:
    import pyarrow as pa

    table = pa.table({"q": list(range(9)), "level": ["hard" if i < 3 else "easy" for i in range(9)]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=4)
    (tmp_path / "odd.jsonl").write_text('{"q": 0, "level": "easy"}\n{"q": 1, "level": "expert"}\n')
    levels = {"easy": 5, "hard": 1}
    async with serving(settings, task_files_dir=tmp_path, task_page_size=4) as c:
        await start(c)
        spec = {"name": "math", "path": "c.parquet", "order": "weighted", "levels": levels, "epochs": 2, "seed": 3}
        made = await c.post("/tasks/datasets", json=spec)
        assert made.status_code == 200, made.text
        assert made.json()["level_sizes"] == {"easy": 6, "hard": 3} and made.json()["size"] == 9
        assert (await c.post("/tasks/datasets", json={**spec, "levels": {"easy": 1, "hard": 1}})).status_code == 409
        got = [(x["epoch"], x["task"]["q"]) for _ in range(3) for x in (await lease(c, 4))["leases"]]
        assert sorted(got) == [(0, q) for q in range(9)], "every task of the epoch once"
        odd = await c.post("/tasks/datasets", json={**spec, "name": "odd", "path": "odd.jsonl"})
        assert odd.status_code == 422 and "task 1" in odd.text and odd.json()["detail"][0]["loc"] == ["body", "path"]
        inline = {"name": "inl", "order": "weighted", "levels": levels, "tasks": [{"level": "easy"}, 3]}
        assert (await c.post("/tasks/datasets", json=inline)).status_code == 422
        unweighted = await c.post("/tasks/datasets", json={"name": "u", "tasks": [1], "levels": levels})
        assert unweighted.status_code == 422 and "only with it" in unweighted.text
        bad = await c.post("/tasks/datasets", json={"name": "w", "tasks": [1], "order": "weighted", "levels": {"a": 0}})
        assert bad.status_code == 422
        paged = {"name": "paged", "tasks": [1, 2], "order": "shuffled", "last": False}
        assert (await c.post("/tasks/datasets", json=paged)).is_success
        ask = {"dataset": "paged", "producer_id": "p", "n": 4}
        assert (await c.post("/tasks/lease", json=ask)).json()["leases"] == [], "its order needs its final size"
        page = {"dataset": "paged", "first": 2, "tasks": [3], "last": True}
        assert (await c.post("/tasks/pages", json=page)).is_success
        assert sorted(x["task"] for x in (await c.post("/tasks/lease", json=ask)).json()["leases"]) == [1, 2, 3]
