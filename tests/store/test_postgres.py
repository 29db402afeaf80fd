"""What only the PostgreSQL backend promises: its URL, its tables and their version, and several stores (one per
replica) on one database behaving as one."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import psycopg
import pytest

from api.store.base import ItemMeta, LedgerGroup, QueuedItem, StoreUnavailable, Txn
from api.store.ledger_rows import group_values
from api.store.postgres import (
    LIBPQ_DEFAULTS,
    SCHEMA_VERSION,
    SESSION_SETTINGS,
    PostgresConfig,
    PostgresStore,
    flush,
    is_transient,
    parse_url,
)
from api.store.postgres.config import connect_kwargs
from api.store.postgres.schema import create_or_migrate
from api.store.postgres.store import warn_without_autovacuum
from api.store.tasks import TaskRow, values_of
from api.store.url import redacted
from tests import pg

pytestmark = pytest.mark.anyio


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


def test_url_forms() -> None:
    cfg = parse_url("postgresql://u:pw@db.example:6543/run1?schema=exp_7&reply_ttl=60&sslmode=require")
    assert cfg.schema == "exp_7" and cfg.reply_ttl == 60.0 and cfg.max_replies == 1_000_000
    # rollbuf's own parameters are taken out; libpq's stay, with a connect timeout and a name by default.
    info = psycopg.conninfo.conninfo_to_dict(cfg.conninfo)
    assert info == {
        "user": "u",
        "password": "pw",
        "host": "db.example",
        "port": "6543",
        "dbname": "run1",
        "sslmode": "require",
        **LIBPQ_DEFAULTS,
    }
    assert LIBPQ_DEFAULTS["connect_timeout"] == "5" and LIBPQ_DEFAULTS["application_name"] == "rollbuf"
    given = psycopg.conninfo.conninfo_to_dict(
        parse_url("postgresql://h/db?tcp_user_timeout=0&connect_timeout=2").conninfo
    )
    assert given["tcp_user_timeout"] == "0" and given["connect_timeout"] == "2", "what the URL says wins"
    assert parse_url("postgres://h/db").schema == "rollbuf"
    assert redacted("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    for bad in (
        "postgresql://h",
        "postgresql://h/",
        "postgresql://h/db?schema=Bad-Name",
        "postgresql://h/db?lock_timeout=0",
        "postgresql://h/db?max_replies=x",
        "postgresql://h/db?nonsense=1",
        "mysql://h/db",
    ):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_lock_and_channel_are_per_schema() -> None:
    a, b = PostgresConfig("", schema="a"), PostgresConfig("", schema="b")
    assert a.lock_key != b.lock_key and a.channel != b.channel
    assert a.lock_key == PostgresConfig("", schema="a").lock_key, "every replica must compute the same lock"


def test_transient_errors_are_told_apart_from_bugs() -> None:
    assert is_transient(psycopg.errors.AdminShutdown())
    assert is_transient(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert is_transient(psycopg.errors.LockNotAvailable())
    assert is_transient(psycopg.errors.DiskFull())  # 53100: a full disk is "not now" (503), never a 500
    assert is_transient(psycopg.errors.OutOfMemory())
    assert not is_transient(psycopg.errors.UniqueViolation())
    assert not is_transient(psycopg.errors.SyntaxError())


async def test_tables_of_another_version_or_owner_are_refused(dbname: str) -> None:
    await PostgresStore(pg.url_of(dbname)).close()
    with psycopg.connect(pg.url_of(dbname), autocommit=True) as conn:
        conn.execute("UPDATE rollbuf.meta SET value = %s WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
        conn.execute("CREATE SCHEMA other; CREATE TABLE other.accounts (id int)")
    with pytest.raises(RuntimeError, match="layout version"):
        PostgresStore(pg.url_of(dbname))
    with pytest.raises(RuntimeError, match="not rollbuf's"):
        PostgresStore(pg.url_of(dbname, schema="other"))


async def test_an_unreachable_database_fails_at_start() -> None:
    with pytest.raises(psycopg.OperationalError):
        PostgresStore(pg.url_of(pg.PREFIX + "does_not_exist", pool_timeout="1"))


async def test_replicas_serialise_their_transactions(dbname: str) -> None:
    """Read-modify-write from two stores (two replicas) at once: no update is lost, ids stay unique and FIFO."""
    url = pg.url_of(dbname)
    a, b = PostgresStore(url), PostgresStore(url)
    try:

        def bump(t: Txn) -> int:
            n = int(t.get_value("n") or 0)
            item_id = t.next_item_id()
            t.append(0, QueuedItem(ItemMeta(item_id, 1, 1, 0), 1, b"x"))
            t.set_value("n", str(n + 1))
            return item_id

        ids = await asyncio.gather(*(s.transact(bump) for _ in range(150) for s in (a, b)))
        n, head = await a.transact(lambda t: (t.get_value("n"), [m.item_id for m in t.head(0)]))
        assert n == "300"
        assert sorted(ids) == head and len(set(ids)) == 300
    finally:
        await a.close()
        await b.close()


async def test_a_replica_hears_of_data_committed_through_another(dbname: str) -> None:
    url = pg.url_of(dbname)
    a, b = PostgresStore(url), PostgresStore(url)
    try:
        woken_a, woken_b = asyncio.Event(), asyncio.Event()
        a.subscribe(woken_a.set)
        b.subscribe(woken_b.set)
        await asyncio.sleep(0)
        # The LISTEN connection opens in the background: write until it has heard something.
        async with asyncio.timeout(30):
            while not woken_a.is_set():
                await b.transact(lambda t: t.append(0, QueuedItem(ItemMeta(t.next_item_id(), 1, 1, 0), 1, b"x")))
                await asyncio.wait([asyncio.create_task(woken_a.wait())], timeout=0.2)
        async with asyncio.timeout(10):
            await woken_b.wait()  # a replica also wakes its own long-polls when it queued data
        woken_a.clear()
        await b.transact(lambda t: t.set_value("k", "v"))  # nothing queued: nobody to wake
        await b.transact(lambda t: t.append(0, QueuedItem(ItemMeta(t.next_item_id(), 1, 1, 0), 1, b"x")))
        async with asyncio.timeout(10):
            await woken_a.wait()
    finally:
        await a.close()
        await b.close()


async def test_wakes_made_before_the_loop_runs_call_once_and_later_ones_again(dbname: str) -> None:
    """Hundreds of commits a second each wake the subscribers: those that come while a call is already
    scheduled are one call, and a wake after that call has started is another (none is lost)."""
    store = PostgresStore(pg.url_of(dbname))
    try:
        calls: list[int] = []
        store.subscribe(lambda: calls.append(1))
        await asyncio.sleep(0.5)  # the LISTEN connection opens and wakes once
        before = len(calls)
        waker = threading.Thread(target=lambda: [store._wakeups.wake() for _ in range(200)])
        waker.start()
        waker.join()  # blocks this loop: none of the calls can run before all 200 wakes are made
        await asyncio.sleep(0.05)
        assert len(calls) == before + 1
        waker = threading.Thread(target=store._wakeups.wake)
        waker.start()
        waker.join()
        await asyncio.sleep(0.05)
        assert len(calls) == before + 2
    finally:
        await store.close()


async def test_a_broken_connection_is_replaced_without_an_error(dbname: str) -> None:
    """The server ended the idle connection (a restart, a failover, an idle timeout): the next transaction
    gets a new one, since nothing was sent on the old one."""
    store = PostgresStore(pg.url_of(dbname))
    try:
        await store.transact(lambda t: t.set_value("k", "1"))
        with pg.admin() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            )
        assert await store.transact(lambda t: t.get_value("k")) == "1"
    finally:
        await store.close()


async def test_lock_wait_beyond_lock_timeout_is_unavailable(dbname: str) -> None:
    """A transaction stuck behind another that holds the store lock (a replica hung mid-transaction) gets a
    503 after lock_timeout, instead of waiting for ever."""
    store = PostgresStore(pg.url_of(dbname, lock_timeout="0.3"))
    try:
        with psycopg.connect(pg.url_of(dbname)) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (store.config.lock_key,))
            with pytest.raises(StoreUnavailable):
                await store.transact(lambda t: t.get_value("k"))
        assert await store.transact(lambda t: t.get_value("k")) is None  # released with the holder's transaction
    finally:
        await store.close()


async def test_reads_take_no_lock_and_write_nothing(dbname: str) -> None:
    """Store.read runs on a snapshot beside the writer: it answers while another replica's transaction holds the
    store lock, and a function that tries to write through it is refused."""
    store = PostgresStore(pg.url_of(dbname, lock_timeout="0.3"))
    try:
        await store.transact(lambda t: t.set_value("k", "1"))
        with psycopg.connect(pg.url_of(dbname)) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (store.config.lock_key,))
            assert await store.read(lambda t: t.get_value("k")) == "1"
        with pytest.raises(RuntimeError, match="Store.read"):
            await store.read(lambda t: t.set_value("k", "2"))
        assert await store.read(lambda t: t.get_value("k")) == "1"
    finally:
        await store.close()


async def test_sessions_notice_a_silent_peer_within_seconds(dbname: str) -> None:
    """Both ends of every connection give up on a peer that went silent (a partition) within about 10 s."""
    store = PostgresStore(pg.url_of(dbname))
    try:
        with store._pool.connection() as conn:
            got = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in SESSION_SETTINGS}  # type: ignore[index]
            assert conn.info.get_parameters()["keepalives_idle"] == "5"
    finally:
        await store.close()
    assert got == {
        "tcp_keepalives_idle": "5",
        "tcp_keepalives_interval": "2",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "10000",
        "idle_in_transaction_session_timeout": "15s",
    }


def test_a_cluster_without_autovacuum_is_named_at_start(dbname: str, caplog: pytest.LogCaptureFixture) -> None:
    """This machine's cluster runs with autovacuum off; the queue tables then grow without bound."""
    with psycopg.connect(pg.url_of(dbname)) as conn:
        on = conn.execute("SHOW autovacuum").fetchone()[0] == "on"
        if on:
            conn.execute("CREATE SCHEMA s; CREATE TABLE s.queue (x int) WITH (autovacuum_enabled = false)")
        with caplog.at_level(logging.WARNING, logger="rollbuf"):
            warn_without_autovacuum(conn, "s")
    [line] = [r.getMessage() for r in caplog.records]
    assert ("autovacuum is disabled on queue" if on else "autovacuum is off") in line


def test_every_part_of_the_commit_statement_writes_one_row_or_several(dbname: str) -> None:
    """The COMMIT's writes go as one WITH statement (api/store/postgres/flush.py), each table's part in its
    one-row form (scalar parameters) or its several-row form (arrays): every part, in both forms, in one
    statement, stores what it was given, and its upsert replaces (or, for counters, adds to) a stored row."""
    url = pg.url_of(dbname)
    config = parse_url(url)
    with psycopg.connect(config.conninfo, **connect_kwargs(config)) as conn:
        create_or_migrate(conn, config)

        def ledger(i: int) -> tuple[object, ...]:
            return group_values(
                LedgerGroup(
                    id=i,
                    env_id=1,
                    group_id=f"g{i}\0",
                    handler=None,
                    acked_at=1.5,
                    policy_step=0,
                    seqs=8,
                    tokens=512,
                    bytes=3,
                    score_mean=0.5,
                    score_min=0.0,
                    score_max=1.0,
                    score_std=0.5,
                    fate="queued",
                )
            )

        def rows(ids: list[int]) -> dict[flush.Insert, list[tuple[object, ...]]]:
            return {
                flush.QUEUE: [(i, 1, 8, 512, 0, 1) for i in ids],
                flush.PAYLOADS: [(i, bytes([i]) * 3000) for i in ids],
                flush.REPLIES: [(f"k{i}", f"reply {len(ids)}", 2.5) for i in ids],
                flush.COUNTS: [(i, 1, 1, 8, 512, len(ids)) for i in ids],
                flush.VALUES: [(f"v{i}", f"value {len(ids)}") for i in ids],
                flush.COUNTERS: [("received", f"env{i}", 2) for i in ids],
                flush.LEDGER: [ledger(i) for i in ids],
                flush.TASK_SETS: [(f"set{i}", f"record {len(ids)}") for i in ids],
                flush.TASKS: [values_of(TaskRow("set", 0, i, "waiting", expires_at=None, seq=len(ids))) for i in ids],
            }

        for ids in ([1], [2, 3], [1, 2]):  # the last one repeats stored keys: upserts
            w = flush.Writes()
            for insert, batch in rows(ids).items():
                w.insert(insert, batch)
            w.add(flush.NOTIFY, [config.channel, "test"])
            statement = w.statement()
            assert statement is not None and statement.startswith("WITH ")
            conn.execute("BEGIN")
            if ids == [1, 2]:  # queue, payloads and ledger rows are only ever inserted once
                conn.execute("DELETE FROM queue; DELETE FROM payloads; DELETE FROM ledger")
            conn.execute(statement, w.params, binary=True)
            conn.execute("COMMIT")
        assert conn.execute("SELECT item_id, length(payload) FROM payloads ORDER BY 1").fetchall() == [
            (1, 3000),
            (2, 3000),
        ]
        assert conn.execute("SELECT key, reply FROM replies ORDER BY 1").fetchall() == [
            ("k1", "reply 2"),
            ("k2", "reply 2"),
            ("k3", "reply 2"),
        ]
        assert conn.execute("SELECT env_id, bytes FROM counts ORDER BY 1").fetchall() == [(1, 2), (2, 2), (3, 2)]
        assert conn.execute("SELECT key, value FROM kv ORDER BY 1").fetchall() == [
            ("v1", "value 2"),
            ("v2", "value 2"),
            ("v3", "value 2"),
        ]
        assert conn.execute("SELECT name, n FROM counters ORDER BY 2, 1").fetchall() == [
            ("env3", 2),
            ("env1", 4),
            ("env2", 4),
        ]
        assert conn.execute("SELECT id, group_id FROM ledger ORDER BY 1").fetchall() == [(1, b"g1\0"), (2, b"g2\0")]
        assert conn.execute("SELECT name, record FROM task_sets ORDER BY 1").fetchall() == [
            ("set1", "record 2"),
            ("set2", "record 2"),
            ("set3", "record 2"),
        ]
        assert conn.execute("SELECT idx, seq FROM tasks ORDER BY 1").fetchall() == [(1, 2), (2, 2), (3, 2)]
        assert conn.execute("SELECT count(*) FROM queue").fetchone() == (2,)
