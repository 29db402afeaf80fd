"""WAL checkpoints on a thread and connection of their own, off the writer's path, with the WAL kept bounded."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from api.store.sqlite.segments import segment_dir, sync_from
from api.store.sqlite.write_lock import WriteLock, WriteLockBusy

log = logging.getLogger("rollbuf")

CHECKPOINT_EVERY = 256
"""Commits between two WAL checkpoints (each also runs at least once a second while there are commits)."""
TRUNCATE_WAIT_S = 0.2
"""How long a truncating checkpoint waits for the writer and readers to step aside: it blocks new writes
while it waits, so it gives up early and tries again next round rather than stall ingest."""
TURN_WAIT_S = 1.0
"""How long a truncating checkpoint waits for the writers' turn (write_lock.py) before trying next round."""


class Checkpointer:
    """Copies the WAL back into the database file on its own thread and connection, and keeps the WAL short.

    SQLite's automatic checkpoint runs inside the COMMIT that crosses its threshold, fsync included, so one
    writer transaction in ~40 would wait for it. A PASSIVE checkpoint from another connection never blocks
    the writer; but it never restarts the WAL either, which only happens when no reader holds an older
    snapshot at the moment a writer begins. So past `truncate_bytes` (the store URL's `wal_limit`) a round's
    PASSIVE checkpoint is
    followed by a TRUNCATE one, which waits (briefly) for readers and the writer, copies the little the
    PASSIVE one left and empties the file; once commits stop, one TRUNCATE gives the disk back. Errors are
    logged once per episode, never swallowed: a failing checkpoint is a disk filling up.

    Rows point into segment files (api/store/sqlite/segments.py) that the writer only hands to the OS; before a
    checkpoint makes rows durable, the segments written since the last one are fsynced. A PASSIVE checkpoint
    copies no frame past a snapshot taken before that fsync (a read transaction held on a second connection
    bounds it), so it never makes a row durable whose bytes are not. A TRUNCATE one cannot be bounded so (it
    copies every commit, and SQLite runs none inside a transaction that could hold writers off), so it takes
    the writers' turn (write_lock.py) from before its fsync until it ends: no writer of any process sharing
    the file (`--workers N`) commits in between, and every commit it copies appended its bytes before the
    fsync. Where the file system has no flock, `truncating` is set over the same span instead, and this
    process's writer fsyncs what it appended before each COMMIT meanwhile, as `synchronous=FULL` does
    (PayloadTier.before_commit); another process's commit made during the fsync may then still be copied, its
    bytes not on disk, and under power loss before the next round read as lost (the crc says so; formation
    drops such a group as `payload_lost`), as its commit itself might have been lost."""

    def __init__(self, path: Path, truncate_bytes: int) -> None:
        self._path = path
        self._truncate_bytes = truncate_bytes
        """Under continuous commits and reads the WAL grew without bound (2.3 GB in 15 s of two handlers'
        ingest); with truncation past this, the bound is this plus one round's commits."""
        self._wal = path.with_name(path.name + "-wal")
        self._segments = segment_dir(path)
        self._synced_from = 0
        """The newest segment at the last fsync of the segments (appends go there and above only)."""
        self._wake = threading.Event()
        self._stopping = False
        self._commits = 0
        self._dirty = False
        """Commits since the WAL was last emptied."""
        self._failing = False
        self.truncating = threading.Event()
        """Set while a TRUNCATE checkpoint is under way, its fsync of the segments included: the writer syncs
        its appends before each COMMIT meanwhile (it matters where the writers' turn is not to be had)."""
        self._segments.mkdir(parents=True, exist_ok=True)
        self._turn = WriteLock(self._segments, TURN_WAIT_S)
        """The writers' turn, taken by a TRUNCATE checkpoint (an owner of its own: this process's writer waits
        for it like any other)."""
        self.failure: str | None = None
        """Why the last checkpoint failed (other than busy), until one works again: /readyz reports it."""
        self._thread = threading.Thread(target=self._main, name="rollbuf-sqlite-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Called by the writer thread after each COMMIT."""
        self._commits += 1
        if self._commits >= CHECKPOINT_EVERY:
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def wal_bytes(self) -> int:
        try:
            return self._wal.stat().st_size
        except FileNotFoundError:
            return 0

    def _main(self) -> None:
        # A PASSIVE checkpoint never waits; the busy timeout is how long a TRUNCATE one may hold writes back.
        db = sqlite3.connect(self._path, isolation_level=None, timeout=TRUNCATE_WAIT_S, check_same_thread=True)
        pin = sqlite3.connect(self._path, isolation_level=None, timeout=TRUNCATE_WAIT_S, check_same_thread=True)
        try:
            while not self._stopping:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                if self._stopping:
                    break
                if self._commits:
                    self._commits = 0
                    self._dirty = True
                    self._passive(db, pin)  # the copying, without blocking anyone
                    if self.wal_bytes() > self._truncate_bytes:  # then the restart, with little left to copy
                        self._dirty = not self._checkpoint(db, "TRUNCATE")
                elif self._dirty:  # commits stopped: give the WAL's disk back
                    self._dirty = not self._checkpoint(db, "TRUNCATE")
        finally:
            pin.close()
            db.close()
            self._turn.close()

    def _passive(self, db: sqlite3.Connection, pin: sqlite3.Connection) -> None:
        """A PASSIVE checkpoint of what was committed before the segments' fsync (`pin` holds that snapshot)."""
        try:
            pin.execute("BEGIN")
            pin.execute("SELECT 1 FROM meta LIMIT 1").fetchall()
        except sqlite3.OperationalError:
            self._checkpoint(db, "PASSIVE")  # no snapshot to bound it (busy): the fsync just before still holds
            return
        try:
            self._checkpoint(db, "PASSIVE")
        finally:
            pin.execute("COMMIT")

    def _sync_segments(self) -> bool:
        try:
            self._synced_from = sync_from(self._segments, self._synced_from)
        except OSError as exc:
            self._failed("segments", exc)
            return False
        return True

    def _failed(self, mode: str, exc: BaseException) -> None:
        if not self._failing:
            self._failing = True
            log.warning("SQLite WAL checkpoint failing (%s), the WAL at %d bytes: %s", mode, self.wal_bytes(), exc)
        self.failure = f"the WAL checkpoint fails ({exc}), the WAL at {self.wal_bytes()} bytes"

    def _checkpoint(self, db: sqlite3.Connection, mode: str) -> bool:
        """One checkpoint, after an fsync of the segments; True when it completed (for TRUNCATE: the WAL is
        empty)."""
        truncate = mode == "TRUNCATE"
        if truncate:
            try:
                self._turn.acquire()  # no writer commits until the WAL is empty (the class's docstring)
            except WriteLockBusy:
                return False  # the writers kept it: next round
            self.truncating.set()  # and this process's writer syncs before each COMMIT where there is no flock
        try:
            if not self._sync_segments():
                return False  # no row is made durable before its bytes are
            busy, _, _ = db.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorname in ("SQLITE_BUSY", "SQLITE_LOCKED"):
                return False  # the writer or a reader did not step aside in time: next round
            self._failed(mode, exc)
            return False
        finally:
            if truncate:
                self.truncating.clear()
                self._turn.release()
        if self._failing:
            self._failing = False
            self.failure = None
            log.info("SQLite WAL checkpoint working again, the WAL at %d bytes", self.wal_bytes())
        return bool(busy == 0)
