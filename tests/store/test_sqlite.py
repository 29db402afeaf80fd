"""What only the SQLite backend promises: state survives closing and kill -9."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from api.store.base import ItemMeta, QueuedItem, Txn
from api.store.sqlite import CHECKPOINT_EVERY, SqliteConfig, SqliteStore, parse_url
from api.store.sqlite.config import PAGE_SIZE

pytestmark = pytest.mark.anyio

WORKER = textwrap.dedent(
    """
    import asyncio, sys
    from api.store.base import ItemMeta, QueuedItem
    from api.store.sqlite import SqliteStore

    async def main():
        store = SqliteStore(sys.argv[1])
        for i in range(1_000_000):
            def fn(t, i=i):
                item_id = t.next_item_id()
                t.append(i % 3, QueuedItem(ItemMeta(item_id, 4, 40, i), 1, b"x" * 5000 + str(i).encode()))
                t.set_value("last", str(i))
                return item_id
            print(await store.transact(fn), flush=True)  # acknowledged only after COMMIT

    asyncio.run(main())
    """
)


def test_url_forms() -> None:
    assert parse_url("sqlite:///data/x.db") == SqliteConfig(Path("data/x.db"))
    assert parse_url("sqlite:////tmp/x.db?synchronous=full&reply_ttl=60") == SqliteConfig(
        Path("/tmp/x.db"), "FULL", reply_ttl=60.0
    )
    for bad in (
        "sqlite:///",
        "sqlite:///:memory:",
        "sqlite://host/x.db",
        "sqlite:///x.db?synchronous=OFF",
        "sqlite:///x.db?max_replies=-1",
        "sqlite:///x.db?fsync=1",
    ):
        with pytest.raises(ValueError):
            parse_url(bad)


async def test_the_file_and_its_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "deeper" / "b.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(lambda t: t.set_value("k", "v"))
    finally:
        await store.close()
    assert path.is_file()


@pytest.mark.integration
async def test_kill_9_loses_nothing_acknowledged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, url], stdout=subprocess.PIPE, start_new_session=True, cwd=Path.cwd()
    )
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        while len(acked) < 300:
            line = proc.stdout.readline()
            assert line, "worker died before acknowledging enough items"
            acked.append(int(line))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    store = SqliteStore(url)
    try:

        def read(t: Txn) -> tuple[list[int], list[bytes], int]:
            ids = [m.item_id for env in range(3) for m in t.head(env)]
            counted = sum(c.items for c in t.counts().values())
            payloads = [it.payload for env in range(3) for it in t.pop(env, [m.item_id for m in t.head(env)])]
            return ids, payloads, counted

        ids, payloads, counted = await store.transact(read)
        assert set(acked) <= set(ids), "an acknowledged item was lost"
        assert counted == len(ids), "counts disagree with the queue"
        assert all(p.startswith(b"x" * 5000) for p in payloads)
    finally:
        await store.close()


async def test_wal_is_checkpointed_into_the_database_while_open(tmp_path: Path) -> None:
    """The writer never checkpoints (wal_autocheckpoint=0); the checkpointer thread must, or the WAL grows
    for as long as the server runs."""
    path = tmp_path / "wal.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        start = path.stat().st_size
        for _ in range(CHECKPOINT_EVERY + 1):  # enough commits to wake the checkpointer
            await store.transact(lambda t: t.append(0, QueuedItem(ItemMeta(t.next_item_id(), 1, 1, 0), 1, b"x" * 4000)))
        deadline = time.monotonic() + 30
        while path.stat().st_size < start + CHECKPOINT_EVERY * 4000:
            assert time.monotonic() < deadline, "nothing was checkpointed into the database file"
            await asyncio.sleep(0.05)  # polling interval
    finally:
        await store.close()


def test_a_group_commit_shares_values_read_but_forgets_those_a_function_that_failed_wrote(tmp_path: Path) -> None:
    """The writer reads the run state once per group commit (`SqliteTxn.get_value`): a function after one that
    was undone sees the value as it was before that one, and a value set before sees it set."""
    from api.store.commit import run
    from api.store.jobs import Job
    from api.store.sqlite.checkpoint import Checkpointer
    from api.store.sqlite.config import connect
    from api.store.sqlite.payloads import PayloadTier
    from api.store.sqlite.schema import create_or_migrate
    from api.store.sqlite.segments import segment_dir
    from api.store.sqlite.store import _Driver
    from api.store.sqlite.txn import ItemIds
    from api.store.sqlite.write_lock import WriteLock

    config = parse_url(f"sqlite:///{tmp_path}/values.db")
    db = connect(config)
    db.execute("BEGIN IMMEDIATE")
    create_or_migrate(db, config.path)
    db.execute("COMMIT")
    checkpointer = Checkpointer(config.path, config.wal_limit)
    tier = PayloadTier.beside(config.path, config.synchronous)
    driver = _Driver(db, config, ItemIds(), checkpointer, lambda: None, tier, WriteLock(segment_dir(config.path), 5))

    def first(t: Txn) -> str | None:
        t.set_value("x", "1")
        return t.get_value("x")

    def undone(t: Txn) -> None:
        t.set_value("x", "2")
        assert t.get_value("x") == "2"
        raise ValueError("undone")

    def last(t: Txn) -> str | None:
        return t.get_value("x")

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        jobs = [Job(fn, loop.create_future(), loop) for fn in (first, undone, last)]  # type: ignore[arg-type]
        run(driver, jobs)
        await asyncio.sleep(0)
        return [j.future.exception() or j.future.result() for j in jobs]

    try:
        got = asyncio.run(main())
        assert got[0] == "1" and isinstance(got[1], ValueError) and got[2] == "1"
        assert db.execute("SELECT value FROM kv WHERE key = 'x'").fetchone()[0] == "1"
    finally:
        checkpointer.stop()
        driver.lock.close()
        db.close()


async def test_values_and_ids_are_kept_across_transactions_until_another_process_commits(tmp_path: Path) -> None:
    """The writer keeps what it read (the run state, the id counter) from one transaction to the next, and reads
    afresh once another connection committed (`PRAGMA data_version`): two stores on one file, as two server
    processes, each see the other's writes at once and never hand out the same item id."""
    url = f"sqlite:///{tmp_path}/shared.db"
    a, b = SqliteStore(url), SqliteStore(url)
    statements: list[str] = []

    def append(t: Txn) -> int:
        item_id = t.next_item_id()
        t.append(0, QueuedItem(ItemMeta(item_id, 1, 4, 0), 1, b"p"))
        return item_id

    try:
        await a.transact(lambda t: t.set_value("run", "1"))
        assert await a.transact(lambda t: t.get_value("run")) == "1"
        await a.transact(lambda t: t._db.set_trace_callback(statements.append))  # type: ignore[attr-defined]
        assert await a.transact(lambda t: t.get_value("run")) == "1"
        assert not [s for s in statements if "FROM kv" in s]  # kept: no read
        await b.transact(lambda t: t.set_value("run", "2"))  # another connection commits
        assert await a.transact(lambda t: t.get_value("run")) == "2"  # read afresh
        assert [s for s in statements if "FROM kv" in s]
        ids = [await store.transact(append) for _ in range(5) for store in (a, b)]
        assert len(set(ids)) == len(ids)
        for store in (a, b):  # the counts, kept between transactions, include the other's appends
            assert (await store.transact(lambda t: t.counts()))[0].items == 10
        await b.transact(append)
        assert (await a.transact(lambda t: t.counts()))[0].items == 11
        undone: list[int] = []

        def fails(t: Txn) -> None:
            undone.append(t.next_item_id())
            t.set_value("run", "3")
            raise ValueError("undone")

        with pytest.raises(ValueError):
            await a.transact(fails)
        assert await a.transact(lambda t: t.get_value("run")) == "2"  # the undone write is not remembered
        assert await a.transact(append) > undone[0]  # an id handed out to an undone function is not reused
    finally:
        await a.transact(lambda t: t._db.set_trace_callback(None))  # type: ignore[attr-defined]
        await a.close()
        await b.close()


async def test_a_new_file_gets_small_pages_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    """New files use PAGE_SIZE (1 KiB: every commit rewrites the pages it touches, so smaller ones write less);
    a file created with other pages keeps them, whatever the URL says (WAL mode fixes the size)."""
    for name, query in (("new.db", ""), ("old.db", "?page_size=4096")):
        store = SqliteStore(f"sqlite:///{tmp_path / name}{query}")
        await store.transact(lambda t: t.set_value("k", "v"))
        await store.close()
    assert PAGE_SIZE == 1024
    for name, expected in (("new.db", PAGE_SIZE), ("old.db", 4096)):
        reopened = SqliteStore(f"sqlite:///{tmp_path / name}")  # the default asks for PAGE_SIZE
        assert await reopened.transact(lambda t: t.get_value("k")) == "v"
        await reopened.close()
        with sqlite3.connect(tmp_path / name) as db:
            assert db.execute("PRAGMA page_size").fetchone()[0] == expected, name
