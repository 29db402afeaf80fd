"""The SQLite store's payload tier (api/store/sqlite/payloads.py): payloads of INLINE_BELOW bytes or more live in
segment files beside the database, are read back after reopening, go when nothing refers to them, and a
segment that cannot be written is the store's "not now" (503), with nothing of the function applied."""

from __future__ import annotations

import asyncio
import gzip
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest

from api.store.base import ItemMeta, PayloadLost, QueuedItem, StoreUnavailable, Txn
from api.store.sqlite import SqliteStore, segments
from api.store.sqlite.payloads import INLINE_BELOW, SegmentsMissing
from api.store.sqlite.segments import segment_dir

pytestmark = pytest.mark.anyio
BIG = INLINE_BELOW * 2


def _append(env: int, payloads: list[bytes]):  # type: ignore[no-untyped-def]
    def fn(t: Txn) -> list[int]:
        ids = []
        for p in payloads:
            item_id = t.next_item_id()
            t.append(env, QueuedItem(ItemMeta(item_id, 1, 1, 0), 1, p))
            ids.append(item_id)
        return ids

    return fn


def _pop_all(env: int):  # type: ignore[no-untyped-def]
    def fn(t: Txn) -> list[bytes]:
        return [it.payload for it in t.pop(env, [m.item_id for m in t.head(env)])]

    return fn


def _rows(path: Path) -> tuple[list[tuple[int, int | None]], list[tuple[int, int, int]]]:
    with sqlite3.connect(path) as db:
        payloads = db.execute("SELECT item_id, segment FROM payloads ORDER BY item_id").fetchall()
        segs = db.execute("SELECT segment, items, bytes FROM segments ORDER BY segment").fetchall()
    return payloads, segs


async def test_big_payloads_go_to_a_segment_small_ones_stay_inline_and_both_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    sent = [b"a" * BIG, b"b" * (INLINE_BELOW - 1), b"c" * (BIG + 1)]
    store = SqliteStore(f"sqlite:///{path}")
    try:
        ids = await store.transact(_append(0, sent))
    finally:
        await store.close()
    payloads, segs = _rows(path)
    assert payloads == [(ids[0], 1), (ids[1], None), (ids[2], 1)]
    assert segs == [(1, 2, 2 * BIG + 1)]
    assert (segment_dir(path) / "00000001.seg").stat().st_size == 2 * BIG + 1
    store = SqliteStore(f"sqlite:///{path}")
    try:
        assert await store.transact(_pop_all(0)) == sent
    finally:
        await store.close()
    assert _rows(path) == ([], [(1, 0, 0)])  # the newest segment stays, for the next appends


async def test_a_sealed_segment_goes_with_its_last_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 2 * BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(_append(0, [bytes([i]) * BIG for i in range(5)]))  # segments 1, 1, 2, 2, 3
        await store.transact(_append(1, [b"kept" * BIG]))  # in segment 3 too
        assert sorted(p.name for p in segment_dir(path).iterdir()) == [f"0000000{n}.seg" for n in (1, 2, 3)]
        assert [len(p) for p in await store.transact(_pop_all(0))] == [BIG] * 5
        assert [p.name for p in segment_dir(path).iterdir()] == ["00000003.seg"]
        assert _rows(path)[1] == [(3, 1, 4 * BIG)]
        assert await store.transact(_pop_all(1)) == [b"kept" * BIG]
    finally:
        await store.close()


async def test_segment_files_no_row_refers_to_go_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file below the newest segment with no row (its unlink failed after the COMMIT that emptied it) is
    deleted when the store opens; one above the newest (a rolled-back rollover, reused by the next) stays."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 2 * BIG)
    path = tmp_path / "s.db"
    directory = segment_dir(path)
    store = SqliteStore(f"sqlite:///{path}")
    try:
        for env, n in ((0, 2), (1, 2), (2, 1)):  # segments 1, 2, 3: one env each
            await store.transact(_append(env, [bytes([env]) * BIG] * n))
        await store.transact(_pop_all(1))
        assert sorted(p.name for p in directory.iterdir()) == ["00000001.seg", "00000003.seg"]
    finally:
        await store.close()
    (directory / "00000002.seg").write_bytes(b"\1" * BIG)  # as an unlink that failed leaves it
    (directory / "00000009.seg").write_bytes(b"")
    store = SqliteStore(f"sqlite:///{path}")
    try:
        assert sorted(p.name for p in directory.iterdir()) == ["00000001.seg", "00000003.seg", "00000009.seg"]
        assert await store.transact(_pop_all(0)) == [b"\0" * BIG] * 2
        assert await store.transact(_pop_all(2)) == [b"\2" * BIG]
    finally:
        await store.close()


async def test_while_a_truncating_checkpoint_runs_the_writer_syncs_its_appends_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TRUNCATE checkpoint copies every commit, those made during its fsync of the segments too: meanwhile
    the writer fsyncs what it appended before its COMMIT (under NORMAL, otherwise never)."""
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(threading.current_thread().name)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = SqliteStore(f"sqlite:///{tmp_path / 's.db'}")
    try:
        await store.transact(_append(0, [b"a" * BIG]))
        assert "rollbuf-sqlite" not in synced
        checkpointer = store._checkpointer
        assert checkpointer is not None
        checkpointer.truncating.set()  # as `_checkpoint` does from before its fsync to the TRUNCATE's end
        try:
            await store.transact(_append(0, [b"b" * BIG]))
        finally:
            checkpointer.truncating.clear()
        during = synced.count("rollbuf-sqlite")
        assert during >= 1  # the segment (and the directory, where it was created since)
        await store.transact(_append(0, [b"c" * BIG]))
        assert synced.count("rollbuf-sqlite") == during
    finally:
        await store.close()


def test_a_truncating_checkpoint_holds_every_writer_off_from_its_fsync_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several processes on one file, a TRUNCATE checkpoint copies the commits of every one of them: it
    holds the writers' turn from before its fsync of the segments until the WAL is empty, so no writer of any
    process commits a row whose bytes the fsync missed. (A second owner of the lock is another process's
    writer, as far as the lock can tell.) A writer that keeps the turn makes it give up, not wait long."""
    from api.store.sqlite import checkpoint
    from api.store.sqlite.write_lock import WriteLock, WriteLockBusy

    path = tmp_path / "s.db"
    asyncio.run(_fill(path))
    directory = segment_dir(path)
    during: list[bool] = []
    real_sync = segments.sync_from

    def sync_from(where: Path, first: int) -> int:
        other = WriteLock(directory, 0.05)
        try:
            other.acquire()
            during.append(False)
            other.release()
        except WriteLockBusy:
            during.append(True)
        finally:
            other.close()
        return real_sync(where, first)

    monkeypatch.setattr(checkpoint, "sync_from", sync_from)
    monkeypatch.setattr(checkpoint, "TURN_WAIT_S", 0.1)
    checkpointer = checkpoint.Checkpointer(path, 1 << 20)  # idle: it checkpoints only when told of commits
    db = sqlite3.connect(path, isolation_level=None, timeout=0.2)
    other = WriteLock(directory, 1)
    try:
        assert checkpointer._checkpoint(db, "TRUNCATE")
        assert during == [True]  # held through the fsync
        with other:  # and given back at the end: another writer takes it at once
            assert checkpointer._checkpoint(db, "TRUNCATE") is False  # held by a writer: next round
        assert during == [True]  # it gave up before its fsync
        assert not checkpointer.truncating.is_set()
    finally:
        other.close()
        db.close()
        checkpointer.stop()


async def _fill(path: Path) -> None:
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(_append(0, [b"a" * BIG]))
    finally:
        await store.close()


async def test_clear_deletes_every_segment_and_numbers_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 2 * BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(_append(0, [b"x" * BIG] * 3))
        await store.transact(lambda t: t.clear())
        assert list(segment_dir(path).iterdir()) == []
        await store.transact(_append(0, [b"y" * BIG]))
        assert [p.name for p in segment_dir(path).iterdir()] == ["00000003.seg"]
        assert await store.transact(_pop_all(0)) == [b"y" * BIG]
    finally:
        await store.close()


async def test_a_segment_that_cannot_be_written_is_503_and_applies_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    segment_dir(path).mkdir()
    full = segment_dir(path) / "00000001.seg"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    store = SqliteStore(f"sqlite:///{path}")
    try:
        with pytest.raises(StoreUnavailable, match="SQLITE_FULL"):
            await store.transact(_append(0, [b"x" * BIG]))
        assert store.not_ready() is not None and "SQLITE_FULL" in store.not_ready()  # type: ignore[operator]
        assert await store.transact(lambda t: t.counts()) == {}
        full.unlink()  # space again
        await store.transact(_append(0, [b"y" * BIG]))
        assert store.not_ready() is None
        assert await store.transact(_pop_all(0)) == [b"y" * BIG]
    finally:
        await store.close()


async def test_a_payload_not_as_written_is_named_stays_queued_and_can_be_dropped_unread(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        lost, kept = await store.transact(_append(0, [b"x" * BIG, b"y" * BIG]))
        with open(segment_dir(path) / "00000001.seg", "r+b") as f:  # what power loss under NORMAL can leave
            f.write(b"\0" * 16)
        with pytest.raises(PayloadLost, match=f"the payload of item {lost}: .* are not those written") as caught:
            await store.transact(_pop_all(0))
        assert caught.value.item_ids == (lost,)
        assert (await store.transact(lambda t: t.counts()))[0].items == 2  # the pop was undone whole
        dropped = await store.transact(lambda t: t.drop_lost([lost, kept + 1]))  # one that is not queued: no-op
        assert dropped == {0: [(ItemMeta(lost, 1, 1, 0), 1)]}
        counts = (await store.transact(lambda t: t.counts()))[0]
        assert (counts.items, counts.bytes) == (1, BIG)
        assert await store.transact(_pop_all(0)) == [b"y" * BIG]
        assert _rows(path) == ([], [(1, 0, 0)])
    finally:
        await store.close()


def test_a_version_9_file_with_inline_payloads_serves_them_beside_new_ones(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with gzip.open(Path(__file__).parent / "old_files" / "sqlite-v9.db.gz") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    with sqlite3.connect(path) as db:
        env, *_ = db.execute("SELECT DISTINCT env_id FROM queue").fetchone()
        old = [p for (p,) in db.execute("SELECT payload FROM payloads JOIN queue USING (item_id) ORDER BY item_id")]

    async def run() -> list[bytes]:
        store = SqliteStore(f"sqlite:///{path}")
        try:
            await store.transact(_append(env, [b"new" * BIG]))
            return await store.transact(_pop_all(env))
        finally:
            await store.close()

    assert len(old) == 3 and asyncio.run(run()) == [*old, b"new" * BIG]


async def test_a_file_moved_without_its_segments_does_not_open_and_says_how_to_fix_it(tmp_path: Path) -> None:
    """An operator who copies or restores the file alone hears it at open, not as every queued group dropped as
    `payload_lost`; once the directory is back the store opens and serves everything."""
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(_append(0, [b"a" * BIG, b"b" * BIG]))
    finally:
        await store.close()
    aside = tmp_path / "aside"
    segment_dir(path).rename(aside)
    with pytest.raises(SegmentsMissing, match=r"restore the directory beside the file"):
        SqliteStore(f"sqlite:///{path}")
    assert not segment_dir(path).exists()  # nothing created in its place
    aside.rename(segment_dir(path))
    store = SqliteStore(f"sqlite:///{path}")
    try:
        assert await store.transact(_pop_all(0)) == [b"a" * BIG, b"b" * BIG]
    finally:
        await store.close()


async def test_a_segment_missing_from_its_directory_is_logged_at_open_and_its_groups_are_left_to_formation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a power loss under NORMAL may leave it (the newest segment's file gone with its bytes): the store
    opens, says which segments are missing, and the groups in the others serve."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        await store.transact(_append(0, [b"a" * BIG]))
        await store.transact(_append(1, [b"b" * BIG]))  # the first segment is full: a second one
    finally:
        await store.close()
    assert [s for s, _, _ in _rows(path)[1]] == [1, 2]
    (segment_dir(path) / "00000002.seg").unlink()
    store = SqliteStore(f"sqlite:///{path}")
    try:
        assert any("payload segments [2] are missing" in r.getMessage() for r in caplog.records)
        assert await store.transact(_pop_all(0)) == [b"a" * BIG]
        with pytest.raises(PayloadLost):
            await store.transact(_pop_all(1))
    finally:
        await store.close()


async def test_mostly_empty_sealed_segments_are_rewritten_into_the_newest_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-lived payload left in a sealed segment no longer holds the whole segment's disk: once at most a
    quarter of a sealed segment is live, its payloads are moved to the newest segment (and read back the same)
    and its file goes, so the directory stays within about four times the live payloads plus the newest."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 8 * BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    kept: dict[int, bytes] = {}
    try:
        for n in range(6):  # 6 segments of 8 payloads; of each, env 1 keeps one and env 0 the rest
            payloads = [bytes([n]) * BIG] + [bytes([n, k]) * (BIG // 2) for k in range(14)]
            ids = await store.transact(_append(1, payloads[:1]))
            kept[ids[0]] = payloads[0]
            await store.transact(_append(0, payloads[1:]))
        files_before = len(segments.numbers(segment_dir(path)))
        assert files_before >= 6
        await store.transact(_pop_all(0))  # env 0's go: each sealed segment is left with one payload
        for _ in range(files_before):  # each commit that follows compacts at most one segment
            await store.transact(lambda t: t.set_value("tick", "1"))
        files = segments.numbers(segment_dir(path))
        assert len(files) <= 2  # the newest, and the one the moved payloads filled
        payload_rows, segs = _rows(path)
        assert {segment for _, segment in payload_rows} <= set(files)
        assert sum(items for _, items, _ in segs) == len(kept)
        popped = await store.transact(lambda t: t.pop(1, [m.item_id for m in t.head(1)]))
        assert {it.meta.item_id: it.payload for it in popped} == kept
    finally:
        await store.close()


async def test_compaction_waits_for_the_writers_turn_and_leaves_the_segment_for_later_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compaction is a write transaction of its own: it takes the writers' turn first. Held by another
    process's writer past the wait, nothing is moved and the segment is left for later; with the turn, it
    is rewritten."""
    from api.store.sqlite.payloads import PayloadTier
    from api.store.sqlite.write_lock import WriteLock

    monkeypatch.setattr(segments, "SEGMENT_BYTES", 8 * BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        for n in range(4):  # sealed segments that keep one payload each once env 0's are popped
            await store.transact(_append(1, [bytes([n]) * BIG]))
            await store.transact(_append(0, [bytes([n, k]) * (BIG // 2) for k in range(14)]))
        await store.transact(_pop_all(0))  # its commit compacts one of them; the others wait for the next ones
    finally:
        await store.close()
    before = segments.numbers(segment_dir(path))
    db = sqlite3.connect(path, isolation_level=None)
    tier = PayloadTier.beside(path, "NORMAL")
    mine, other = WriteLock(segment_dir(path), 0.05), WriteLock(segment_dir(path), 1)
    try:
        with other:  # another process's writer has the turn
            assert tier.compact(db, "NORMAL", mine) is None
        assert any("left for later" in r.getMessage() for r in caplog.records)
        assert segments.numbers(segment_dir(path)) == before and not mine.held
        tier._compact_after = 0.0  # past the retry time
        assert tier.compact(db, "NORMAL", mine) in before
        assert len(segments.numbers(segment_dir(path))) == len(before) - 1 and not mine.held
    finally:
        for lock in (mine, other):
            lock.close()
        tier.close()
        db.close()


async def test_a_payload_that_does_not_read_back_is_left_where_it_is_and_not_retried_at_every_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Compaction moves only what reads back: a lost payload stays (formation drops it as `payload_lost`), the
    segment stays with it, and the next try waits COMPACT_RETRY_S instead of reading it again every commit."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 4 * BIG)
    path = tmp_path / "s.db"
    store = SqliteStore(f"sqlite:///{path}")
    try:
        [lost] = await store.transact(_append(1, [b"l" * BIG]))
        await store.transact(_append(0, [b"x" * BIG] * 4))  # fills segment 1: the next append starts segment 2
        await store.transact(_append(0, [b"y" * BIG]))
        with (segment_dir(path) / "00000001.seg").open("r+b") as f:
            f.write(b"\0" * 16)  # the lost payload's first bytes
        await store.transact(lambda t: t.pop(0, [m.item_id for m in t.head(0)]))  # segment 1: only the lost one
        for _ in range(5):
            await store.transact(lambda t: t.set_value("tick", "1"))
        assert 1 in segments.numbers(segment_dir(path))
        assert sum("compacting payload segment 1" in r.getMessage() for r in caplog.records) == 1  # tried once
        with pytest.raises(PayloadLost) as caught:
            await store.transact(lambda t: t.pop(1, [m.item_id for m in t.head(1)]))
        assert caught.value.item_ids == (lost,)
    finally:
        await store.close()
