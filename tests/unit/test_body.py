"""gunzip of request bodies: exact output, and a 4xx for every way a gzip body can be wrong."""

from __future__ import annotations

import gzip
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.body import gunzip
from api.errors import BadEncoding, PayloadTooLarge


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
        gzip.compress(b"x" * 5000)[:-12],  # truncated
        random.Random(0).randbytes(200),  # not gzip
        b"\x1f\x8b\x08" + random.Random(1).randbytes(200),  # a gzip header, then garbage
        gzip.compress(b"x" * 5000)[:-8] + b"\0" * 8,  # wrong checksum
        b"",
    ],
)
def test_invalid_gzip_is_a_bad_encoding(body: bytes) -> None:
    with pytest.raises(BadEncoding, match="invalid gzip body"):
        gunzip(body, limit=10**6)


def test_inflating_stops_at_the_limit_in_memory_too() -> None:
    """A 200 MB bomb with a 4 MB limit: no more than the limit and one step are ever held."""
    import tracemalloc

    from api.body import INFLATE_STEP

    bomb = gzip.compress(b" " * 200_000_000, compresslevel=1)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            gunzip(bomb, limit=4_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000 + 3 * INFLATE_STEP


@pytest.mark.parametrize("tail", [b"junk", b"\0", b"\x1f", gzip.compress(b"b")[:-3]])
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
