"""WAL checkpoints on a thread and connection of their own, off the writer's path."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

from api.store.sqlite.config import BUSY_TIMEOUT_S

CHECKPOINT_EVERY = 256
"""Commits between two WAL checkpoints (each also runs at least once a second while there are commits)."""


class Checkpointer:
    """Copies the WAL back into the database file on its own thread and connection.

    SQLite's automatic checkpoint runs inside the COMMIT that crosses its threshold, fsync included, so one
    writer transaction in ~40 would wait for it. A PASSIVE checkpoint from another connection never blocks
    the writer, and the WAL stays as short as if the writer had checkpointed itself."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._wake = threading.Event()
        self._stopping = False
        self._commits = 0
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

    def _main(self) -> None:
        db = sqlite3.connect(self._path, isolation_level=None, timeout=BUSY_TIMEOUT_S, check_same_thread=True)
        try:
            while not self._stopping:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                if self._commits and not self._stopping:
                    self._commits = 0
                    with contextlib.suppress(sqlite3.Error):  # busy now: the next round catches up
                        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            db.close()
