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
