"""The writers' turn between processes sharing one SQLite file (`--workers N`): an flock taken before
`BEGIN IMMEDIATE` and given back after COMMIT, so a writer waiting for another process's transaction wakes
when it ends.

SQLite's own wait for a held write lock is a poll: its busy handler sleeps 1, 2, 5, 10, ... ms between tries.
Two server processes take turns of a few hundred microseconds each, so the one that found the lock held would
sleep longer than the other held it, and two processes would ingest no more than one. A waiter blocked in
`flock` is woken by the kernel as the holder lets go (`python -m bench.limit --workers 2 --clients 32`, in turns
with SQLite's wait alone: lists of 16 small groups 6,863 groups/s against 3,673, large groups 965/s against 706;
docs/stores-sqlite.md).

The wait keeps SQLite's bound (`timeout`), which a blocking `flock` has not: it blocks in a thread of its own
(`_Waiter`), on a descriptor of its own, while the writer waits for it with the timeout; a turn that comes
after the writer gave up is given back at once. The lock is the payload directory's (a descriptor of the
directory, no file of its own), taken by rollbuf's writers only: SQLite's lock still guards the file against
everyone else (the `sqlite3` shell, a backup), its busy handler still waits for them. The kernel drops an
flock with the process that held it, `kill -9` included. Local file systems only, as SQLite's WAL mode is.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from pathlib import Path

from api.store.sqlite.segments import SegmentWriteError

log = logging.getLogger("rollbuf")
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL)
"""What `flock` answers on a file system without it: the writers then wait by SQLite's lock alone."""


class WriteLockBusy(SegmentWriteError):
    """Another process held the writers' lock for longer than the timeout: spelled as SQLite's SQLITE_BUSY,
    so it is answered as SQLite's own (503 + Retry-After)."""

    def __init__(self, directory: Path, timeout: float) -> None:
        super().__init__(f"{directory}: another process held the write lock for {timeout:g} s", "SQLITE_BUSY")


class WriteLock:
    """One writer's side of the lock (the writer thread's: not for several threads of one process). Each
    instance is an owner of its own, as another process would be: two stores on one file in one process
    take turns too."""

    def __init__(self, directory: Path, timeout: float) -> None:
        self.directory = directory
        self.timeout = timeout
        self._fd = _open(directory)
        self._waiter: _Waiter | None = None
        self._held_by: int | None = None
        """The descriptor holding the lock while this writer has its turn (its own, or the waiter's)."""
        self.unsupported = False
        """The file system has no flock: turns are left to SQLite's lock (slower with several processes)."""

    @property
    def held(self) -> bool:
        return self._held_by is not None

    def acquire(self) -> None:
        """Take the turn, waiting at most `timeout` for another writer to give it back (`WriteLockBusy`)."""
        assert self._held_by is None, "the writers' lock is not reentrant"
        if self.unsupported:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._held_by = self._fd
            return
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in UNSUPPORTED:
                raise
            self.unsupported = True
            log.warning("%s: no flock here (%s); writers wait by SQLite's lock alone", self.directory, exc)
            return
        if self._waiter is None:
            self._waiter = _Waiter(self.directory)
        if not self._waiter.wait(self.timeout):
            raise WriteLockBusy(self.directory, self.timeout)
        self._held_by = self._waiter.fd

    def release(self) -> None:
        """Give the turn back (nothing if this writer does not hold it)."""
        fd, self._held_by = self._held_by, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def __enter__(self) -> WriteLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def close(self) -> None:
        self.release()
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        os.close(self._fd)


class _Waiter:
    """A thread blocked in `flock` for the writer, on a descriptor of its own (a second owner: the writer's
    own descriptor may take the lock meanwhile without the two mistaking each other's turns). Requests are
    numbered; the writer gives up on one past its timeout, and a turn that comes for a request given up on
    is given back at once."""

    def __init__(self, directory: Path) -> None:
        self.fd = _open(directory)
        self._cond = threading.Condition()
        self._asked = 0
        """The newest request's number."""
        self._served = 0
        """The newest request the thread took the lock for, or gave it back for (given up)."""
        self._granted = 0
        """The newest request whose turn the writer has."""
        self._given_up = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rollbuf-sqlite-write-lock", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether the lock is taken on `self.fd` for the writer within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._asked += 1
            number = self._asked
            self._cond.notify_all()
            while self._granted < number:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._given_up = number
                    return False
                self._cond.wait(left)
            return True

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            os.close(self.fd)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._asked <= self._served:
                    self._cond.wait()
                if self._closed:
                    return
                number = self._asked
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # blocks until the holder lets go (or dies)
            with self._cond:
                self._served = number
                if self._given_up >= number or self._closed:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
                else:
                    self._granted = number
                    self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread, which closes its descriptor as it ends. One blocked in `flock` ends when its turn
        comes (given back at once), or with the process (a daemon): closing does not wait for it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _open(directory: Path) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
