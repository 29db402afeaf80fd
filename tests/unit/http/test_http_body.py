"""Request bodies: received whole (joined or grown), gunzipped with exact output and linear work, bytes taken
from the body budget, and a 4xx for every way a body can be wrong."""

from __future__ import annotations

import asyncio
import gzip
import random
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

import api.http.body
from api.errors import BadEncoding, PayloadTooLarge
from api.http.body import MAX_GZIP_MEMBERS, gunzip, read_body
from api.http.inflight import BodyBudget, Busy


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 9))
def test_round_trip(data: bytes, level: int) -> None:
    assert gunzip(gzip.compress(data, compresslevel=level), limit=len(data)) == data


def test_output_beyond_the_limit_is_refused_without_inflating_it_all() -> None:
    bomb = gzip.compress(b"\0" * 10_000_000)
    with pytest.raises(PayloadTooLarge, match="limit of 1000 bytes"):
        gunzip(bomb, limit=1000)


@pytest.mark.parametrize(
    "body",
    [
        gzip.compress(b"x" * 5000, mtime=0)[:-12],  # truncated (mtime=0: the same bytes, and test id, in every
        # process: pytest-xdist workers must collect the same tests)
        random.Random(0).randbytes(200),  # not gzip
        b"\x1f\x8b\x08" + random.Random(1).randbytes(200),  # a gzip header, then garbage
        gzip.compress(b"x" * 5000, mtime=0)[:-8] + b"\0" * 8,  # wrong checksum
        b"",
    ],
)
def test_invalid_gzip_is_a_bad_encoding(body: bytes) -> None:
    with pytest.raises(BadEncoding, match="invalid gzip body"):
        gunzip(body, limit=10**6)


def test_inflating_stops_at_the_limit_in_memory_too() -> None:
    """A 200 MB bomb with a 4 MB limit: no more than the limit and one step are ever held."""
    import tracemalloc

    from api.http.body import INFLATE_STEP

    bomb = gzip.compress(b" " * 200_000_000, compresslevel=1)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            gunzip(bomb, limit=4_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000 + 3 * INFLATE_STEP


@pytest.mark.parametrize("tail", [b"junk", b"\0", b"\x1f", gzip.compress(b"b", mtime=0)[:-3]])
def test_bytes_after_the_gzip_data_are_refused(tail: bytes) -> None:
    with pytest.raises(BadEncoding, match="invalid gzip body"):
        gunzip(gzip.compress(b"a" * 100) + tail, limit=10**6)


def test_gzip_members_back_to_back_are_one_body() -> None:
    """RFC 1952: a gzip file is a series of members (what `cat a.gz b.gz` makes)."""
    assert gunzip(gzip.compress(b"[1, ") + gzip.compress(b"2]"), limit=100) == b"[1, 2]"
    with pytest.raises(PayloadTooLarge):
        gunzip(gzip.compress(b"x" * 60) + gzip.compress(b"y" * 60), limit=100)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=1, max_size=3 * (1 << 20) // 2), st.integers(1, 9))
def test_round_trip_across_inflate_steps(data: bytes, level: int) -> None:
    data = data * (1 + (1 << 20) // len(data))  # more than one step of output
    assert gunzip(gzip.compress(data, compresslevel=level), limit=len(data)) == data


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=20_000), min_size=1, max_size=MAX_GZIP_MEMBERS), st.integers(0, 9))
def test_members_end_anywhere_in_the_input_windows(parts: list[bytes], level: int) -> None:
    """Each member is fed in growing windows from where the last one ended: any sizes, any boundary."""
    body = b"".join(gzip.compress(p, compresslevel=level) for p in parts)
    assert gunzip(body, limit=10**7) == b"".join(parts)


def test_a_body_of_many_empty_members_is_refused_at_the_cap() -> None:
    """200,000 empty members (3.8 MB) once took 11.8 s: each member copied the rest of the body."""
    empty = gzip.compress(b"")
    gunzip(empty * MAX_GZIP_MEMBERS, limit=10)
    with pytest.raises(BadEncoding, match=f"more than {MAX_GZIP_MEMBERS} members"):
        gunzip(gzip.compress(b"[]") + empty * 200_000, limit=10)


def test_inflated_bytes_are_taken_from_the_hold() -> None:
    budget = BodyBudget(limit=1500)
    hold = budget.hold()
    assert gunzip(gzip.compress(b"x" * 1000), limit=10**6, hold=hold) == b"x" * 1000
    assert budget.held == hold.bytes == 1000
    with pytest.raises(Busy, match="max_inflight_bytes"):
        gunzip(gzip.compress(b"y" * 1000), limit=10**6, hold=hold)
    hold.release()
    assert budget.held == 0


def _request(chunks: list[bytes]) -> Request:
    """A request whose body arrives as these ASGI messages, one per chunk."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    feed = iter(messages or [{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> dict[str, object]:
        return next(feed)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(0, 200))
def test_a_body_is_received_whole_whether_joined_or_grown(chunks: list[bytes], join_up_to: int) -> None:
    """Up to `JOIN_UP_TO` the chunks are joined once at the end; past it they go on in one growing buffer, the
    chunks held so far first. Either way the body is every byte in order, each taken from the budget once."""
    budget = BodyBudget(limit=10**6)
    hold = budget.hold()
    with patch.object(api.http.body, "JOIN_UP_TO", join_up_to):
        body = asyncio.run(read_body(_request(chunks), max_bytes=10**6, max_decompressed=10**6, hold=hold))
    whole = b"".join(chunks)
    assert body == whole and budget.held == len(whole)
    assert isinstance(body, bytes if len(whole) <= join_up_to else bytearray)
    if len(chunks) == 1:
        assert body is chunks[0] or len(whole) > join_up_to, "a body of one chunk is not copied"


def test_a_body_past_the_limit_is_refused_as_it_arrives() -> None:
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 50 bytes"):
        asyncio.run(read_body(_request([b"x" * 30, b"y" * 30]), max_bytes=50, max_decompressed=50))
