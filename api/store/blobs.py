"""The local blob tier: large metadata values (api/wire/blobs.py) as files named by their SHA-256, in a directory
beside the SQLite file by default (docs/payloads.md).

`<root>/<owner tag>/<digest[:2]>/<digest>`: an owner's blobs live apart from every other owner's, so that the same
bytes sent by two keys are two files (each charged to its key) and neither learns what the other stored, unless the
operator shares one tag for all.

Safe across kill -9 and several processes without a lock: a blob is written (a temporary file, fsynced, renamed)
or touched (its mtime set to now) before the transaction that stores its reference, and `collect` removes only a
blob that no stored payload refers to and that nobody wrote or touched for `grace` seconds. Collecting renames
the blob aside first and looks at its mtime again: a put that touched it meanwhile keeps it (it is renamed back),
and a put that comes after the rename finds no file and writes it anew. A put whose transaction starts more than
half the grace after the put writes or touches it again (`fresh`).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from api.wire.blobs import TAG_SIZE, Ref, digest_of
from api.wire.records import Buffer as _Buffer

_TMP = "tmp"
_ASIDE = ".collecting"


def blob_dir_beside(db_path: Path) -> Path:
    """The default directory of a SQLite file's blobs: `<file>.blobs/`."""
    return db_path.with_name(db_path.name + ".blobs")


@dataclass(frozen=True, slots=True)
class Usage:
    """What the tier holds: objects and bytes, in all and per owner tag (hex)."""

    objects: int = 0
    bytes: int = 0
    by_owner: dict[str, int] = field(default_factory=dict)
    """Bytes per owner tag (hex)."""


@dataclass(frozen=True, slots=True)
class Collected:
    objects: int = 0
    bytes: int = 0


class LocalBlobs:
    """Blob files under `root` (created if need be)."""

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        (root / _TMP).mkdir(parents=True, exist_ok=True)

    def path(self, tag: bytes, digest: bytes) -> Path:
        h = digest.hex()
        return self.root / tag.hex() / h[:2] / h

    def put(self, tag: bytes, digest: bytes, data: _Buffer) -> int:
        """Store `data` (whose SHA-256 is `digest`) for owner `tag`: the bytes written, 0 if it was there (then
        touched, so that no collection takes it before its reference is stored)."""
        path = self.path(tag, digest)
        try:
            os.utime(path)
            return 0
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / _TMP / uuid.uuid4().hex
        view = memoryview(data)
        with open(tmp, "wb") as f:
            f.write(view)
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(path.parent)
        return len(view)

    def get(self, ref: Ref) -> bytes:
        """The blob's bytes; KeyError if there is none (or they are not what its digest says)."""
        path = self.path(ref.tag, ref.digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            try:  # being collected this instant (it is put back if a put touched it)
                data = path.with_name(path.name + _ASIDE).read_bytes()
            except FileNotFoundError:
                raise KeyError(ref.hex) from None
        if len(data) != ref.size or digest_of(data) != ref.digest:
            raise KeyError(ref.hex)
        return data

    def has(self, tag: bytes, digest: bytes) -> bool:
        return self.path(tag, digest).is_file()

    def _files(self) -> Iterator[tuple[bytes, bytes, Path, os.stat_result]]:
        """(tag, digest, path, stat) of every blob."""
        for owner in _scandir(self.root):
            if owner.name == _TMP or not owner.is_dir() or len(owner.name) != 2 * TAG_SIZE:
                continue
            for shard in _scandir(Path(owner.path)):
                for entry in _scandir(Path(shard.path)):
                    if entry.name.endswith(_ASIDE):
                        _settle_aside(Path(entry.path))
                        continue
                    try:
                        tag, digest = bytes.fromhex(owner.name), bytes.fromhex(entry.name)
                        st = entry.stat()
                    except (ValueError, FileNotFoundError):
                        continue
                    yield tag, digest, Path(entry.path), st

    def usage(self) -> Usage:
        objects = size = 0
        by_owner: dict[str, int] = {}
        for tag, _, _, st in self._files():
            objects += 1
            size += st.st_size
            by_owner[tag.hex()] = by_owner.get(tag.hex(), 0) + st.st_size
        return Usage(objects, size, by_owner)

    def candidates(self, grace: float, now: float | None = None) -> list[tuple[bytes, bytes]]:
        """Blobs nobody wrote or touched for `grace` seconds: those a collection may take if unreferenced."""
        cutoff = (time.time() if now is None else now) - grace
        return [(tag, digest) for tag, digest, _, st in self._files() if st.st_mtime < cutoff]

    def collect(
        self, candidates: Iterable[tuple[bytes, bytes]], referenced: set[tuple[bytes, bytes]], grace: float
    ) -> Collected:
        """Remove the candidates that no stored payload refers to (`referenced`, read after `candidates`) and
        that nobody touched for `grace` seconds; temporary files of puts that died that old go too."""
        cutoff = time.time() - grace
        objects = size = 0
        for tag, digest in candidates:
            if (tag, digest) in referenced:
                continue
            path = self.path(tag, digest)
            aside = path.with_name(path.name + _ASIDE)
            try:
                os.rename(path, aside)
                st = aside.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime >= cutoff:  # touched by a put since it was listed: its reference is on its way
                os.replace(aside, path)
                continue
            try:
                aside.unlink()
            except FileNotFoundError:  # another process put it back meanwhile
                continue
            objects += 1
            size += st.st_size
        for entry in _scandir(self.root / _TMP):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
        return Collected(objects, size)


def _settle_aside(aside: Path) -> None:
    """A blob a collection set aside and did not finish with (the process died): put back, for a put may have
    touched it; the next collection decides again."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(aside, aside.with_name(aside.name.removesuffix(_ASIDE)))


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
