"""The SQLite store's payload rows over its segment files (api/store/sqlite/segments.py): a payload of
INLINE_BELOW bytes or more goes to a segment and its row says where; a smaller one stays in the row.

The `segments` table counts each segment's live payloads, kept by triggers on `payloads` (schema.py), so
every statement that inserts or deletes payload rows keeps it right in its own transaction. A segment that
is not the newest and has no live payload left is deleted: its row before the COMMIT, its file after it (a
transaction that fails loses no file). All transactions take the write lock (`BEGIN IMMEDIATE`), so no
other process can be reading a segment that a committed transaction emptied.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from api.store.base import PayloadLost
from api.store.sqlite.segments import Extent, PayloadCorrupt, Segments, SegmentWriteError, numbers, segment_dir
from api.store.sqlite.write_lock import WriteLock

log = logging.getLogger("rollbuf")

INLINE_BELOW = 4096
"""Payloads shorter than this stay in their row: a pread and a crc would cost more than the B-tree's copy."""
INSERT = "INSERT INTO payloads (item_id, payload, segment, pos, length, crc) VALUES (?,?,?,?,?,?)"
COLUMNS = "item_id, payload, segment, pos, length, crc"
"""What a read of `payloads` selects, for `PayloadTier.resolve`."""
_DOOMED = "DELETE FROM segments WHERE items = 0 AND segment < (SELECT max(segment) FROM segments) RETURNING segment"
COMPACT_FRACTION = 4
"""A sealed segment with at most 1/COMPACT_FRACTION of a segment's bytes live is rewritten into the newest
(`PayloadTier.compact`): the directory then holds at most about COMPACT_FRACTION times the live payloads, plus
the newest segment; each rewrite copies at most that fraction to free the rest."""
COMPACT_RETRY_S = 30.0
"""After a compaction that failed (a full disk, the lock held long by another process) or could not empty its
segment (a payload that does not read back), the next waits this long, not the next commit."""
_COMPACTABLE = (
    "SELECT segment FROM segments WHERE items > 0 AND bytes <= ? AND segment < (SELECT max(segment) FROM segments) "
    "ORDER BY bytes LIMIT 1"
)
_FORGET_EVERY = 256
"""Transactions between two looks for segments other processes deleted (their descriptors closed)."""

PayloadRow = Sequence[Any]


class PayloadTier:
    """The writer thread's side of the segments, across its transactions."""

    def __init__(self, segments: Segments, *, full_sync: bool, sync_now: Callable[[], bool] = lambda: False) -> None:
        self.segments = segments
        self.full_sync = full_sync
        """`synchronous=FULL`: the segments are fsynced before each COMMIT that references what they got."""
        self.sync_now = sync_now
        """Whether to do so for this COMMIT anyway: a TRUNCATE checkpoint, which copies every commit, is under
        way (api/store/sqlite/checkpoint.py)."""
        self._doomed: list[int] = []
        self._transactions = 0
        self._compact_after = 0.0
        """No compaction before this (monotonic s): one failed or left a payload behind."""

    @classmethod
    def beside(cls, path: Path, synchronous: str, sync_now: Callable[[], bool] = lambda: False) -> PayloadTier:
        """The tier of the SQLite file `path` (its directory `<file>.payloads/`, created if need be)."""
        return cls(Segments(segment_dir(path)), full_sync=synchronous == "FULL", sync_now=sync_now)

    # --- around a transaction (the driver) ---
    def begin(self) -> None:
        self.segments.stop()
        self._doomed = []
        self._transactions += 1
        if self._transactions >= _FORGET_EVERY:
            self._transactions = 0
            self.segments.forget_deleted()

    def before_commit(self, db: sqlite3.Connection) -> None:
        """The segments emptied by this transaction go, rows now and files after COMMIT; with FULL, or while a
        TRUNCATE checkpoint runs, what was appended reaches the disk first."""
        if (self.segments.written or self.segments.created) and (self.full_sync or self.sync_now()):
            try:
                self.segments.sync()
            except OSError as exc:
                raise SegmentWriteError(f"payload segments: fsync failed: {exc}", "SQLITE_IOERR") from exc
        self._doomed = [row[0] for row in db.execute(_DOOMED).fetchall()]

    def committed(self) -> None:
        doomed, self._doomed = self._doomed, []
        self.segments.stop()
        if doomed:
            try:
                self.segments.delete(doomed)
            except OSError as exc:  # committed: an orphan file wastes disk, it loses nothing
                log.warning("payload segments %s emptied, not deleted: %s", doomed, exc)

    def rolled_back(self) -> None:
        self._doomed = []
        self.segments.stop()

    # --- compaction (the writer thread, between group commits) ---
    def compact(self, db: sqlite3.Connection, synchronous: str, lock: WriteLock) -> int | None:
        """Rewrite the live payloads of one mostly-empty sealed segment (at most COMPACT_BELOW bytes live) into
        the newest, and delete it: a segment's disk is otherwise held until its last payload goes, so a few
        long-lived payloads spread over many segments would each hold a whole one. Its own transaction, in the
        writers' turn (`lock`), with `synchronous=FULL` (the moved bytes and the COMMIT durable before the old
        file goes: a power loss cannot take payloads that were safe before). Best effort: a failure is logged
        and left for later. Returns the segment emptied, or None."""
        if time.monotonic() < self._compact_after:
            return None
        row = db.execute(_COMPACTABLE, (self.segments.limit // COMPACT_FRACTION,)).fetchone()
        if row is None:
            return None
        source = int(row[0])
        self._compact_after = time.monotonic() + COMPACT_RETRY_S  # unless it empties the segment (below)
        db.execute("PRAGMA synchronous = FULL")
        try:
            with lock:
                db.execute("BEGIN IMMEDIATE")
                try:
                    moved = self._move(db, source)
                    if moved and (self.segments.written or self.segments.created):
                        self.segments.sync()
                    doomed = [r[0] for r in db.execute(_DOOMED).fetchall()]
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
                finally:
                    self.segments.stop()
        except Exception as exc:  # a full disk, the lock held by another process too long: ingest goes on
            log.warning("compacting payload segment %d failed, left for later: %s", source, exc)
            return None
        finally:
            db.execute(f"PRAGMA synchronous = {synchronous}")
        if source not in doomed:  # a payload that does not read back stays: not again before the retry time
            return None
        self._compact_after = 0.0
        try:
            self.segments.delete(doomed)
        except OSError as exc:
            log.warning("payload segments %s emptied, not deleted: %s", doomed, exc)
        return source

    def _move(self, db: sqlite3.Connection, source: int) -> int:
        """Rewrite `source`'s payload rows into the newest segment (DELETE and INSERT: the triggers count); how
        many. One whose bytes do not read back is left where it is (formation drops it as `payload_lost`)."""
        rows = db.execute(f"SELECT {COLUMNS} FROM payloads WHERE segment = ?", (source,)).fetchall()
        moved = 0
        for item_id, _, segment, pos, length, crc in rows:
            try:
                data = self.segments.read(Extent(segment, pos, length, crc), f"the payload of item {item_id}")
            except PayloadCorrupt as exc:
                log.error("compacting payload segment %d: %s; left in place", source, exc)
                continue
            new = self.row(db, item_id, data)
            db.execute("DELETE FROM payloads WHERE item_id = ?", (item_id,))
            db.execute(INSERT, new)
            moved += 1
        return moved

    def close(self) -> None:
        self.segments.close()

    # --- a function's rows ---
    def row(self, db: sqlite3.Connection, item_id: int, payload: bytes) -> PayloadRow:
        """The `payloads` row (INSERT's values) of `payload`, its bytes appended to a segment if they go there."""
        if len(payload) < INLINE_BELOW:
            return (item_id, payload, None, None, None, None)
        segments = self.segments
        if not segments.started:
            newest = db.execute("SELECT max(segment) FROM segments").fetchone()[0]
            segments.start(1 if newest is None else int(newest))
        e = segments.append(payload)
        return (item_id, b"", e.segment, e.pos, e.length, e.crc)

    def resolve(self, rows: Iterable[PayloadRow]) -> dict[int, bytes]:
        """Payload by item id, from rows of `COLUMNS` (read from their segments where they are there);
        `PayloadLost` naming every one whose bytes are not those written (each read, so all are named at once)."""
        out: dict[int, bytes] = {}
        lost: dict[int, str] = {}
        read = self.segments.read
        for item_id, payload, segment, pos, length, crc in rows:
            if segment is None:
                out[item_id] = payload
                continue
            try:
                out[item_id] = read(Extent(segment, pos, length, crc), f"the payload of item {item_id}")
            except PayloadCorrupt as exc:
                lost[item_id] = str(exc)
        if lost:
            raise PayloadLost(sorted(lost), "; ".join(lost[i] for i in sorted(lost)))
        return out

    def clear(self, db: sqlite3.Connection) -> None:
        """`payloads` was emptied: every segment goes at COMMIT, appends start a new one (numbers never repeat:
        another process may hold a descriptor of an old one)."""
        newest = db.execute("SELECT max(segment) FROM segments").fetchone()[0]
        if newest is not None:
            db.execute("UPDATE segments SET items = 0, bytes = 0")
            db.execute("INSERT INTO segments (segment, items, bytes) VALUES (?, 0, 0)", (int(newest) + 1,))
        self.segments.stop()


class SegmentsMissing(RuntimeError):
    """The SQLite file refers to live payload segments and its `.payloads` directory is not there: the file was
    copied or restored alone. The store does not open (serving would drop every queued group as lost)."""


def check_present(db: sqlite3.Connection, path: Path) -> None:
    """At open: an operator who moved or restored the file without its directory hears it at once, with the
    fix (SegmentsMissing), instead of seeing the queued groups dropped one by one as `payload_lost`. Segments
    missing from a directory that is there are logged as an error and left to formation's `payload_lost`: a
    power loss under NORMAL may lose the newest segments' files with their bytes, and the rest must serve."""
    live = [int(row[0]) for row in db.execute("SELECT segment FROM segments WHERE items > 0 ORDER BY segment")]
    if not live:
        return
    directory = segment_dir(path)
    if not directory.is_dir():
        raise SegmentsMissing(
            f"{path} refers to {len(live)} payload segment(s) in {directory}, which is not there: the store is "
            "the file and that directory; restore the directory beside the file, as it was backed up with it "
            "(docs/stores.md)"
        )
    present = set(numbers(directory))
    missing = [n for n in live if n not in present]
    if missing:
        log.error(
            "payload segments %s are missing from %s: their queued groups will be dropped as payload_lost "
            "when a batch picks them (restore them now, with the server stopped, if they were backed up)",
            missing,
            directory,
        )


def delete_orphans(db: sqlite3.Connection, path: Path) -> list[int]:
    """Delete the segment files of the SQLite file `path` that no `segments` row refers to and that are older
    than the newest row's: a rollover whose transaction rolled back, an emptied segment whose unlink failed
    after its COMMIT. Under the write lock (no other process is between an append and its COMMIT), at open,
    one pass over the directory; appends only go to the newest segment and above, so no row can come to refer
    to an older one. Returns the segments deleted."""
    rows = {int(row[0]) for row in db.execute("SELECT segment FROM segments")}
    if not rows:
        return []
    newest = max(rows)
    directory = segment_dir(path)
    orphans = [n for n in numbers(directory) if n < newest and n not in rows]
    if not orphans:
        return []
    segments = Segments(directory)
    try:
        segments.delete(orphans)
    except OSError as exc:  # nothing is lost: the disk stays used until the next open
        log.warning("payload segments %s refer to no payload, not all deleted: %s", orphans, exc)
        return []
    finally:
        segments.close()
    log.warning(
        "payload segments %s referred to no payload (a rolled-back rollover, a failed unlink): deleted", orphans
    )
    return orphans
