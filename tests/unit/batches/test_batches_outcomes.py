"""api.batches.outcomes: a formed batch is the bytes the store keeps, read back without copying its payloads."""

from __future__ import annotations

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from api.batches.outcomes import HEADER_MAX, FormedBatch
from api.batches.trim import first_sequences
from api.wire.records import decode_batch, encode_submission

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


@given(st.lists(st.integers(2, 6), min_size=1, max_size=40), st.data())
def test_a_kept_batch_with_cut_groups_reads_back_cut_as_served(sizes: list[int], data: st.DataObject) -> None:
    """The store keeps cut groups whole and the batch's header the cuts (a header past HEADER_MAX with many of
    them): read back, every group is cut as it was served, every per-sequence field alike."""
    records = [
        encode_submission(
            [[i, k] for k in range(n)],
            [[1, 1]] * n,
            [float(k) for k in range(n)],
            env_id=0,
            policy_step=0,
            group_id=f"g{i}",
            inference_logprobs=[[-0.5, -0.25]] * n,
            messages=[[{"role": "user", "content": str(k)}] for k in range(n)],
        )
        for i, n in enumerate(sizes)
    ]
    cuts = {i: data.draw(st.integers(1, n - 1)) for i, n in enumerate(sizes) if data.draw(st.booleans())}
    served = [first_sequences(r, cuts[i])[0] if i in cuts else r for i, r in enumerate(records)]
    seqs = sum(cuts.get(i, n) for i, n in enumerate(sizes))
    formed = FormedBatch.build(7, len(records), seqs, 0, served, cuts)
    kept = formed.prefix() + b"".join(records)  # what `Txn.get_batch` returns: the header, the groups whole
    again = FormedBatch.unpack(7, kept)
    assert again.stored == formed.stored and (again.n_groups, again.seqs) == (len(records), seqs)
    for i, rec in enumerate(decode_batch(again.records)):
        n = cuts.get(i, sizes[i])
        assert rec.seqs == n and rec.scores.tolist() == [float(k) for k in range(n)]
        assert rec.tokens.tolist() == [v for k in range(n) for v in (i, k)] and rec.masks.shape == rec.tokens.shape
        assert rec.floats["inference_logprobs"].shape == rec.tokens.shape and len(rec.meta["messages"]) == n
