"""trainer_client.arrays: ragged, padded and packed views of a batch, and GRPO advantages. Pure, so
property-tested: whatever the lengths, every token lands exactly once where it belongs."""

from __future__ import annotations

import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.wire.records import F32, I32, GroupRecord, dumps, to_atropos
from trainer_client.arrays import Batch, first_fit_decreasing, from_json, from_records

group_lengths = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=1, max_size=12)


def make_records(
    groups: list[list[int]], *, advantages: bool | list[bool] = False, versions: list[bool] | None = None
) -> list[GroupRecord]:
    rng = np.random.default_rng(len(groups))
    out = []
    for g, lengths in enumerate(groups):
        total = sum(lengths)
        tokens = rng.integers(0, 50_000, total).astype(I32)
        masks = np.where(rng.random(total) < 0.3, -100, tokens).astype(I32)
        floats = {"inference_logprobs": -rng.random(total).astype(F32)}
        if advantages if isinstance(advantages, bool) else advantages[g]:
            floats["advantages"] = rng.normal(size=total).astype(F32)
        out.append(
            GroupRecord(
                env_id=g % 3 if g % 4 else None,
                lengths=np.asarray(lengths, I32),
                tokens=tokens,
                masks=masks,
                scores=rng.integers(0, 3, len(lengths)).astype(np.float64),
                policy_step=g,
                group_id=f"g{g}",
                floats=floats,
                meta={"messages": [[{"role": "user", "content": str(g)}]] * len(lengths)},
                weight_versions=g + rng.integers(0, 3, total).astype(I32) if versions and versions[g] else None,
            )
        )
    return out


def expected_sequences(records: list[GroupRecord]) -> list[np.ndarray]:
    return [s for r in records for s in r.split(r.tokens)]


@given(group_lengths)
def test_ragged_view_keeps_every_sequence_in_order(groups: list[list[int]]) -> None:
    records = make_records(groups)
    batch = from_records(records, step=3)
    assert batch.n_seqs == sum(map(len, groups)) and batch.n_groups == len(groups)
    assert [s.tolist() for s in batch.sequences()] == [s.tolist() for s in expected_sequences(records)]
    assert batch.group_index.tolist() == [g for g, ls in enumerate(groups) for _ in ls]
    assert batch.policy_steps.tolist() == batch.group_index.tolist()
    assert batch.env_ids.tolist() == [(g % 3 if g % 4 else -1) for g, ls in enumerate(groups) for _ in ls]


@given(group_lengths, st.integers(40, 120))
@settings(max_examples=150)
def test_packed_rows_hold_every_token_exactly_once(groups: list[list[int]], max_len: int) -> None:
    batch = from_records(make_records(groups), step=0)
    p = batch.packed(max_len, pad_id=-1)
    assert p.tokens.shape[1] == max_len
    real = p.segment_ids >= 0
    assert int(real.sum()) == batch.n_tokens  # nothing lost, nothing duplicated
    assert (real.sum(axis=1) <= max_len).all() and real.any(axis=1).all()  # no empty row
    for i, seq in enumerate(batch.sequences()):
        row, start = int(p.row[i]), int(p.start[i])
        span = slice(start, start + seq.shape[0])
        assert p.tokens[row, span].tolist() == seq.tolist()
        assert (p.segment_ids[row, span] == i).all()
        assert p.position_ids[row, span].tolist() == list(range(seq.shape[0]))  # restarts per sequence
    assert (p.tokens[~real] == -1).all() and (p.masks[~real] == -100).all()
    for row, cu in enumerate(p.cu_seqlens):
        members = np.flatnonzero(p.row == row)
        assert cu[0] == 0 and cu[-1] == batch.lengths[members].sum() and len(cu) == len(members) + 1


@given(st.lists(st.integers(1, 50), min_size=1, max_size=60), st.integers(50, 200))
def test_first_fit_decreasing_places_longest_first_into_the_first_row_with_room(lengths: list[int], cap: int) -> None:
    row, start = first_fit_decreasing(np.asarray(lengths), cap)
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        k = next((k for k, f in enumerate(fill) if f + lengths[i] <= cap), len(fill))
        if k == len(fill):
            fill.append(0)
        assert (row[i], start[i]) == (k, fill[k])
        fill[k] += lengths[i]
    assert max(fill) <= cap


def test_packing_refuses_a_sequence_longer_than_a_row() -> None:
    batch = from_records(make_records([[10, 30]]), step=0)
    with pytest.raises(ValueError, match="sequence 1 has 30 tokens; packed rows hold at most 20"):
        batch.packed(20)


@given(group_lengths, st.integers(1, 16))
def test_padded_rows(groups: list[list[int]], multiple: int) -> None:
    batch = from_records(make_records(groups), step=0)
    p = batch.padded(pad_to_multiple_of=multiple, pad_id=7)
    n, width = p.tokens.shape
    assert n == batch.n_seqs and width % multiple == 0 and width - multiple < batch.lengths.max() <= width
    assert p.attention_mask.sum(axis=1).tolist() == batch.lengths.tolist()
    for i, seq in enumerate(batch.sequences()):
        assert p.tokens[i, : len(seq)].tolist() == seq.tolist()
        assert (p.tokens[i, len(seq) :] == 7).all() and (p.masks[i, len(seq) :] == -100).all()
    lp = batch.floats["inference_logprobs"]
    assert np.array_equal(p.floats["inference_logprobs"][p.attention_mask], lp)


def test_grpo_advantages_are_normalised_per_group() -> None:
    records = make_records([[3, 3, 3, 3], [2, 2]])
    records[0] = GroupRecord(**{**_fields(records[0]), "scores": np.array([1.0, 0.0, 0.0, 1.0])})
    records[1] = GroupRecord(**{**_fields(records[1]), "scores": np.array([2.0, 2.0])})
    batch = from_records(records, step=0)
    adv = batch.grpo_advantages()
    assert np.allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)  # mean 0.5, std 0.5
    assert adv[4:].tolist() == [0.0, 0.0]  # equal scores: no signal, and no NaN
    assert np.allclose(batch.grpo_advantages(scale=False)[:4], [0.5, -0.5, -0.5, 0.5])
    assert batch.advantages.tolist() == np.repeat(adv, batch.lengths).tolist()


def test_handler_advantages_win_where_sent() -> None:
    records = make_records([[3, 2], [4]], advantages=[True, False])
    batch = from_records(records, step=0)
    sent = records[0].floats["advantages"]
    assert np.array_equal(batch.advantages[:5], sent)
    assert np.array_equal(batch.advantages[5:], np.repeat(batch.grpo_advantages()[2:], 4))


def test_a_rank_holding_part_of_a_group_normalises_over_the_whole_group() -> None:
    [rec] = make_records([[2, 2]])
    part = GroupRecord(
        **{
            **_fields(rec),
            "lengths": rec.lengths[:1],
            "tokens": rec.tokens[:2],
            "masks": rec.masks[:2],
            "scores": np.array([1.0]),
            "floats": {},
            "meta": {"group_scores": [1.0, 0.0, 0.0, 1.0]},
        }
    )
    batch = from_records([part], step=0)
    assert np.allclose(batch.grpo_advantages(), [1.0], atol=1e-5)
    assert batch.meta == [{}]


@given(group_lengths)
@settings(max_examples=30)
def test_json_and_binary_give_the_same_batch(groups: list[list[int]]) -> None:
    records = make_records(groups, advantages=[i % 2 == 0 for i in range(len(groups))])
    from_wire = from_json(orjson.loads(dumps({"batch": [to_atropos(r) for r in records]}))["batch"], step=0)
    direct = from_records(records, step=0)
    for name in ("tokens", "masks", "offsets", "scores", "group_index", "env_ids", "policy_steps"):
        assert np.array_equal(getattr(from_wire, name), getattr(direct, name)), name
        assert getattr(from_wire, name).dtype == getattr(direct, name).dtype, name
    for name, arr in direct.floats.items():
        assert np.array_equal(from_wire.floats[name], arr, equal_nan=True)
    assert from_wire.group_ids == direct.group_ids
    assert [m["messages"] for m in from_wire.meta] == [m["messages"] for m in direct.meta]
    assert from_wire.weight_versions is None and direct.weight_versions is None


@given(group_lengths, st.data())
@settings(max_examples=30)
def test_weight_versions_sit_beside_the_masks_in_every_view(groups: list[list[int]], data: st.DataObject) -> None:
    """Per token, the version its group sent (-1 in groups that sent none, and on padding), in the flat, padded and
    packed views alike, from JSON as from the binary records."""
    sent = data.draw(st.lists(st.booleans(), min_size=len(groups), max_size=len(groups)))
    records = make_records(groups, versions=sent)
    direct = from_records(records, step=0)
    from_wire = from_json(orjson.loads(dumps({"batch": [to_atropos(r) for r in records]}))["batch"], step=0)
    if not any(sent):
        assert direct.weight_versions is None and from_wire.weight_versions is None
        return
    expected = np.concatenate(
        [np.full(r.n_tokens, -1) if r.weight_versions is None else r.weight_versions for r in records]
    )
    assert direct.weight_versions is not None and from_wire.weight_versions is not None
    assert np.array_equal(direct.weight_versions, expected) and direct.weight_versions.dtype == np.int64
    assert np.array_equal(from_wire.weight_versions, expected) and from_wire.weight_versions.dtype == np.int64
    padded = direct.padded()
    assert padded.weight_versions is not None
    assert np.array_equal(padded.weight_versions[padded.attention_mask], expected)
    assert (padded.weight_versions[~padded.attention_mask] == -1).all()
    packed = direct.packed(max(map(max, groups)) + 3)
    assert packed.weight_versions is not None
    for i, seq in enumerate(direct.sequences(direct.weight_versions)):
        r, c = int(packed.row[i]), int(packed.start[i])
        assert np.array_equal(packed.weight_versions[r, c : c + seq.shape[0]], seq)
    assert (packed.weight_versions[packed.segment_ids == -1] == -1).all()


def test_torch_is_optional_with_a_helpful_error(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = from_records(make_records([[3]]), step=0)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="pip install torch"):
        batch.to_torch()


def _fields(rec: GroupRecord) -> dict[str, object]:
    return {name: getattr(rec, name) for name in GroupRecord.__dataclass_fields__}


def test_empty_batch_is_well_formed() -> None:
    batch: Batch = from_records([], step=1)
    assert batch.n_seqs == 0 and batch.packed(8).tokens.shape == (0, 8) and batch.padded().tokens.shape == (0, 0)
