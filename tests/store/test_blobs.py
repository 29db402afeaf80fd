"""The local blob tier's files (api/store/blobs.py): put once per owner, read back checked, collected only when
unreferenced and untouched for the grace period, and a put that races a collection keeps its blob."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from api.store.blobs import LocalBlobs, blob_dir_beside
from api.wire.blobs import Ref, digest_of, owner_tag

A, B = owner_tag("a"), owner_tag("b")


def aged(tier: LocalBlobs, tag: bytes, digest: bytes, seconds: float) -> None:
    """The blob as if last written or touched `seconds` ago."""
    t = time.time() - seconds
    os.utime(tier.path(tag, digest), (t, t))


def test_the_same_bytes_are_stored_once_per_owner_and_read_back_checked(tmp_path: Path) -> None:
    tier = LocalBlobs(tmp_path / "blobs")
    data = b"x" * 5000
    d = digest_of(data)
    assert tier.put(A, d, data) == 5000
    assert tier.put(A, d, data) == 0  # there: touched, not written again
    assert tier.put(B, d, data) == 5000  # another owner's copy, charged to it
    assert tier.get(Ref(A, d, 5000)) == data
    usage = tier.usage()
    assert (usage.objects, usage.bytes, usage.by_owner) == (2, 10_000, {A.hex(): 5000, B.hex(): 5000})
    tier.path(A, d).write_bytes(b"y" * 5000)  # bytes that are not what the digest names are no blob
    with pytest.raises(KeyError):
        tier.get(Ref(A, d, 5000))
    with pytest.raises(KeyError):
        tier.get(Ref(A, digest_of(b"never put"), 9))
    assert blob_dir_beside(Path("/data/rollbuf.db")) == Path("/data/rollbuf.db.blobs")


def test_only_unreferenced_blobs_untouched_for_the_grace_period_are_collected(tmp_path: Path) -> None:
    tier = LocalBlobs(tmp_path)
    blobs = {name: (name * 100).encode() for name in ("kept", "old", "new")}
    for data in blobs.values():
        tier.put(A, digest_of(data), data)
    for name in ("kept", "old"):
        aged(tier, A, digest_of(blobs[name]), 100)
    candidates = tier.candidates(grace=60)
    assert sorted(candidates) == sorted((A, digest_of(blobs[n])) for n in ("kept", "old"))
    got = tier.collect(candidates, {(A, digest_of(blobs["kept"]))}, grace=60)
    assert (got.objects, got.bytes) == (1, 300)
    assert not tier.has(A, digest_of(blobs["old"]))
    assert tier.has(A, digest_of(blobs["kept"])) and tier.has(A, digest_of(blobs["new"]))


def test_a_put_between_listing_and_collecting_keeps_its_blob(tmp_path: Path) -> None:
    """The put of a group whose transaction the collection's read of references did not see touches the blob:
    the collection, which listed it as old, leaves it."""
    tier = LocalBlobs(tmp_path)
    data = b"z" * 1000
    d = digest_of(data)
    tier.put(A, d, data)
    aged(tier, A, d, 100)
    candidates = tier.candidates(grace=60)
    assert candidates == [(A, d)]
    assert tier.put(A, d, data) == 0  # touched: its reference is on its way to the store
    assert tier.collect(candidates, set(), grace=60).objects == 0
    assert tier.get(Ref(A, d, 1000)) == data


def test_a_blob_a_dead_collection_set_aside_is_put_back_and_temporary_files_go(tmp_path: Path) -> None:
    tier = LocalBlobs(tmp_path)
    data = b"w" * 1000
    d = digest_of(data)
    tier.put(A, d, data)
    path = tier.path(A, d)
    os.rename(path, path.with_name(path.name + ".collecting"))  # a collection killed between its two steps
    assert tier.get(Ref(A, d, 1000)) == data  # still read
    assert tier.usage().objects == 0 and tier.has(A, d)  # listing puts it back
    stale = tmp_path / "tmp" / "dead-put"
    stale.write_bytes(b"half")
    t = time.time() - 100
    os.utime(stale, (t, t))
    tier.collect([], set(), grace=60)
    assert not stale.exists() and tier.has(A, d)
