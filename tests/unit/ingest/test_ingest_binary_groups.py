"""api.ingest.binary_groups: a canonical record is stored byte for byte, anything else valid is re-encoded to the
same group."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from api.errors import InvalidData
from api.ingest.binary_groups import check_body, check_record
from api.ingest.validation import GroupLimits
from api.wire.records import decode, encode_submission, encode_submission_list
from tests.factories import group

LIMITS = GroupLimits(max_token_len=64, max_group_seqs=8)


def check(raw: bytes) -> Any:
    return check_record(raw, env_ids={0}, current_step=7, limits=LIMITS)


def reordered(raw: bytes, **changes: Any) -> bytes:
    m = msgpack.unpackb(raw)
    m.update(changes)
    return msgpack.packb(dict(reversed(list(m.items()))), use_bin_type=True)  # type: ignore[no-any-return]


def test_canonical_bytes_are_kept() -> None:
    raw = encode_submission(
        **group(4, length=[3, 9, 1, 5], env_id=0), policy_step=2, messages=[[{"role": "u", "content": "x"}]] * 4
    )
    checked = check(raw)
    assert checked.passthrough and checked.payload is raw


@pytest.mark.parametrize(
    "variant",
    [
        lambda raw: msgpack.packb({**msgpack.unpackb(raw), "policy_step": None}, use_bin_type=True),  # server stamps
        lambda raw: reordered(raw),  # same content, other key order
        lambda raw: msgpack.packb({**msgpack.unpackb(raw), "extra": 1}, use_bin_type=True),  # unknown key
        lambda raw: msgpack.packb({**msgpack.unpackb(raw), "meta": {"overrides": None}}, use_bin_type=True),
    ],
)
def test_other_valid_records_are_reencoded_to_the_same_group(variant: Any) -> None:
    raw = encode_submission(**group(4, length=[3, 9, 1, 5], env_id=0), policy_step=7)
    checked = check(variant(raw))
    assert not checked.passthrough
    assert checked.payload == raw  # canonical form: exactly what a canonical client would have sent
    assert decode(checked.payload).tokens.tolist() == decode(raw).tokens.tolist()


def test_an_unstamped_record_gets_the_step_written_in() -> None:
    body = group(3, length=[3, 9, 1], env_id=0)
    sent = encode_submission(**body, messages=[[{"role": "u", "content": "policy_step"}]] * 3)
    checked = check(sent)
    assert not checked.passthrough and checked.sent_policy_step is None
    assert checked.payload == encode_submission(
        **body, policy_step=7, messages=[[{"role": "u", "content": "policy_step"}]] * 3
    )
    assert decode(checked.payload).policy_step == 7


@pytest.mark.parametrize("step", [5, None])
def test_a_producer_id_is_cut_off_not_re_encoded(step: int | None) -> None:
    """The runner names its producer on every group: the ledger keeps it apart, and the record is still stored
    as sent (its last key cut off, the step spliced in when the producer sent none), byte for byte what the
    same group without a producer would be stored as."""
    body = group(3, length=[3, 9, 1], env_id=0)
    checked = check(encode_submission(**body, policy_step=step, producer_id="host-1:42:ab"))
    assert checked.record.producer_id == "host-1:42:ab"
    assert checked.passthrough == (step is not None) and checked.sent_policy_step == step
    assert checked.payload == encode_submission(**body, policy_step=7 if step is None else step)
    assert decode(checked.payload).producer_id is None


def test_body_errors_are_located_in_the_request() -> None:
    good = encode_submission(**group(4, env_id=0))
    bad = encode_submission(**group(4, env_id=0), group_id="x" * 201)
    with pytest.raises(InvalidData) as one:
        check_body(bad, many=False, env_ids={0}, current_step=0, limits=LIMITS)
    assert one.value.loc == ("body", "group_id")
    with pytest.raises(InvalidData) as many:
        check_body(encode_submission_list([good, bad]), many=True, env_ids={0}, current_step=0, limits=LIMITS)
    assert many.value.loc == ("body", 1, "group_id")
    assert (
        len(check_body(encode_submission_list([good, good]), many=True, env_ids={0}, current_step=0, limits=LIMITS))
        == 2
    )


def test_a_lone_canonical_record_is_stored_as_the_body_it_came_in() -> None:
    """/scored_data's body in the stored form is the payload itself, not a copy of it; a list's records are
    copied out of theirs, and a bytearray body (one grown past `JOIN_UP_TO`) is copied into immutable bytes."""
    raw = encode_submission(**group(4, env_id=0), policy_step=0)
    [one] = check_body(raw, many=False, env_ids={0}, current_step=0, limits=LIMITS)
    assert one.passthrough and one.payload is raw
    [grown] = check_body(bytearray(raw), many=False, env_ids={0}, current_step=0, limits=LIMITS)
    assert type(grown.payload) is bytes and grown.payload == raw
    [listed] = check_body(encode_submission_list([raw]), many=True, env_ids={0}, current_step=0, limits=LIMITS)
    assert listed.payload == raw and listed.payload is not raw


def test_arrays_are_views_on_the_sent_bytes_with_the_wire_dtypes() -> None:
    rec = check(encode_submission(**group(2, length=4, env_id=0))).record
    assert (rec.tokens.dtype, rec.masks.dtype, rec.scores.dtype) == (np.dtype("<i4"), np.dtype("<i4"), np.dtype("<f8"))
    assert rec.floats["inference_logprobs"].dtype == np.dtype("<f4") and rec.policy_step == 7


def test_weight_versions_stay_in_the_stored_form() -> None:
    """A record with per-token versions (and a producer, cut off) is stored as sent, as one without them is."""
    body = group(2, length=[3, 2], env_id=0)
    versions = [[1, 2, 2], [0, 2]]
    stored = encode_submission(**body, policy_step=0, token_weight_versions=versions)
    checked = check(encode_submission(**body, policy_step=0, token_weight_versions=versions, producer_id="p"))
    assert checked.passthrough and checked.payload == stored
    assert checked.record.weight_versions is not None and checked.record.weight_versions.tolist() == [1, 2, 2, 0, 2]
    unstamped = check(encode_submission(**body, token_weight_versions=versions))
    assert not unstamped.passthrough and unstamped.payload == encode_submission(
        **body, policy_step=7, token_weight_versions=versions
    )


@pytest.mark.parametrize(
    ("value", "loc", "rule"),
    [
        (np.array([1, 2, 2, 0], "<i4").tobytes(), ("token_weight_versions", 1), "run out in sequence 1"),
        (np.array([1, 2, -2, 0, 0], "<i4").tobytes(), ("token_weight_versions", 0, 2), "must be >= 0, got -2"),
        ([1, 2, 2, 0, 2], ("token_weight_versions",), "must be msgpack bin of little-endian int32"),
        (b"\x00" * 7, ("token_weight_versions",), "not a whole number of int32 values"),
    ],
)
def test_bad_weight_versions_are_named_on_the_binary_path(value: Any, loc: tuple[Any, ...], rule: str) -> None:
    raw = encode_submission(**group(2, length=[3, 2], env_id=0), policy_step=0)
    with pytest.raises(InvalidData, match=rule) as exc:
        check(msgpack.packb({**msgpack.unpackb(raw), "token_weight_versions": value}, use_bin_type=True))
    assert exc.value.loc == loc
