"""Tokens too old to train on (`max_token_staleness`): exactly the trained tokens of older weights masked, counted,
and masked alike when a kept batch is read back."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.outcomes import FormedBatch
from api.batches.token_staleness import apply_masks, mask, mask_item, mask_payload, oldest_kept
from api.wire.records import GroupRecord, decode, decode_batch, encode, msgpack_array_header
from api.wire.rules import MASK_IGNORE


@st.composite
def records(draw: st.DrawFn, versions: bool | None = None) -> GroupRecord:
    lengths = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    total = sum(lengths)
    tokens = np.asarray(draw(st.lists(st.integers(0, 1000), min_size=total, max_size=total)), np.int32)
    trained = np.asarray(draw(st.lists(st.booleans(), min_size=total, max_size=total)))
    sent = draw(st.booleans()) if versions is None else versions
    steps = np.asarray(draw(st.lists(st.integers(0, 9), min_size=total, max_size=total)), np.int32)
    return GroupRecord(
        env_id=0,
        lengths=np.asarray(lengths, np.int32),
        tokens=tokens,
        masks=np.where(trained, tokens, MASK_IGNORE).astype(np.int32),
        scores=np.zeros(len(lengths)),
        policy_step=int(steps.min()),
        weight_versions=steps if sent else None,
    )


@settings(max_examples=300, deadline=None)
@given(records(), st.integers(0, 10))
def test_exactly_the_trained_tokens_of_older_weights_are_masked(rec: GroupRecord, oldest: int) -> None:
    out, n = mask(rec, oldest)
    trained_before = rec.masks != MASK_IGNORE
    if rec.weight_versions is None:
        assert n == 0 and out is rec
        return
    old = rec.weight_versions < oldest
    assert n == int(np.count_nonzero(old & trained_before))
    assert np.array_equal(out.masks, np.where(old, MASK_IGNORE, rec.masks))  # the others as they were
    assert np.array_equal(out.tokens, rec.tokens) and out.policy_step == rec.policy_step  # the group's oldest
    assert np.array_equal(out.weight_versions, rec.weight_versions)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(records(), min_size=1, max_size=4), st.integers(0, 10))
def test_an_item_of_several_groups_is_masked_group_by_group(recs: list[GroupRecord], oldest: int) -> None:
    payload = b"".join(encode(r) for r in recs)
    served, counts = mask_item(payload, len(recs), oldest)
    assert counts == [mask(r, oldest)[1] for r in recs]
    if not any(counts):
        assert served is payload
    back = decode_batch(msgpack_array_header(len(recs)) + served)
    assert [b.masks.tolist() for b in back] == [mask(r, oldest)[0].masks.tolist() for r in recs]


@settings(max_examples=100, deadline=None)
@given(st.lists(records(versions=True), min_size=1, max_size=5), st.integers(0, 10))
def test_a_kept_batch_is_served_again_byte_for_byte(recs: list[GroupRecord], oldest: int) -> None:
    """The store keeps the groups as they came and the header says which were masked at what: reading the kept
    batch back masks them again, to the bytes served when it was formed."""
    stored = [encode(r) for r in recs]
    served, masked = [], {}
    for i, payload in enumerate(stored):
        out, n = mask_payload(payload, oldest)
        served.append(out)
        if n:
            masked[i] = oldest
    formed = FormedBatch.build(
        7, len(recs), sum(r.seqs for r in recs), sum(r.n_tokens for r in recs), served, None, masked
    )
    kept = formed.prefix() + b"".join(stored)  # what `Txn.get_batch` gives back: the groups as stored
    again = FormedBatch.unpack(7, kept)
    assert bytes(again.records) == bytes(formed.records)
    assert bytes(apply_masks(formed.records, len(recs), {})) == bytes(formed.records)  # nothing more to mask


def test_no_setting_masks_nothing() -> None:
    assert oldest_kept(9, None) is None
    assert oldest_kept(9, 2) == 7
    rec = decode(
        encode(
            GroupRecord(
                env_id=0,
                lengths=np.array([2], np.int32),
                tokens=np.array([1, 2], np.int32),
                masks=np.array([1, 2], np.int32),
                scores=np.zeros(1),
                policy_step=0,
                weight_versions=np.array([0, 8], np.int32),
            )
        )
    )
    assert mask(rec, 7)[0].masks.tolist() == [MASK_IGNORE, 2]
    assert mask(rec, 0)[1] == 0
