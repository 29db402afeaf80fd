"""api.wire.records, the stored group record: numbers come back as sent. Per-token floats are stored float32
where that is exact for the field, else float64, and printed as the shortest text that reads back as the double."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from api.ingest.binary_groups import check_record
from api.ingest.json_groups import read_groups
from api.ingest.validation import GroupLimits, pack_group
from api.wire.records import F32, F64, decode, dumps, encode, encode_submission, narrowest, to_atropos

LIMITS = GroupLimits(max_token_len=64, max_group_seqs=8)
F32_MAX = float(np.finfo(np.float32).max)

float32_values = st.floats(width=32, allow_nan=False, allow_infinity=False).map(float)
"""float32 values printed as doubles, as vLLM sends logprobs."""
doubles = st.floats(min_value=-F32_MAX, max_value=F32_MAX, allow_nan=False)
"""Any double the trainer's float32 can hold without overflow: decimals, float64 results."""
any_value = st.one_of(float32_values, doubles)


def rows_of(values: st.SearchStrategy[float]) -> st.SearchStrategy[list[list[float]]]:
    return st.lists(st.lists(values, min_size=1, max_size=10), min_size=1, max_size=4)


def body_with(lps: list[list[float]], advantages: list[list[float]] | None = None) -> dict[str, Any]:
    return {
        "tokens": [[i + 1 for i in range(len(r))] for r in lps],
        "masks": [[-100] * len(r) for r in lps],
        "scores": [0.0] * len(lps),
        "inference_logprobs": lps,
        "advantages": advantages,
    }


def bits(rows: list[list[float]]) -> list[list[int]]:
    return [np.asarray(r, F64).view(np.int64).tolist() for r in rows]


def through_json_ingest(body: dict[str, Any]) -> Any:
    [g] = read_groups(json.dumps(body).encode(), many=False)
    rec = pack_group(g.data, env_id=None, current_step=0, limits=LIMITS, columns=g.columns)
    return decode(encode(rec))


@settings(max_examples=300, deadline=None)
@given(rows_of(any_value), st.booleans())
def test_json_numbers_come_back_as_sent(lps: list[list[float]], with_advantages: bool) -> None:
    advantages = [[float(np.float32(x)) for x in r] for r in lps] if with_advantages else None
    back = through_json_ingest(body_with(lps, advantages))
    echoed = orjson.loads(dumps(to_atropos(back)))
    assert bits(echoed["inference_logprobs"]) == bits(lps)  # bit for bit, -0.0 included
    if advantages is not None:
        assert bits(echoed["advantages"]) == bits(advantages)
        assert back.floats["advantages"].dtype == F32  # float32 values: stored at 4 bytes each


@settings(max_examples=200, deadline=None)
@given(rows_of(float32_values))
def test_float32_values_are_stored_as_float32(lps: list[list[float]]) -> None:
    back = through_json_ingest(body_with(lps))
    assert back.floats["inference_logprobs"].dtype == F32
    assert msgpack.unpackb(encode(back))["v"] == 1  # the layout version-1 readers know, byte for byte


def test_a_field_is_float64_only_when_float32_would_change_a_value() -> None:
    f32 = float(np.float32(-0.7))
    assert f32 == -0.699999988079071
    assert narrowest(np.array([f32, 1.0, -0.0])).dtype == F32
    assert narrowest(np.array([-0.7, 1.0])).dtype == F64
    assert narrowest(np.array([1e-300])).dtype == F64  # float32 would make it 0.0


def _narrowest_by_cast(values: np.ndarray) -> np.dtype[Any]:
    """The rule `narrowest` implements, by its definition: float32 when the cast changes no value."""
    with np.errstate(over="ignore", invalid="ignore"):
        return F32 if bool(np.equal(values.astype(F32), values).all()) else F64


@given(
    st.lists(st.one_of(float32_values, st.floats(width=64), st.floats(width=16).map(float)), max_size=20),
    st.sampled_from(["<f8", ">f8", "=f8"]),
    st.integers(0, 3),
)
@settings(max_examples=300, deadline=None)
def test_narrowest_reads_bits_first_and_keeps_the_rule(values: list[float], order: str, step: int) -> None:
    """The look at the first values' bits answers as the whole cast would: for any byte order, for strided views,
    and for NaN, infinity, subnormals and values past float32's range among float32 ones."""
    arr = np.array(values, dtype=order)[:: step + 1]
    out = narrowest(arr)
    assert out.dtype == _narrowest_by_cast(arr)
    assert np.array_equal(out.astype(F64), arr.astype(F64), equal_nan=True)


def test_the_issue_examples_come_back_as_the_text_sent() -> None:
    raw = b'{"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0],'
    raw += b' "inference_logprobs": [[1.0, -0.7, -0.6931471824645996]], "advantages": [[-0.699999988079071, 0.5, 2.0]]}'
    [g] = read_groups(raw, many=False)
    rec = pack_group(g.data, env_id=None, current_step=0, limits=LIMITS, columns=g.columns)
    assert rec.floats["inference_logprobs"].dtype == F64 and rec.floats["advantages"].dtype == F32
    text = dumps(to_atropos(decode(encode(rec))))
    assert b'"inference_logprobs":[[1.0,-0.7,-0.6931471824645996]]' in text
    assert b'"advantages":[[-0.699999988079071,0.5,2.0]]' in text


@settings(max_examples=100, deadline=None)
@given(rows_of(any_value))
def test_binary_submissions_keep_float64_and_narrow_what_float32_holds(lps: list[list[float]]) -> None:
    raw = encode_submission(
        [[1] * len(r) for r in lps],
        [[1] * len(r) for r in lps],
        [0.0] * len(lps),
        inference_logprobs=lps,
        policy_step=0,
    )
    checked = check_record(raw, env_ids=set(), current_step=0, limits=LIMITS)
    stored = checked.record.floats["inference_logprobs"]
    assert stored.tolist() == [x for r in lps for x in r]
    assert stored.dtype == narrowest(np.array([x for r in lps for x in r])).dtype
    assert checked.passthrough  # the client already wrote the server's form
    # float64 bytes that float32 holds exactly are narrowed (and the record re-encoded) by the server
    wide = msgpack.unpackb(raw)
    wide["inference_logprobs"] = np.asarray([x for r in lps for x in r], F64).tobytes()
    wide["v"] = 2
    again = check_record(msgpack.packb(wide), env_ids=set(), current_step=0, limits=LIMITS)
    assert again.record.floats["inference_logprobs"].dtype == stored.dtype
    assert again.payload == checked.payload


def test_records_written_before_float64_fields_still_read() -> None:
    """A version-1 record (all float fields float32), as stores written before this change hold them."""
    old = msgpack.packb(
        {
            "v": 1,
            "env_id": 0,
            "policy_step": 3,
            "group_id": None,
            "lengths": np.array([2], "<i4").tobytes(),
            "tokens": np.array([5, 6], "<i4").tobytes(),
            "masks": np.array([-100, 6], "<i4").tobytes(),
            "scores": np.array([1.0]).tobytes(),
            "advantages": None,
            "ref_logprobs": None,
            "inference_logprobs": np.array([1.0, -0.7], F32).tobytes(),
            "meta": {},
        }
    )
    rec = decode(old)
    assert rec.floats["inference_logprobs"].dtype == F32
    assert rec.floats["inference_logprobs"].tolist() == [1.0, float(np.float32(-0.7))]
    assert encode(rec) == old
