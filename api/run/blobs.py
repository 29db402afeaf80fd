"""The blob tier as the flows use it (docs/payloads.md): a group's large values written as blobs before its
transaction, within the tier's budgets; put back into batches as they are served; collected when nothing refers
to them. The files are `api/store/blobs.py`'s, the references `api/wire/blobs.py`'s.

What is stored once is charged once, to the key that stored it: the budgets count the files of each owner, not
the references. Several processes share the directory: each counts the files at its last collection plus what
it wrote since (a budget is thus exceeded by at most what the other processes wrote since then).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from api.config.groups import setting
from api.errors import RollbufError, Unavailable
from api.store.base import Store, Txn
from api.store.blobs import Collected, LocalBlobs, Usage, blob_dir_beside
from api.wire.blobs import MARKER, Ref, externalize, has_refs, inline_records, owner_tag, references, refs_in
from api.wire.records import Buffer
from api.wire.schema import BlobsStatus

log = logging.getLogger("rollbuf")

SHARED_OWNER = "(shared)"
"""The owner every key's blobs are stored under with `blob_shared_across_keys`."""


class BlobLost(RollbufError):
    """A group about to be served refers to a blob the tier does not hold (its files were removed, or `blob_dir`
    changed between runs): the batch is not taken, so that nothing is served without its bytes."""

    status_code = 500
    code = "blob_lost"


class BlobsFull(Unavailable):
    """503: the blob tier's budget (in all, or the key's) would be exceeded: nothing was stored."""

    code = "blobs_full"


@dataclass(frozen=True, slots=True)
class BlobLimits:
    """The tier's settings (`api.config.groups.BlobSettings`)."""

    enabled: bool = setting("blobs")
    directory: Path | None = setting("blob_dir")
    min_bytes: int = setting("blob_min_bytes")
    max_bytes: int = setting("max_blob_bytes")
    max_bytes_per_key: int | None = setting("max_blob_bytes_per_key")
    grace: float = setting("blob_grace_s")
    sweep_every: float = setting("blob_sweep_s")
    shared: bool = setting("blob_shared_across_keys")
    retry_after: float = setting("retry_after")

    @property
    def per_key(self) -> int:
        return self.max_bytes_per_key if self.max_bytes_per_key is not None else self.max_bytes // 2

    def directory_for(self, store_url: str) -> Path | None:
        """Where this store's blobs go: the setting, else beside a SQLite file; None: no tier."""
        if not self.enabled:
            return None
        if self.directory is not None:
            return self.directory
        if store_url.startswith("sqlite:///"):
            return blob_dir_beside(Path(store_url.removeprefix("sqlite:///").split("?", 1)[0]))
        return None


@dataclass
class Stored:
    """A record as the row store keeps it, and when its blobs were last written or touched."""

    payload: bytes
    blob_bytes: int
    """Bytes of blob files this record's put wrote (0: all were there)."""
    at: float
    refers: bool = False
    """Whether the record refers to blobs."""


@dataclass
class BlobStats:
    """What /status and /metrics show of the tier (this process's counts since it started, and the files)."""

    usage: Usage = field(default_factory=Usage)
    referenced: int = 0
    """References in stored payloads at the last collection (a blob shared by many counts many times)."""
    written_bytes: int = 0
    written_objects: int = 0
    deduplicated: int = 0
    """Values whose blob was already there (another sibling's, group's or request's)."""
    collected_objects: int = 0
    collected_bytes: int = 0
    refused: int = 0

    @property
    def dedup_ratio(self) -> float:
        """References per stored blob at the last collection (1: no value stored twice; 0: none yet)."""
        return self.referenced / self.usage.objects if self.usage.objects else 0.0

    def status(self) -> BlobsStatus:
        return BlobsStatus(
            objects=self.usage.objects,
            bytes=self.usage.bytes,
            references=self.referenced,
            dedup_ratio=round(self.dedup_ratio, 3),
            written=self.written_objects,
            written_bytes=self.written_bytes,
            deduplicated=self.deduplicated,
            refused=self.refused,
            collected=self.collected_objects,
            collected_bytes=self.collected_bytes,
        )


class BlobTier:
    """One process's side of the tier: the files, the budgets, the collection."""

    def __init__(self, files: LocalBlobs, limits: BlobLimits) -> None:
        self.files = files
        self.limits = limits
        self.stats = BlobStats(files.usage())
        self._lock = threading.Lock()
        self._since: dict[str, int] = {}
        """Bytes this process wrote per owner tag (hex) since the last count of the files."""

    @classmethod
    def of(cls, store_url: str, limits: BlobLimits) -> BlobTier | None:
        """The tier of this store, its files as durable as the store's commits: fsynced with PostgreSQL and with
        SQLite's `synchronous=FULL` (which survive the loss of the host); under SQLite's default, which survives
        `kill -9` of the server, a blob in the page cache survives it too."""
        directory = limits.directory_for(store_url)
        if directory is None:
            return None
        fsync = store_url.startswith(("postgresql://", "postgres://")) or "synchronous=full" in store_url.lower()
        return cls(LocalBlobs(directory, fsync=fsync), limits)

    def tag(self, owner: str | None) -> bytes:
        return owner_tag(SHARED_OWNER if self.limits.shared else owner or "")

    # --- ingest: before the transaction ---
    def store_record(self, payload: bytes, owner: str | None) -> Stored:
        """Write this record's large values as blobs (within the budgets, else `BlobsFull` and nothing written)
        and return the record that refers to them. Blocking file I/O: run it off the event loop."""
        if len(payload) < self.limits.min_bytes:
            return Stored(payload, 0, time.time())
        tag = self.tag(owner)
        stored, blobs = externalize(payload, self.limits.min_bytes, tag)
        if not blobs:
            return Stored(payload, 0, time.time())
        new = {d: b for d, b in blobs.items() if not self.files.has(tag, d)}
        with self._lock:
            self._check(tag, sum(len(memoryview(b)) for b in new.values()))
        at = time.time()
        written = 0
        for d, b in blobs.items():
            n = self.files.put(tag, d, b)
            written += n
            if n:
                self.stats.written_objects += 1
            else:
                self.stats.deduplicated += 1
        self.stats.deduplicated += sum(1 for _ in refs_in(stored)) - len(blobs)  # siblings' equal values
        with self._lock:
            self._since[tag.hex()] = self._since.get(tag.hex(), 0) + written
            self.stats.written_bytes += written
        return Stored(stored, written, at, refers=True)

    def _check(self, tag: bytes, more: int) -> None:
        if not more:
            return
        usage = self.stats.usage
        total = usage.bytes + sum(self._since.values())
        mine = usage.by_owner.get(tag.hex(), 0) + self._since.get(tag.hex(), 0)
        why = None
        if total + more > self.limits.max_bytes:
            why = f"the blob tier holds {total} bytes; the limit (max_blob_bytes) is {self.limits.max_bytes}"
        elif mine + more > self.limits.per_key:
            why = f"this key's blobs take {mine} bytes; the limit (max_blob_bytes_per_key) is {self.limits.per_key}"
        if why is not None:
            self.stats.refused += 1
            raise BlobsFull(f"blob tier full: {why}; retry later", self.limits.retry_after)

    def check_fresh(self, stored: list[Stored]) -> None:
        """Inside the transaction that stores these records: refused (503, send again) if their blobs were put
        more than half the grace period ago, for a collection may then take a blob before the reference lands."""
        now = time.time()
        if any(s.refers and now - s.at > self.limits.grace / 2 for s in stored):
            raise Unavailable("the request's blobs aged past half of blob_grace_s before its transaction; send again")

    # --- serving: after the transaction ---
    def inline(self, records: Buffer, *, array: bool) -> Buffer:
        """Records with every reference replaced by its blob's bytes: the records as they were sent. Blocking."""
        return inline_records(records, self._get, array=array)

    def _get(self, ref: Ref) -> bytes:
        try:
            return self.files.get(ref)
        except KeyError:
            log.error("blob %s of %d bytes is missing from %s", ref.hex, ref.size, self.files.root)
            raise

    @staticmethod
    def holds_refs(records: Buffer) -> bool:
        return has_refs(records)

    def check_present(self, records: Buffer) -> None:
        """`BlobLost` if a reference among these records names a blob the tier does not hold: inside the
        transaction that forms a batch, so that such a batch is not taken (a stat per distinct blob)."""
        if not has_refs(records):
            return
        missing: list[str] = []
        for ref in {(r.tag, r.digest): r for r in references(records, array=True)}.values():
            if not self.files.has(ref.tag, ref.digest):
                missing.append(ref.hex)
        if missing:
            raise BlobLost(
                f"the blob tier ({self.files.root}) lacks {len(missing)} blobs that queued groups refer to "
                f"({', '.join(m[:16] for m in missing[:4])}...): its files were removed, or blob_dir changed "
                "since they were stored; nothing was taken: restore the files (or blob_dir) and ask again"
            )

    # --- the collection ---
    async def collect(self, store: Store) -> Collected:
        """Remove the blobs nothing stored refers to and nobody touched for the grace period. The candidates are
        listed before the store is read, so a reference stored after that read is to a blob touched since."""
        candidates = await asyncio.to_thread(self.files.candidates, self.limits.grace)
        referenced, count = await store.read(_referenced)
        got = await asyncio.to_thread(self.files.collect, candidates, referenced, self.limits.grace)
        usage = await asyncio.to_thread(self.files.usage)
        with self._lock:
            self.stats.usage = usage
            self._since = {}
            self.stats.referenced = count
            self.stats.collected_objects += got.objects
            self.stats.collected_bytes += got.bytes
        if got.objects:
            log.info("blobs: %d unreferenced blobs (%d bytes) collected", got.objects, got.bytes)
        return got


def _referenced(txn: Txn) -> tuple[set[tuple[bytes, bytes]], int]:
    """The blobs (owner tag, digest) the stored payloads refer to, and how many references: read one payload at a
    time, none kept."""
    referenced: set[tuple[bytes, bytes]] = set()
    count = 0
    for payload in txn.payloads_with(MARKER):
        for ref in refs_in(payload):
            referenced.add((ref.tag, ref.digest))
            count += 1
    return referenced, count
