"""What a submission body costs the server while it is decoded and stored, in bytes of the body budget.

The budget (`api.http.inflight`) counts a body's bytes as they arrive, but decoding holds more: a JSON body's
parser keeps 16 bytes of tape per number, its per-token lists become arrays, then stored records, and the
store's transaction holds those. Counted by its bytes alone, one budgeted byte cost 12.9x (JSON of 5-digit
token ids) to 19.1x (JSON of 1-digit ids) and 4.1x (msgpack) of peak memory (`python -m bench.body_rss`).
So before it is decoded a body is charged what decoding will cost, measured there: JSON its bytes
plus `JSON_VALUE_BYTES` per value (what the cost follows: a 1-digit id costs as much as a 5-digit one),
msgpack `MSGPACK_FACTOR` times its bytes. Measured peak growth is then within 1.3x of what is counted.
"""

from __future__ import annotations

import math

import numpy as np

from api.wire.records import Buffer, is_msgpack

JSON_VALUE_BYTES = 32
"""Bytes charged per value of a JSON body (a number, string, ...; counted by its commas) beyond its bytes: peak
memory was 38-42 bytes per number with the body, 36-39 beyond it (bench.body_rss, 1- and 5-digit ids)."""
MSGPACK_FACTOR = 3.3
"""A msgpack body is charged this many times its bytes (its per-token fields are packed arrays): peak memory
was 4.1x."""


def decoded_cost(raw: Buffer, content_type: str | None) -> int:
    """Bytes of memory decoding and storing `raw` costs at its peak, the body itself included."""
    if is_msgpack(content_type):
        return math.ceil(len(raw) * MSGPACK_FACTOR)
    values = int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) == ord(","))) + 1
    return len(raw) + JSON_VALUE_BYTES * values


def charge(raw: Buffer, content_type: str | None, held: int) -> int:
    """What a request that holds `held` bytes for its body must take more before decoding it."""
    return max(0, decoded_cost(raw, content_type) - held)
