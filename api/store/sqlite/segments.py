"""Append-only segment files: where the SQLite store keeps payload bytes (the payload tier), SQLite keeping
only where each payload is (`Extent`).

A payload in a B-tree of 64 KiB pages was written three times and more (overflow pages, their WAL frames,
the checkpoint's copy, the last page of the table rewritten whole by every commit); here its bytes are
written once, by `os.pwrite`, and read by `os.pread`. Segments are numbered `NNNNNNNN.seg` in one directory;
appends go to the newest until it passes `limit` bytes, then the next number starts. Nothing here knows SQL:
the caller says which segment is newest (its index's), under a lock that orders appenders (SQLite's write
lock), and where each append landed is taken from the file (`fstat`), never from memory of an earlier
transaction, since another process may have appended since. Bytes that no row references (a rolled-back
append, a torn tail after a crash) are garbage, never read. File descriptors are cached per process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from isal.isal_zlib import crc32

SEGMENT_BYTES = 64 << 20
"""A segment past this size is sealed: the next append starts a new one. A sealed segment's disk comes back
when its last payload is gone, so smaller ones give disk back sooner; larger ones mean fewer files."""

_NAME = re.compile(r"(\d{8})\.seg")
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, slots=True)
class Extent:
    """Where a payload's bytes are, and their crc32 (zlib's polynomial; ISA-L's folding code computes it in a
    third of zlib's time: 20 µs for a 262 KB group here, 63 with `zlib.crc32`)."""

    segment: int
    pos: int
    length: int
    crc: int


class SegmentWriteError(sqlite3.OperationalError):
    """An append failed (a full disk, an I/O error): spelled as SQLite's own error of the same kind, so the
    store answers it as it answers SQLite's (503 + Retry-After, api/store/sqlite/store.py `trouble`)."""

    def __init__(self, message: str, errname: str) -> None:
        super().__init__(message)
        self.sqlite_errorname = errname


class PayloadCorrupt(RuntimeError):
    """A payload's bytes are not what was written: a segment lost its tail (power loss under
    `synchronous=NORMAL` before the segment reached the disk) or was changed outside rollbuf."""


def segment_dir(db_path: Path) -> Path:
    """The payload tier of the SQLite file `db_path`: a directory beside it."""
    return db_path.with_name(db_path.name + ".payloads")


class Segments:
    """The segment files of one directory, as one process sees them (not thread-safe: the writer thread's)."""

    def __init__(self, directory: Path, limit: int | None = None) -> None:
        self.directory = directory
        self.limit = SEGMENT_BYTES if limit is None else limit
        directory.mkdir(parents=True, exist_ok=True)
        self._fds: dict[int, int] = {}
        self._current: int | None = None
        """The segment appends go to in this transaction (None: not known yet, `start`)."""
        self._end = 0
        self.written: set[int] = set()
        """Segments appended to since `synced` (what `synchronous=FULL` fsyncs before its COMMIT)."""
        self.created = False
        """A segment file was created since `synced` (the directory needs an fsync too)."""

    def path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}.seg"

    def numbers(self) -> list[int]:
        """The segments on disk, in order."""
        return numbers(self.directory)

    # --- appending (under the lock that orders appenders) ---
    @property
    def started(self) -> bool:
        return self._current is not None

    def start(self, newest: int) -> None:
        """The first append of a transaction: to `newest` (created if need be), at its end as it is now."""
        self._open_at(newest)

    def stop(self) -> None:
        """The transaction ended: the next one starts from the files again."""
        self._current = None

    def append(self, data: bytes) -> Extent:
        """Write `data` at the end of the current segment (`start` first); a new segment once it is full."""
        if self._current is None:
            raise RuntimeError("Segments.append before start")
        if self._end >= self.limit:
            self._open_at(self._current + 1)
        segment, pos = self._current, self._end
        fd = self._fds[segment]
        view = memoryview(data)
        done = 0
        try:
            while done < len(view):  # a short write (the disk filling) is followed by the error that says why
                done += os.pwrite(fd, view[done:], pos + done)
        except OSError as exc:
            os.close(self._fds.pop(segment))  # opened afresh next time (the file may have been replaced)
            self._current = None
            name = "SQLITE_FULL" if exc.errno in _FULL else "SQLITE_IOERR"
            raise SegmentWriteError(f"payload segment {self.path(segment)}: {exc.strerror or exc}", name) from exc
        finally:
            self._end = pos + done  # written or not, those bytes are the file's now: garbage nobody refers to
        self.written.add(segment)
        return Extent(segment, pos, len(view), crc32(view))

    def _open_at(self, segment: int) -> None:
        fd = self._fds.get(segment)
        if fd is None:
            fd = self._open(segment, create=True)
        end = os.fstat(fd).st_size
        if end >= self.limit:  # sealed: the next one
            self._open_at(segment + 1)
            return
        self._current, self._end = segment, end

    def _open(self, segment: int, *, create: bool) -> int:
        path = self.path(segment)
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(path, flags | os.O_CREAT, 0o644)
            except OSError as exc:
                name = "SQLITE_FULL" if exc.errno in _FULL else "SQLITE_CANTOPEN"
                raise SegmentWriteError(f"payload segment {path}: {exc.strerror or exc}", name) from exc
            self.created = True
        self._fds[segment] = fd
        return fd

    # --- reading ---
    def read(self, extent: Extent, what: str = "a payload") -> bytes:
        """The bytes at `extent`, checked against its crc32 (PayloadCorrupt if they differ or are missing)."""
        try:
            fd = self._fds.get(extent.segment)
            if fd is None:
                fd = self._open(extent.segment, create=False)
            data = os.pread(fd, extent.length, extent.pos)
        except FileNotFoundError:
            raise PayloadCorrupt(f"{what}: its segment {self.path(extent.segment)} is missing") from None
        if len(data) != extent.length or crc32(data) != extent.crc:
            raise PayloadCorrupt(
                f"{what}: the {extent.length} bytes at {extent.pos} of {self.path(extent.segment)} are not those "
                f"written ({len(data)} read, crc32 differs): the segment lost its tail (power loss before it was "
                "synced) or was changed outside rollbuf"
            )
        return data

    # --- durability ---
    def sync(self) -> None:
        """fsync what was appended since the last sync (and the directory, if a segment was created)."""
        for segment in sorted(self.written):
            fd = self._fds.get(segment)
            if fd is not None:
                os.fsync(fd)
        if self.created:
            sync_dir(self.directory)
        self.written.clear()
        self.created = False

    # --- deleting ---
    def delete(self, segments: list[int]) -> None:
        """Remove these segments' files (their rows are gone, committed)."""
        for segment in segments:
            fd = self._fds.pop(segment, None)
            if fd is not None:
                os.close(fd)
            self.written.discard(segment)
            if self._current == segment:
                self._current = None
            with contextlib.suppress(FileNotFoundError):  # another process was first
                self.path(segment).unlink()

    def forget_deleted(self) -> None:
        """Close the descriptors of segments another process deleted (an open one keeps its disk in use)."""
        for segment, fd in list(self._fds.items()):
            if os.fstat(fd).st_nlink == 0 and segment != self._current:
                os.close(self._fds.pop(segment))
                self.written.discard(segment)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._current = None


def numbers(directory: Path) -> list[int]:
    """The segments on disk in `directory`, in order (none if it does not exist)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m[1]) for name in names if (m := _NAME.fullmatch(name)))


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_from(directory: Path, first: int) -> int:
    """fsync every segment numbered `first` or above, and the directory if there are any above it: what
    was appended since a sync that saw `first` as the newest (appends only go to the newest and newer ones).
    Returns the newest now, for the next call (`first` if there are none)."""
    newest = first
    for segment in numbers(directory):
        if segment < first:
            continue
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile: nothing to keep
            fd = os.open(directory / f"{segment:08d}.seg", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        newest = max(newest, segment)
    if newest > first:
        sync_dir(directory)
    return newest
