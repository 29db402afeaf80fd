"""api.batches.outcomes: a formed batch is the bytes the store keeps, read back without copying its payloads."""

from __future__ import annotations

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from api.batches.outcomes import HEADER_MAX, FormedBatch

COUNTS = st.integers(0, 2**64 - 1)
"""Sequences and tokens as the header may carry them (a msgpack array holds at most 2**32 - 1 groups)."""


@given(st.integers(0, 2**53), st.integers(0, 2**32 - 1), COUNTS, COUNTS, st.lists(st.binary(max_size=40), max_size=5))
def test_a_stored_batch_reads_back_as_it_was_formed(
    step: int, n_groups: int, seqs: int, tokens: int, blobs: list[bytes]
) -> None:
    payloads = [msgpack.packb(b) for b in blobs]  # group records are msgpack maps; any msgpack value frames alike
    formed = FormedBatch.build(step, len(payloads), seqs, tokens, payloads)
    assert formed.offset <= HEADER_MAX  # unpack feeds only HEADER_MAX bytes to find the header
    assert formed.stored == formed.prefix() + b"".join(payloads)
    again = FormedBatch.unpack(step, formed.stored)
    assert again == formed
    assert msgpack.unpackb(again.records) == blobs
    assert FormedBatch.build(step, n_groups, seqs, tokens, []).offset <= HEADER_MAX
