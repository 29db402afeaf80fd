"""The SQLite writer's inserts wait for the group commit (api/store/sqlite/deferred.py): what a function of the
group sees is what it would see had each function written through, and a function undone after its read wrote
the earlier functions' rows leaves them stored all the same, once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.store.base import ItemMeta, QueueCounts, QueuedItem, Txn
from api.store.sqlite import parse_url


def _run_group(tmp_path: Path, fns: list[Callable[[Txn], Any]]) -> tuple[list[object], Any]:
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

    config = parse_url(f"sqlite:///{tmp_path}/deferred.db")
    db = connect(config)
    db.execute("BEGIN IMMEDIATE")
    create_or_migrate(db, config.path)
    db.execute("COMMIT")
    checkpointer = Checkpointer(config.path, config.wal_limit)
    tier = PayloadTier.beside(config.path, config.synchronous)
    driver = _Driver(db, config, ItemIds(), checkpointer, lambda: None, tier, WriteLock(segment_dir(config.path), 5))

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        jobs = [Job(fn, loop.create_future(), loop) for fn in fns]
        run(driver, jobs)
        await asyncio.sleep(0)
        return [j.future.exception() or j.future.result() for j in jobs]

    try:
        got = asyncio.run(main())
        stored = (
            db.execute("SELECT item_id FROM queue ORDER BY item_id").fetchall(),
            db.execute("SELECT count(*) FROM payloads").fetchone()[0],
            db.execute("SELECT key, reply FROM replies").fetchall(),
            db.execute("SELECT items, groups, bytes FROM counts WHERE env_id = 0").fetchall(),
            dict(db.execute("SELECT name, n FROM counters WHERE kind = 'k'").fetchall()),
        )
    finally:
        checkpointer.stop()
        driver.lock.close()
        db.close()
    return got, stored


def _queue(t: Txn, key: str) -> int:
    item_id = t.next_item_id()
    t.append(0, QueuedItem(ItemMeta(item_id, 2, 20, 0), 1, b"p" * 10))
    t.put_reply(key, f"reply {key}")
    t.add_counts("k", {"n": 1})
    return item_id


def test_a_function_undone_after_writing_the_earlier_ones_rows_leaves_them_stored_once(tmp_path: Path) -> None:
    def first(t: Txn) -> int:
        return _queue(t, "a")

    def undone(t: Txn) -> None:
        _queue(t, "b")
        assert [m.item_id for m in t.head(0)] == [1, 2]  # a read: what waits (first's and its own) is written
        assert t.get_counts("k") == {"n": 2}
        raise ValueError("undone")

    def last(t: Txn) -> tuple[str | None, str | None, dict[int, QueueCounts], list[int]]:
        seen = (t.get_reply("a"), t.get_reply("b"), t.counts())
        item_id = _queue(t, "c")
        return (*seen, [m.item_id for m in t.head(0)] + [item_id])

    got, (queue, payloads, replies, counts, counters) = _run_group(tmp_path, [first, undone, last])
    assert got[0] == 1 and isinstance(got[1], ValueError)
    assert got[2] == ("reply a", None, {0: QueueCounts(1, 1, 2, 20, 10)}, [1, 3, 3])
    assert queue == [(1,), (3,)] and payloads == 2
    assert sorted(replies) == [("a", "reply a"), ("c", "reply c")]
    assert counts == [(2, 2, 20)] and counters == {"n": 2}


def test_a_function_sees_the_replies_and_counts_of_those_before_it_in_the_group(tmp_path: Path) -> None:
    def first(t: Txn) -> int:
        return _queue(t, "a")

    def second(t: Txn) -> tuple[str | None, dict[int, QueueCounts]]:
        _queue(t, "b")
        return t.get_reply("a"), t.counts()

    got, (queue, payloads, replies, counts, counters) = _run_group(tmp_path, [first, second])
    assert got == [1, ("reply a", {0: QueueCounts(2, 2, 4, 40, 20)})]
    assert queue == [(1,), (2,)] and payloads == 2 and len(replies) == 2
    assert counts == [(2, 2, 20)] and counters == {"n": 2}
