"""Packing and validation of one group, without HTTP."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import InvalidData
from api.ingest.validation import F32_OVERFLOW, GroupLimits, finite_as_f32, pack_group
from api.run.filters import SCORE_RANGE, ZERO_VARIANCE, filter_reason, release_from_buffer
from api.run.printable import MAX_META_DEPTH, check_printable
from api.wire.records import decode, encode
from api.wire.schema import Registration, ScoredData
from tests.factories import group, registration

LIMITS = GroupLimits(max_token_len=512, max_group_seqs=16)


def test_pack_round_trips_through_the_record() -> None:
    body = group(3, length=[5, 9, 2], messages=[[{"role": "user", "content": "x"}]] * 3, group_id="g")
    rec = pack_group(ScoredData.model_validate(body), env_id=0, current_step=7, limits=LIMITS)
    back = decode(encode(rec))
    assert back.lengths.tolist() == [5, 9, 2]
    assert [t.tolist() for t in back.split(back.tokens)] == body["tokens"]
    assert [m.tolist() for m in back.split(back.masks)] == body["masks"]
    lps = [x.astype(np.float64).tolist() for x in back.split(back.floats["inference_logprobs"])]
    assert lps == body["inference_logprobs"]
    assert back.scores.tolist() == body["scores"]
    assert back.meta["messages"] == body["messages"] and back.group_id == "g" and back.policy_step == 7


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 10_000))
def test_any_valid_group_packs(lengths: list[int], seed: int) -> None:
    body = group(len(lengths), length=lengths, seed=seed)
    rec = pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    assert rec.seqs == len(lengths) and rec.n_tokens == sum(lengths)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12), min_size=1, max_size=4))
def test_masks_are_any_int32_and_kept_as_sent(masks: list[list[int]]) -> None:
    """-100 / token id (Atropos's BaseEnv), 0/1, or anything else in int32: stored exactly as sent."""
    body = group(len(masks), length=[len(m) for m in masks])
    body["masks"] = masks
    rec = pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    back = decode(encode(rec))
    assert [m.tolist() for m in back.split(back.masks)] == masks


def test_zero_one_masks_are_accepted() -> None:
    body = group(2, length=6)
    body["masks"] = [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    rec = pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    assert rec.masks.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(("value", "rule"), [(2**31, "fit in int32"), (-(2**31) - 1, "fit in int32")])
def test_mask_beyond_int32_is_named(value: int, rule: str) -> None:
    body = group(2, length=6)
    body["masks"][1][4] = value
    with pytest.raises(InvalidData, match=rule) as exc:
        pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    assert exc.value.loc == ("masks", 1, 4)


@pytest.mark.parametrize(("value", "rule"), [(-1, "must be >= 0, got -1"), (-(2**31), ">= 0"), (2**31, "int32")])
def test_bad_token_id_points_at_the_position(value: int, rule: str) -> None:
    body = group(3, length=6)
    body["tokens"][2][5] = value
    with pytest.raises(InvalidData, match=rule) as exc:
        pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    assert exc.value.loc == ("tokens", 2, 5)


def test_policy_step_ahead_of_the_trainer_is_rejected() -> None:
    from api.ingest.validation import check_policy_step

    with pytest.raises(InvalidData, match="8 is ahead of the trainer, which is at step 7") as exc:
        check_policy_step(8, 7)
    assert exc.value.loc == ("policy_step",)
    check_policy_step(8, 8)  # equal: fine
    check_policy_step(8, 9)  # behind: fine
    check_policy_step(None, 0)  # Atropos handlers send none
    sd = ScoredData.model_validate(group(2, length=4, policy_step=8))
    assert pack_group(sd, env_id=None, current_step=9, limits=LIMITS).policy_step == 8
    stamped = ScoredData.model_validate(group(2, length=4))
    assert pack_group(stamped, env_id=None, current_step=5, limits=LIMITS).policy_step == 5


def test_nan_logprob_is_rejected() -> None:
    body = group(2, length=4)
    body["inference_logprobs"][0][1] = float("nan")
    with pytest.raises(InvalidData, match="finite"):
        pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)


def test_token_budget_bounds_a_group() -> None:
    limits = GroupLimits(max_token_len=512, max_group_seqs=16, max_group_tokens=30)
    with pytest.raises(InvalidData, match="max_batch_tokens of 30"):
        pack_group(ScoredData.model_validate(group(4, length=8)), env_id=None, current_step=0, limits=limits)


def test_filters() -> None:
    reg = Registration.model_validate(registration(drop_zero_variance=True, min_score=-0.5, max_score=0.5))
    assert filter_reason(np.array([1.0, 1.0]), reg) == ZERO_VARIANCE
    assert filter_reason(np.array([1.0, 0.8]), reg) == SCORE_RANGE
    assert filter_reason(np.array([-1.0, -0.5]), reg) == SCORE_RANGE
    assert filter_reason(np.array([0.0, 0.5]), reg) is None
    plain = Registration.model_validate(registration())
    assert filter_reason(np.array([1.0, 1.0]), plain) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), max_size=8), st.integers(1, 16))
def test_side_buffer_release_is_exact_and_oldest_first(sizes: list[int], target: int) -> None:
    picked = release_from_buffer(sizes, target)
    subsets = [[i for i in range(len(sizes)) if mask >> i & 1] for mask in range(1 << len(sizes))]
    exact = [s for s in subsets if sum(sizes[i] for i in s) == target]
    assert (picked is None) == (not exact)
    if picked is not None:
        assert sum(sizes[i] for i in picked) == target and picked == sorted(set(picked))


def test_a_logprob_beyond_float32_is_rejected_not_stored_as_infinity() -> None:
    body = group(2, length=4)
    body["inference_logprobs"][1][2] = 1e300  # finite as a float64, infinite in the float32 it is stored as
    with pytest.raises(InvalidData, match="finite float32") as exc:
        pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    assert exc.value.loc == ("inference_logprobs",)


def test_negative_and_zero_lengths_are_named() -> None:
    from api.ingest.validation import check_lengths

    with pytest.raises(InvalidData, match="lengths must be positive") as exc:
        check_lengths(np.array([3, -1], dtype=np.int32), LIMITS, "lengths")
    assert exc.value.loc == ("lengths", 1)
    with pytest.raises(InvalidData, match="empty sequence"):
        check_lengths(np.array([0], dtype=np.int32), LIMITS, "tokens")


_EDGES = [
    0.0,
    -0.0,
    1e-45,
    float(np.finfo(np.float32).max),
    F32_OVERFLOW,
    np.nextafter(F32_OVERFLOW, 0.0),
    1e300,
    float("inf"),
    float("nan"),
]


@given(
    st.lists(
        st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(_EDGES + [-x for x in _EDGES]), max_size=40
    ),
    st.booleans(),
)
def test_finite_as_f32_is_the_cast_then_isfinite(values: list[float], as_f32: bool) -> None:
    """The two reductions decide as the cast the trainer makes would: exactly at float32's rounding edge too."""
    arr = np.asarray(values, np.float64)
    if as_f32:
        with np.errstate(over="ignore"):
            arr = arr.astype(np.float32)
    with np.errstate(over="ignore"):
        expected = bool(np.isfinite(arr.astype(np.float32)).all())
    assert finite_as_f32(arr) is expected


text = st.text(st.characters(categories=["Cs", "Ll", "Nd", "Cc"]), max_size=4)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=10
)


def nest(depth: int) -> object:
    value: object = 0
    for _ in range(depth // 2):
        value = {"k": [value]}
    return value


nested = st.integers(25, 40).map(nest)


def depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values | nested | st.dictionaries(text, json_values | nested, max_size=3))
def test_what_the_json_rule_lets_through_every_reply_and_store_can_carry(value: object) -> None:
    """`check_printable` over any value (lone surrogates in strings and in map keys, at any depth, integers past 64
    bits, NaN and infinities, nesting around its bound): refused naming where (a location that is itself valid
    Unicode, for the reply that names it), or strict JSON of valid Unicode and 64-bit integers, within the bound."""
    try:
        check_printable({"v": value})
    except InvalidData as exc:
        assert exc.loc[0] == "v"
        ".".join(map(str, exc.loc)).encode()  # the reply names it
        return
    json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    orjson.dumps(value)  # 64-bit integers, valid strings
    assert depth(value) <= MAX_META_DEPTH


# ------------------------------------------------------------------------------------ per-token weight versions


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), min_size=1, max_size=4))
def test_weight_versions_are_kept_as_sent_beside_the_masks(versions: list[list[int]]) -> None:
    body = group(len(versions), length=[len(v) for v in versions])
    body["token_weight_versions"] = versions
    rec = pack_group(ScoredData.model_validate(body), env_id=None, current_step=0, limits=LIMITS)
    back = decode(encode(rec))
    assert back.weight_versions is not None and back.weight_versions.dtype == np.int32
    assert [v.tolist() for v in back.split(back.weight_versions)] == versions


def test_a_group_without_weight_versions_is_encoded_as_before() -> None:
    """The key is written only when sent: the stored bytes of a group without it are those of a record without
    the field at all (a reader that does not know it, or an older server, sees the same bytes)."""
    import msgpack

    rec = pack_group(ScoredData.model_validate(group(2, length=4)), env_id=None, current_step=0, limits=LIMITS)
    assert rec.weight_versions is None
    assert "token_weight_versions" not in msgpack.unpackb(encode(rec))


@pytest.mark.parametrize(
    ("rows", "loc", "rule"),
    [
        ([[0, 0, 0, 0], [0, 0, -1, 0]], ("token_weight_versions", 1, 2), "must be >= 0, got -1"),
        ([[0, 0, 0, 2**31], [0, 0, 0, 0]], ("token_weight_versions", 0, 3), "must fit in int32"),
        ([[0, 0, 0], [0, 0, 0, 0]], ("token_weight_versions", 0), "3 values for 4 tokens: lengths must match"),
        ([[0, 0, 0, 0]], ("token_weight_versions",), "1 rows for 2 sequences: need one per sequence"),
    ],
)
def test_bad_weight_versions_are_named(rows: list[list[int]], loc: tuple[object, ...], rule: str) -> None:
    body = group(2, length=4)
    body["token_weight_versions"] = rows
    with pytest.raises(InvalidData, match=rule) as exc:
        pack_group(ScoredData.model_validate(body), env_id=None, current_step=9, limits=LIMITS)
    assert exc.value.loc == loc


def test_weight_versions_ahead_of_the_trainer_are_named() -> None:
    from api.ingest.validation import check_versions_step

    body = group(2, length=4)
    body["token_weight_versions"] = [[3, 3, 4, 4], [3, 5, 5, 3]]
    rec = pack_group(ScoredData.model_validate(body), env_id=None, current_step=9, limits=LIMITS)
    check_versions_step(rec, 5)  # every token from weights the trainer made
    with pytest.raises(InvalidData, match="5 is ahead of the trainer, which is at step 4") as exc:
        check_versions_step(rec, 4)
    assert exc.value.loc == ("token_weight_versions", 1, 1)
