"""Which positions a trainer trains on: Atropos's rule (mask != -100) in every view, and 0/1 handlers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.clients.test_arrays import group_lengths, make_records
from trainer_client.arrays import from_records


@settings(max_examples=50, deadline=None)
@given(group_lengths, st.integers(8, 64))
def test_trained_is_mask_not_minus_100_in_every_view(groups: list[list[int]], max_len: int) -> None:
    batch = from_records(make_records(groups), step=0)
    assert np.array_equal(batch.trained, batch.masks != -100)
    padded = batch.padded(pad_to_multiple_of=8)
    assert padded.trained.dtype == bool
    assert np.array_equal(padded.trained, padded.attention_mask & (padded.masks != -100))
    assert int(padded.trained.sum()) == int(batch.trained.sum())
    packed = batch.packed(max(max_len, int(batch.lengths.max())))
    assert np.array_equal(packed.trained, (packed.segment_ids >= 0) & (packed.masks != -100))
    assert int(packed.trained.sum()) == int(batch.trained.sum())


def test_masks_of_other_conventions_are_kept_as_sent() -> None:
    records = make_records([[4, 4]])
    batch = from_records(records, step=0)
    assert np.array_equal(batch.masks, records[0].masks)


@settings(max_examples=50, deadline=None)
@given(group_lengths, st.sets(st.integers(0, 2)))
def test_zero_one_envs_are_remapped_and_others_left_alone(groups: list[list[int]], zero_one: set[int]) -> None:
    records = make_records(groups)
    rng = np.random.default_rng(0)
    for r in records:
        if r.env_id in zero_one:  # a 0/1 handler: 1 where trained
            object.__setattr__(r, "masks", rng.integers(0, 2, r.n_tokens).astype(np.int32))
    batch = from_records(records, step=0)
    fixed = batch.with_zero_one_masks(zero_one)
    in_zero_one = np.repeat(np.isin(batch.env_ids, list(zero_one)), batch.lengths)
    expected = np.where(in_zero_one, batch.masks == 1, batch.masks != -100)
    assert np.array_equal(fixed.trained, expected)
    assert np.array_equal(fixed.masks[~in_zero_one], batch.masks[~in_zero_one])
    assert np.array_equal(fixed.masks[in_zero_one & expected], batch.tokens[in_zero_one & expected])
    assert (fixed.masks[in_zero_one & ~expected] == -100).all()
    assert int(fixed.padded().trained.sum()) == int(expected.sum())
