"""The payload tier's segment files alone (api/store/sqlite/segments.py): what is appended reads back, a full
segment is sealed, a reopened directory appends after what is there (a torn tail included), and bytes that
are not what was written are told apart from a payload."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.store.sqlite.segments import Extent, PayloadCorrupt, Segments, SegmentWriteError, sync_from


def test_appends_read_back_back_to_back(tmp_path: Path) -> None:
    segs = Segments(tmp_path / "p")
    segs.start(1)
    a, b = segs.append(b"a" * 100), segs.append(b"bb" * 50)
    assert (a.segment, a.pos, a.length, b.segment, b.pos) == (1, 0, 100, 1, 100)
    assert segs.read(a) == b"a" * 100 and segs.read(b) == b"bb" * 50
    assert segs.numbers() == [1] and segs.written == {1}
    segs.sync()
    assert segs.written == set() and not segs.created


def test_a_full_segment_is_sealed_and_the_next_starts(tmp_path: Path) -> None:
    segs = Segments(tmp_path, limit=150)
    segs.start(1)
    extents = [segs.append(bytes([i]) * 100) for i in range(3)]
    assert [(e.segment, e.pos) for e in extents] == [(1, 0), (1, 100), (2, 0)]
    segs.stop()
    segs.start(1)  # the index still says 1 is newest: the file says it is full
    assert segs.append(b"z").segment == 2
    assert [segs.read(e) for e in extents] == [bytes([i]) * 100 for i in range(3)]


def test_a_reopened_directory_appends_after_what_is_there_even_a_torn_tail(tmp_path: Path) -> None:
    first = Segments(tmp_path)
    first.start(1)
    kept = first.append(b"kept" * 10)
    with open(first.path(1), "ab") as f:  # a crash in the middle of an append: bytes no row refers to
        f.write(b"torn")
    first.close()
    again = Segments(tmp_path)
    again.start(1)
    new = again.append(b"new")
    assert new.pos == kept.length + 4
    assert again.read(kept) == b"kept" * 10 and again.read(new) == b"new"


def test_bytes_not_as_written_are_payload_corrupt(tmp_path: Path) -> None:
    segs = Segments(tmp_path)
    segs.start(1)
    e = segs.append(b"payload" * 10)
    with open(segs.path(1), "r+b") as f:
        f.seek(3)
        f.write(b"X")
    with pytest.raises(PayloadCorrupt, match=r"item 7: the 70 bytes at 0 of .*00000001\.seg are not those written"):
        segs.read(e, "item 7")
    os.truncate(segs.path(1), 10)  # a tail lost to power loss
    with pytest.raises(PayloadCorrupt, match="10 read"):
        segs.read(e)
    segs.delete([1])
    with pytest.raises(PayloadCorrupt, match="is missing"):
        segs.read(e)
    with pytest.raises(PayloadCorrupt, match="is missing"):
        Segments(tmp_path).read(Extent(9, 0, 1, 0))


def test_a_full_disk_is_sqlite_full(tmp_path: Path) -> None:
    (tmp_path / "00000001.seg").symlink_to("/dev/full")
    segs = Segments(tmp_path)
    segs.start(1)
    with pytest.raises(SegmentWriteError) as failed:
        segs.append(b"x" * 10)
    assert isinstance(failed.value, sqlite3.OperationalError) and failed.value.sqlite_errorname == "SQLITE_FULL"


def test_deleted_segments_go_and_other_processes_forget_them(tmp_path: Path) -> None:
    mine, other = Segments(tmp_path, limit=10), Segments(tmp_path, limit=10)
    mine.start(1)
    e = mine.append(b"x" * 10)
    mine.append(b"y")  # the next segment: 1 is sealed
    assert other.read(e) == b"x" * 10  # the other process holds 1 open
    mine.delete([1])
    assert mine.numbers() == [2]
    other.forget_deleted()
    with pytest.raises(PayloadCorrupt, match="is missing"):
        other.read(e)


def test_sync_from_syncs_the_newest_and_says_which_is_newest(tmp_path: Path) -> None:
    segs = Segments(tmp_path, limit=4)
    assert sync_from(tmp_path, 0) == 0
    segs.start(1)
    for _ in range(3):
        segs.append(b"four")
    assert sync_from(tmp_path, 0) == 3 and sync_from(tmp_path, 3) == 3


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), max_size=40), limit=st.integers(1, 1000), breaks=st.sets(st.integers(0, 40)))
def test_every_extent_reads_back_what_was_appended(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], limit: int, breaks: set[int]
) -> None:
    """Whatever the sizes, the segment limit and where transactions end (a new `start` from the newest
    segment, as the index would say), extents never overlap and read back their bytes."""
    directory = tmp_path_factory.mktemp("segs")
    segs = Segments(directory, limit=limit)
    written: list[tuple[Extent, bytes]] = []
    for i, size in enumerate(sizes):
        if i in breaks or not segs.started:
            segs.stop()
            segs.start(max([e.segment for e, _ in written], default=1))
        data = os.urandom(size)
        written.append((segs.append(data), data))
    reader = Segments(directory, limit=limit)
    assert all(reader.read(e) == data for e, data in written)
    ends = {}
    for e, _ in written:
        assert e.pos >= ends.get(e.segment, 0)
        ends[e.segment] = e.pos + e.length
