"""The writers' turn between processes sharing a SQLite file (api/store/sqlite/write_lock.py): a waiter is
woken when the holder lets go, a wait has SQLite's bound and is answered as SQLite's busy error, a turn that
comes too late is given back, and a process that dies lets go."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from api.store.base import ItemMeta, QueuedItem, StoreUnavailable, Txn
from api.store.sqlite import SqliteStore
from api.store.sqlite import store as sqlite_store
from api.store.sqlite.segments import segment_dir
from api.store.sqlite.store import trouble
from api.store.sqlite.write_lock import WriteLock, WriteLockBusy

pytestmark = pytest.mark.anyio

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _until(done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextmanager
def held_by_another_process(directory: Path) -> Iterator[subprocess.Popen[str]]:
    """A process holding the directory's flock until it is killed (`kill -9`, by its pid)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_a_waiting_writer_gets_the_turn_when_the_holder_gives_it_back(tmp_path: Path) -> None:
    a, b = WriteLock(tmp_path, 10), WriteLock(tmp_path, 10)
    try:
        a.acquire()
        got = threading.Thread(target=b.acquire)
        got.start()
        _until(lambda: b._waiter is not None and b._waiter._asked == 1, "b waits for its turn in the waiter")
        assert not b.held
        a.release()
        got.join(10)
        assert b.held and not a.held
        b.release()
        a.acquire()  # and back, without waiting: b's waiter gave nothing it does not hold
        assert a.held
    finally:
        a.close()
        b.close()


def test_a_wait_past_the_timeout_is_sqlite_busy_and_the_late_turn_is_given_back(tmp_path: Path) -> None:
    a, b, c = WriteLock(tmp_path, 10), WriteLock(tmp_path, 0.2), WriteLock(tmp_path, 10)
    try:
        a.acquire()
        with pytest.raises(WriteLockBusy) as busy:
            b.acquire()
        assert not b.held
        assert trouble(busy.value) is not None  # answered as SQLite's own busy error: 503 + Retry-After
        assert busy.value.sqlite_errorname == "SQLITE_BUSY"
        a.release()
        # b's waiter was still blocked for it: it takes the lock as a lets go and gives it back at once
        assert b._waiter is not None
        _until(lambda: b._waiter is not None and b._waiter._served == 1, "b's waiter got its late turn")
        c.acquire()  # not left held by anyone
        assert c.held
        c.release()
        b.acquire()  # and b waits again as before
        assert b.held
    finally:
        for lock in (a, b, c):
            lock.close()


def test_many_owners_take_turns_one_at_a_time(tmp_path: Path) -> None:
    """Four owners (as four processes) each take 200 turns; no two ever hold it together."""
    locks = [WriteLock(tmp_path, 10) for _ in range(4)]
    inside = 0
    most = 0
    guard = threading.Lock()

    def turns(lock: WriteLock) -> None:
        nonlocal inside, most
        for _ in range(200):
            with lock:
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0)  # let another thread run while it is held
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=turns, args=(lock,)) for lock in locks]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert most == 1
    finally:
        for lock in locks:
            lock.close()


def test_a_killed_holder_lets_go(tmp_path: Path) -> None:
    lock = WriteLock(tmp_path, 10)
    try:
        with held_by_another_process(tmp_path) as holder:
            waiting = threading.Thread(target=lock.acquire)
            waiting.start()
            _until(lambda: lock._waiter is not None and lock._waiter._asked == 1, "the writer waits")
            os.kill(holder.pid, signal.SIGKILL)
            waiting.join(10)
        assert lock.held
    finally:
        lock.close()


async def test_a_store_whose_turn_never_comes_answers_503_then_writes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the writers' lock and never lets go (stopped, hung): each write waits the bounded
    time and is answered 503 + Retry-After, as when SQLite's own lock is held too long; once it is gone, the
    next write goes through."""
    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_S", 0.3)
    store = SqliteStore(f"sqlite:///{tmp_path}/held.db")

    def append(t: Txn) -> int:
        item_id = t.next_item_id()
        t.append(0, QueuedItem(ItemMeta(item_id, 1, 4, 0), 1, b"p"))
        return item_id

    try:
        await store.transact(append)
        with held_by_another_process(segment_dir(tmp_path / "held.db")):
            with pytest.raises(StoreUnavailable) as unavailable:
                await asyncio.wait_for(store.transact(append), 10)
            assert "another process held the write lock" in str(unavailable.value)
        await store.transact(append)
        assert (await store.transact(lambda t: t.counts()))[0].items == 2
    finally:
        await store.close()


def test_a_file_system_without_flock_leaves_the_turns_to_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where flock answers ENOLCK (some network file systems), writing goes on, ordered by SQLite's lock alone,
    and the log says so once. (The syscall's answer is forced: no such file system mounts here.)"""

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    lock = WriteLock(tmp_path, 1)
    try:
        monkeypatch.setattr("api.store.sqlite.write_lock.fcntl.flock", no_flock)
        with caplog.at_level("WARNING", logger="rollbuf"):
            lock.acquire()
            lock.release()
            lock.acquire()
        assert lock.unsupported and not lock.held
        assert len([r for r in caplog.records if "no flock here" in r.getMessage()]) == 1
    finally:
        monkeypatch.undo()
        lock.close()
