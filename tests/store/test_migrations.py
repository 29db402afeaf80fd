"""Schema versions: a store written by an earlier release opens with this one and serves what it held; one
written by a later release, or by another application, is refused. The mechanism alone (api/store/migrations.py)
first, then each SQL backend from the files of every earlier version (tests/store/old_files, written by those
releases)."""

from __future__ import annotations

import asyncio
import gzip
import re
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from api.app import create_app
from api.config.settings import Settings
from api.store import make_store, postgres, sqlite
from api.store.base import Txn
from api.store.migrations import SchemaRefused, Step, migrate
from api.tasks.records import Dataset
from tests import pg
from tests.factories import env, group
from tests.store.old_files import write
from tests.store.old_files.write import DRILL

OLD_FILES = Path(__file__).parent / "old_files"
SQLITE_LEDGER, POSTGRES_LEDGER = 6, 5
"""The first layout version of each backend with the ledger (its files hold rows of their groups)."""
SQLITE_OWNED, POSTGRES_OWNED = 10, 8
"""The first layout version of each backend whose file holds a dataset with a lease and an open group (the
last before owners were recorded)."""
SQLITE_STAGED, POSTGRES_STAGED = 11, 9
"""The first layout version of each backend whose file holds tasks trained and tasks served in a batch not
acknowledged yet (the last before `served` was stored), and a group open with 2 of its 4 slots posted."""
SQLITE_TURNS, POSTGRES_TURNS = 14, 12
"""The first layouts whose files hold a group with turns acknowledged (o-3)."""


NO_SWEEP_S = 1e9
"""The open groups' background sweep, never in a test's time: a file's open groups have deadlines of the hour
it was written, long past as the file ages, and the sweep would expire them before the test looks (as a side
buffer's ttl would)."""


class FakeDatabase:
    """A database that records the statements run on it."""

    where = "fake"

    def __init__(self, tables: set[str], version: int = 0) -> None:
        self._tables = tables
        self.stored = version
        self.ran: list[str] = []

    def tables(self) -> set[str]:
        return self._tables

    def version(self) -> int:
        return self.stored

    def execute(self, statement: str) -> None:
        self.ran.append(statement)

    def set_version(self, version: int) -> None:
        self.stored = version


STEPS = [Step("one", ("a1", "a2")), Step("two", ("b",)), Step("three", ("c",))]


def test_a_new_store_runs_every_step_in_order() -> None:
    db = FakeDatabase(set())
    assert migrate(db, STEPS) == 0
    assert db.ran == ["a1", "a2", "b", "c"] and db.stored == 3


def test_an_older_store_runs_only_the_steps_it_lacks() -> None:
    db = FakeDatabase({"meta", "queue"}, version=1)
    assert migrate(db, STEPS) == 1
    assert db.ran == ["b", "c"] and db.stored == 3
    again = FakeDatabase({"meta"}, version=3)
    assert migrate(again, STEPS) == 3 and again.ran == []


def test_a_newer_store_or_foreign_tables_are_refused_untouched() -> None:
    newer = FakeDatabase({"meta"}, version=4)
    with pytest.raises(SchemaRefused, match="layout version 4, written by a newer rollbuf; this rollbuf reads up to 3"):
        migrate(newer, STEPS)
    foreign = FakeDatabase({"users", "orders"})
    with pytest.raises(SchemaRefused, match=r"not rollbuf's \(orders, users\): not touching it; see here"):
        migrate(foreign, STEPS, hint="; see here")
    assert newer.ran == foreign.ran == [] and newer.stored == 4


def versions(backend: str) -> dict[int, Path]:
    """The old files of a backend by the version they hold: one at least for every version before the
    current one (a release that changes the layout commits a file of the layout it replaces)."""
    found = {int(m[1]): p for p in OLD_FILES.iterdir() if (m := re.fullmatch(rf"{backend}-v(\d+)\..*", p.name))}
    current = {"sqlite": sqlite.SCHEMA_VERSION, "postgres": postgres.SCHEMA_VERSION}[backend]
    assert set(range(1, current)) <= set(found), f"{backend}: no file of some earlier version in {OLD_FILES}"
    assert max(found) <= current
    return found


async def served(store: str, *, ledgered: bool = False, owned: bool = False, staged: bool = False) -> None:
    """What tests/store/old_files/write.py put in: a registered run, env 0 (math, groups of 4), three queued
    groups (the first with group id g-1), half a group in the side buffer (held since the file was written, in a
    layout that keeps when: no ttl here, or it would expire as the file ages). `ledgered`: the file's layout
    has the ledger, so those groups have rows (with no producer: that column came later). `owned`: the file
    holds a dataset with task 0 leased (its token from before tokens had a random part) and group o-1 open,
    from before owners were recorded: written without keys, they have none, and the lease goes on. `staged`: before
    all of that, two batches in "next" mode of dataset drill's 4 tasks (`write.trained_tasks`: the first two
    trained in step 0, the last two served in step 1), so the run is at step 2; task 0 of arith leased with a
    token of its own; and group o-2 open with slots 0 and 1 posted."""
    drilled = DRILL if staged else 0  # drill's groups, two a batch
    first = drilled // 2  # the step the run's own groups are formed in
    app = create_app(Settings(store=store, side_buffer_ttl_s=None, rollout_sweep_every_s=NO_SWEEP_S))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            if staged:
                await trained_and_served(c)
            elif owned:
                beat = (await c.post("/tasks/heartbeat", json={"tokens": ["task:arith:0:0:1"]})).json()
                assert beat["expires_at"]["task:arith:0:0:1"] is not None, "a lease from before was lost"
            if owned:
                arith = {v["name"]: v for v in (await c.get("/tasks")).json()}["arith"]
                assert (arith["name"], arith["size"]) == ("arith", 2)
                opened = (await c.get("/rollouts/group", params={"group_id": "o-1"})).json()
                assert (opened["state"], opened["producer"]) == ("open", "p-1")
            status = (await c.get("/status")).json()
            assert (status["current_step"], status["queue_size"]) == (first, 3)
            assert status["queued_bytes"] > 0  # counted from the payloads by the migration that added the count
            [math] = (await c.get("/dashboard/data")).json()["envs"]
            assert (math["name"], math["received"]) == ("math_0", 4 + drilled), "the env or its counters were lost"
            assert (await c.post("/register-env", json=env("math", group_size=4))).json()["wandb_name"] == "math_1"
            again = await c.post("/scored_data", json=group(4, seed=1, group_id="g-1"))
            assert again.json() == {"status": "received", "duplicate": True}, "the stored reply was lost"
            other_half = await c.post("/scored_data", json=group(2, seed=5))  # completes the buffered half
            assert other_half.status_code == 200, other_half.text
            assert (await c.get("/status")).json()["queue_size"] == 5  # two half groups, queued together
            batch = (await c.get("/batch")).json()["batch"]  # batch_size 8: the two oldest groups
            assert [g["tokens"] for g in batch] == [group(4, seed=1)["tokens"], group(4, seed=2)["tokens"]]
            assert (await c.get("/status")).json()["current_step"] == first + 1
            if staged:  # asking for step 2 acknowledged step 1: its tasks are trained
                drill = {v["name"]: v for v in (await c.get("/tasks")).json()}["drill"]
                assert drill["counts"] == {"trained": 4}, drill
                rows = (await c.get("/tasks/rows", params={"dataset": "drill"})).json()["tasks"]
                assert [(r["state"], r["step"]) for r in rows] == [("trained", 0)] * 2 + [("trained", 1)] * 2
            step = (await c.get(f"/ledger/steps/{first}")).json()  # the ledger starts at the migration: groups from
            assert (step["groups_by_env"], step["seqs"]) == ({"math_0": 2}, 8)  # before, no rows
            rows = [(g["group_id"], g["fate"], g["producer_id"]) for g in step["groups"]]
            assert rows == ([("g-1", "served", None), (None, "served", None)] if ledgered else [])
            resumes = [(g["resumed"], g["tokens_saved"]) for g in step["groups"]]
            assert resumes == ([(None, None)] * 2 if ledgered else []), "rows from before the columns read as null"
            assert len((await c.get("/batch")).json()["batch"]) == 3  # the last group and the two halves
            served = {e["name"]: e for e in (await c.get("/dashboard/data")).json()["envs"]}
            assert (served["math_0"]["received"], served["math_0"]["served_groups"]) == (5 + drilled, 5 + drilled)
            drained = (await c.get("/status")).json()
            assert (drained["queue_size"], drained["queued_bytes"]) == (0, 0), "queued bytes miscounted"
            sent = await c.post("/scored_data", json=group(4, seed=9, group_id="g-new", producer_id="host-1-abc"))
            assert sent.status_code == 200, sent.text
            [row] = (await c.get("/ledger/groups/g-new")).json()["groups"]
            assert row["producer_id"] == "host-1-abc", "the migrated ledger lost a new group's producer"


async def trained_and_served(c: httpx.AsyncClient) -> None:
    """What `staged` adds, as every view shows it before the trainer asks for anything: drill's tasks 0 and 1
    trained in step 0, 2 and 3 served in step 1 (not acknowledged yet), arith's task 0 leased, o-2's first two
    slots posted."""
    views = {v["name"]: v for v in (await c.get("/tasks")).json()}
    assert views["drill"]["counts"] == {"trained": 2, "served": 2} and views["drill"]["done"], views
    assert views["arith"]["counts"] == {"leased": 1}, views
    rows = (await c.get("/tasks/rows", params={"dataset": "drill"})).json()["tasks"]
    assert [(r["index"], r["state"], r["step"]) for r in rows] == [
        (0, "trained", 0),
        (1, "trained", 0),
        (2, "served", 1),
        (3, "served", 1),
    ]
    [arith] = (await c.get("/tasks/rows", params={"dataset": "arith"})).json()["tasks"]
    assert (arith["state"], arith["producer"], arith["leases"]) == ("leased", "p-1", 1), "a lease from before was lost"
    status = {v["name"]: v for v in (await c.get("/status")).json()["tasks"]}
    assert status["drill"]["counts"] == {"trained": 2, "served": 2}
    metrics = (await c.get("/metrics")).text
    for state, n in (("trained", 2), ("served", 2), ("submitted", 0)):
        assert f'rollbuf_tasks{{dataset="drill",state="{state}"}} {n}.0' in metrics, state
    opened = (await c.get("/rollouts/group", params={"group_id": "o-2"})).json()
    assert (opened["state"], opened["producer"], opened["done"]) == ("open", "p-2", [0, 1])


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


@pytest.mark.parametrize("version", sorted(versions("sqlite")))
def test_a_sqlite_file_of_an_earlier_version_opens_and_serves_what_it_held(version: int, tmp_path: Path) -> None:
    path = tmp_path / "rollbuf.db"
    with gzip.open(versions("sqlite")[version]) as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    asyncio.run(
        served(
            f"sqlite:///{path}",
            ledgered=version >= SQLITE_LEDGER,
            owned=version >= SQLITE_OWNED,
            staged=version >= SQLITE_STAGED,
        )
    )
    fresh = tmp_path / "fresh.db"
    asyncio.run(sqlite.SqliteStore(f"sqlite:///{fresh}").close())
    assert _sqlite_layout(path) == _sqlite_layout(fresh), "a migrated file differs from a new one"


def _sqlite_layout(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as db:
        layout = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        layout.append(db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone())
    return layout


def test_a_sqlite_file_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rollbuf.db"
    asyncio.run(sqlite.SqliteStore(f"sqlite:///{path}").close())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (sqlite.SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaRefused, match="written by a newer rollbuf"):
        sqlite.SqliteStore(f"sqlite:///{path}")


@pytest.mark.parametrize("version", sorted(versions("postgres")))
def test_a_postgres_schema_of_an_earlier_version_opens_and_serves_what_it_held(version: int, dbname: str) -> None:
    dump = gzip.decompress(versions("postgres")[version].read_bytes()).decode()
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        conn.execute(dump.encode())  # several statements, no parameters: sent as one simple query
    asyncio.run(
        served(
            pg.url_of(dbname, schema="old_run"),
            ledgered=version >= POSTGRES_LEDGER,
            owned=version >= POSTGRES_OWNED,
            staged=version >= POSTGRES_STAGED,
        )
    )
    asyncio.run(postgres.PostgresStore(pg.url_of(dbname, schema="fresh")).close())
    assert _postgres_layout(dbname, "old_run") == _postgres_layout(dbname, "fresh")


def _postgres_layout(dbname: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, is_nullable, is_identity FROM information_schema.columns "
            "WHERE table_schema = %s ORDER BY 1, 2",
            (schema,),
        ).fetchall()
        indexes = conn.execute(
            "SELECT tablename, indexname, replace(indexdef, %s, '') FROM pg_indexes WHERE schemaname = %s ORDER BY 2",
            (f"{schema}.", schema),
        ).fetchall()
        version = conn.execute(f"SELECT value FROM {schema}.meta WHERE key = 'schema_version'").fetchall()
    return [*columns, *indexes, *version]


def _stored_tasks(url: str) -> tuple[list[tuple[int, str, int | None]], dict[str, int], dict[str, int]]:
    """Drill's rows (index, state, step) and tallies, and arith's tallies, as the store at `url` holds them."""

    def read(txn: Txn) -> tuple[list[tuple[int, str, int | None]], dict[str, int], dict[str, int]]:
        rows = [(r.index, r.state, r.step) for r in txn.tasks.scan("drill", (-1, -1), 10)]
        drill, arith = (Dataset.of(str(txn.tasks.get_dataset(name))) for name in ("drill", "arith"))
        return rows, {k: v for k, v in drill.counts.items() if v}, {k: v for k, v in arith.counts.items() if v}

    async def opened() -> tuple[list[tuple[int, str, int | None]], dict[str, int], dict[str, int]]:
        store = make_store(url)
        try:
            return await store.read(read)
        finally:
            await store.close()

    return asyncio.run(opened())


STAGED_ROWS = [(0, "trained", 0), (1, "trained", 0), (2, "served", 1), (3, "served", 1)]
"""Drill's rows once migrated: step 1 is at the committed mark (1), so its tasks are served, not trained."""


def test_a_sqlite_file_stores_tasks_served_past_the_committed_mark_as_served(tmp_path: Path) -> None:
    """Layout 12's rule: a task stored `trained` in a step at or after the committed mark was served in a batch
    the trainer has not acknowledged; it is stored `served`, and its dataset's tallies count it there."""
    path = tmp_path / "rollbuf.db"
    with gzip.open(versions("sqlite")[SQLITE_STAGED]) as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM tasks WHERE state = 'trained'").fetchone() == (4,), "as written"
    assert _stored_tasks(f"sqlite:///{path}") == (STAGED_ROWS, {"trained": 2, "served": 2}, {"leased": 1})


def test_a_postgres_schema_stores_tasks_served_past_the_committed_mark_as_served(dbname: str) -> None:
    """Layout 10's rule on PostgreSQL, as layout 12's on SQLite."""
    dump = gzip.decompress(versions("postgres")[POSTGRES_STAGED].read_bytes()).decode()
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        conn.execute(dump.encode())
        assert conn.execute("SELECT count(*) FROM old_run.tasks WHERE state = 'trained'").fetchone() == (4,)
    url = pg.url_of(dbname, schema="old_run")
    assert _stored_tasks(url) == (STAGED_ROWS, {"trained": 2, "served": 2}, {"leased": 1})


async def sealed_from_posted(store: str) -> None:
    """The open group o-2 of the file, with the 2 slots posted when it was written: they are still in (as its
    view and its next posts see them), and the group sealed with the 2 missing slots holds all 4 rollouts. The
    first missing slot is posted as a turn and a final post after it (the layout's `rollout_turns`, from SQLite 14
    and PostgreSQL 12), its turn freed with the seal."""
    app = create_app(Settings(store=store, side_buffer_ttl_s=None, rollout_sweep_every_s=NO_SWEEP_S))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            opened = (await c.get("/rollouts/group", params={"group_id": "o-2"})).json()
            assert (opened["state"], len(opened["done"])) == ("open", 2), opened
            assert (await c.get("/rollouts")).json()["open_slots_done"] == 2
            missing = sorted(set(range(4)) - set(opened["done"]))
            turn = {"group_id": "o-2", "slot": missing[0], "producer_id": opened["producer"], "turn": 0}
            reply = await c.post("/rollouts/turn", json={**turn, "tokens": [7], "masks": [-100]})
            assert reply.status_code == 200, reply.text
            for slot in missing:
                body = {
                    "group_id": "o-2",
                    "slot": slot,
                    "producer_id": opened["producer"],
                    "tokens": [7, 8],
                    "masks": [-100, 8],
                    "score": 0.5,
                }
                if slot == missing[0]:
                    body = {**body, "tokens": [8], "masks": [8], "after_turns": True}
                reply = await c.post("/rollouts/post", json=body)
                assert reply.status_code == 200, reply.text
            assert reply.json()["group"]["state"] == "sealed", reply.json()
            sealed = (await c.get("/rollouts/group", params={"group_id": "o-2"})).json()
            assert sealed["turns"] == {}, "freed with the seal"
            [row] = (await c.get("/ledger/groups/o-2")).json()["groups"]
            assert row["seqs"] == 4 and row["tokens"] >= 4 * 2, row
            assert (row["resumed"], row["tokens_saved"]) == (None, None), "no slot of it was resumed"


@pytest.mark.parametrize("version", [v for v in sorted(versions("sqlite")) if v >= SQLITE_STAGED])
def test_a_sqlite_files_posted_slots_are_sealed_with_their_group(version: int, tmp_path: Path) -> None:
    path = tmp_path / "rollbuf.db"
    with gzip.open(versions("sqlite")[version]) as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    asyncio.run(sealed_from_posted(f"sqlite:///{path}"))


@pytest.mark.parametrize("version", [v for v in sorted(versions("postgres")) if v >= POSTGRES_STAGED])
def test_a_postgres_schemas_posted_slots_are_sealed_with_their_group(version: int, dbname: str) -> None:
    dump = gzip.decompress(versions("postgres")[version].read_bytes()).decode()
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        conn.execute(dump.encode())
    asyncio.run(sealed_from_posted(pg.url_of(dbname, schema="old_run")))


async def turns_go_on(store: str) -> None:
    """The open group o-3 of the file, with 2 turns of its slot 0 (3 and 2 tokens) acknowledged when it was
    written: as migrated, its slot's summary and its group's count of turn tokens count them (layout SQLite 15,
    PostgreSQL 13); its next turn is turn 2, the first one again a duplicate, and the final post after them makes
    the rollout of every turn and its tail."""
    counted = make_store(store)
    try:
        row, summary = await counted.read(lambda t: (t.rollouts.get("o-3"), t.rollouts.turn_summary("o-3", 0)))
    finally:
        await counted.close()
    assert row is not None and row.turn_tokens == 5, row
    assert summary is not None and (summary.turns, summary.tokens, summary.fields) == (2, 5, 1), summary
    app = create_app(Settings(store=store, side_buffer_ttl_s=None, rollout_sweep_every_s=NO_SWEEP_S))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            again = await c.post("/rollouts/turn", json=write.turn("o-3", 0, 0, "p-3"))
            assert again.json() == {"status": "duplicate", "turns": 2, "tokens": 5}, again.text
            turn = {"group_id": "o-3", "slot": 0, "producer_id": "p-3", "turn": 2, "tokens": [40], "masks": [40]}
            reply = await c.post("/rollouts/turn", json=turn)
            assert reply.json() == {"status": "accepted", "turns": 3, "tokens": 6}, reply.text
            final = {"group_id": "o-3", "slot": 0, "producer_id": "p-3", "tokens": [50], "masks": [50], "score": 1.0}
            reply = await c.post("/rollouts/post", json={**final, "after_turns": True})
            assert reply.status_code == 200, reply.text
            reply = await c.post("/rollouts/post", json={**final, "slot": 1})
            assert reply.json()["group"]["state"] == "sealed", reply.text
            [row_] = (await c.get("/ledger/groups/o-3")).json()["groups"]
            assert (row_["seqs"], row_["tokens"]) == (2, 7 + 1), row_


@pytest.mark.parametrize("version", [v for v in sorted(versions("sqlite")) if v >= SQLITE_TURNS])
def test_a_sqlite_files_turns_are_counted_and_go_on(version: int, tmp_path: Path) -> None:
    path = tmp_path / "rollbuf.db"
    with gzip.open(versions("sqlite")[version]) as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    asyncio.run(turns_go_on(f"sqlite:///{path}"))


@pytest.mark.parametrize("version", [v for v in sorted(versions("postgres")) if v >= POSTGRES_TURNS])
def test_a_postgres_schemas_turns_are_counted_and_go_on(version: int, dbname: str) -> None:
    dump = gzip.decompress(versions("postgres")[version].read_bytes()).decode()
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        conn.execute(dump.encode())
    asyncio.run(turns_go_on(pg.url_of(dbname, schema="old_run")))


def test_a_dataset_from_before_owners_is_its_envs_key(tmp_path: Path) -> None:
    """Layout 11's rule: a dataset stored before owners were recorded belongs to the one key that registered the
    envs of its env's name, and an open group to its env's key. A file of layout 10 whose env a key registered."""
    path = tmp_path / "rollbuf.db"
    with gzip.open(versions("sqlite")[SQLITE_OWNED]) as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE envs SET record = json_set(record, '$.owner', 'env-1')")
    keys = "env-1 env env-one-secret-0123456789; env-2 env env-two-secret-0123456789"

    async def check() -> None:
        app = create_app(Settings(store=f"sqlite:///{path}", api_keys=keys, side_buffer_ttl_s=None))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
                for key, owns in (("env-two-secret-0123456789", False), ("env-one-secret-0123456789", True)):
                    auth = {"Authorization": f"Bearer {key}"}
                    beat = await c.post("/tasks/heartbeat", json={"tokens": ["task:arith:0:0:1"]}, headers=auth)
                    assert (beat.json()["expires_at"]["task:arith:0:0:1"] is not None) is owns
                    lease = await c.post("/tasks/lease", json={"dataset": "arith", "producer_id": "p"}, headers=auth)
                    assert lease.status_code == (200 if owns else 404), lease.text
                    opened = await c.get("/rollouts/group", params={"group_id": "o-1"}, headers=auth)
                    assert opened.status_code == (200 if owns else 404), opened.text

    asyncio.run(check())
