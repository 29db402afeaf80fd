"""Blob references in stored records (api/wire/blobs.py): a record with its large values referenced and put back is
the record as sent, byte for byte; siblings' equal values are one blob; only the blob fields are touched; records
cut to their first sequences keep their references right."""

from __future__ import annotations

import msgpack
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from api.batches.trim import first_sequences
from api.wire import blobs as blobs_module
from api.wire.blobs import (
    BLOB_FIELDS,
    MARKER,
    REF_BYTES,
    Ref,
    digest_of,
    externalize,
    has_refs,
    inline_record,
    inline_records,
    owner_tag,
    references,
    refs_in,
)
from api.wire.records import decode, dumps, encode_submission, msgpack_array_header

TAG = owner_tag("env-key")
NONE: dict[bytes, bytes] = {}
"""No blob at all."""

value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=40) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def records(draw: st.DrawFn) -> bytes:
    """A valid group record with any blob fields (as a value or as a list of per-sequence values)."""
    n = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 5)) for _ in range(n)]
    tokens = [[1 + j for j in range(k)] for k in lengths]
    meta: dict[str, object] = {}
    for name in BLOB_FIELDS:
        if draw(st.booleans()):
            big = st.text(min_size=0, max_size=300)
            meta[name] = draw(st.lists(big | value, min_size=n, max_size=n) | big)
    if draw(st.booleans()):
        meta["messages"] = [[{"role": "user", "content": draw(st.text(max_size=300))}] for _ in range(n)]
    return encode_submission(tokens, tokens, [0.5] * n, env_id=0, policy_step=1, **meta)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(records(), st.integers(1, 400))
def test_a_record_put_back_is_the_record_as_sent(record: bytes, min_size: int) -> None:
    stored, blobs = externalize(record, min_size, TAG)
    assert all(digest_of(b) == d and len(b) >= min_size for d, b in blobs.items())
    assert inline_record(stored, lambda r: blobs[r.digest]) == record
    assert {r.digest for r in refs_in(stored)} >= set(blobs)
    assert all(r.tag == TAG for r in refs_in(stored) if r.digest in blobs)
    # untouched: everything but the blob fields' values, and those below the size
    a, b = decode(record), decode(stored)
    assert (a.tokens == b.tokens).all() and a.meta.get("messages") == b.meta.get("messages")
    if not blobs:
        assert stored == record


@settings(max_examples=100, deadline=None)
@given(st.lists(records(), min_size=1, max_size=5), st.integers(1, 400))
def test_a_batch_of_records_put_back_is_the_batch_as_stored(group: list[bytes], min_size: int) -> None:
    parts = [externalize(r, min_size, TAG) for r in group]
    blobs = {d: b for _, bs in parts for d, b in bs.items()}
    batch = b"".join([msgpack_array_header(len(group)), *(s for s, _ in parts)])
    assert inline_records(batch, lambda r: blobs[r.digest], array=True) == b"".join(
        [msgpack_array_header(len(group)), *group]
    )
    assert inline_records(b"".join(s for s, _ in parts), lambda r: blobs[r.digest], array=False) == b"".join(group)
    assert list(references(batch, array=True)) == list(refs_in(batch))  # no token array looks like one here


def test_siblings_sending_one_image_store_it_once() -> None:
    image = "i" * 10_000
    record = encode_submission([[1, 2]] * 8, [[1, 2]] * 8, [1.0] * 8, env_id=0, policy_step=0, images=[image] * 8)
    stored, blobs = externalize(record, 1024, TAG)
    assert len(blobs) == 1 and len(stored) < len(record) - 7 * len(image)
    assert len(list(refs_in(stored))) == 8
    (blob,) = blobs.values()
    assert msgpack.unpackb(blob) == image


def test_owners_name_their_blobs_apart() -> None:
    record = encode_submission([[1]], [[1]], [1.0], env_id=0, policy_step=0, images="x" * 5000)
    one, b1 = externalize(record, 1024, owner_tag("a"))
    two, b2 = externalize(record, 1024, owner_tag("b"))
    assert b1.keys() == b2.keys() and one != two
    assert {r.tag for r in refs_in(one)} == {owner_tag("a")}


def test_a_cut_group_keeps_the_references_of_its_sequences() -> None:
    """`no_exact_fill: "trim"` decodes and encodes a stored record: the references of the kept sequences stay."""
    rows = [[[j, j + 1]] * 2 for j in range(4)]
    distill = [[[float(j)] * 200 for _ in range(2)] for j in range(4)]
    record = encode_submission(
        [[1, 2]] * 4,
        [[1, 2]] * 4,
        [1.0, 0.0, 1.0, 0.0],
        env_id=0,
        policy_step=0,
        distill_token_ids=rows,
        distill_logprobs=distill,
    )
    stored, blobs = externalize(record, 1024, TAG)
    assert len(blobs) == 4
    cut, _ = first_sequences(stored, 2)
    back = decode(inline_record(cut, lambda r: blobs[r.digest]))
    assert back.meta["distill_logprobs"] == distill[:2] and back.meta["distill_token_ids"] == rows[:2]


def test_a_missing_blob_is_a_key_error_and_bytes_that_only_look_like_a_reference_are_left_alone() -> None:
    record = encode_submission([[1]], [[1]], [1.0], env_id=0, policy_step=0, images="x" * 5000)
    stored, _ = externalize(record, 1024, TAG)
    try:
        inline_record(stored, lambda r: NONE[r.digest])
    except KeyError:
        pass
    else:
        raise AssertionError("a missing blob was not noticed")
    looks = np.frombuffer(MARKER + bytes(REF_BYTES), np.uint8)
    tokens = np.resize(looks, 4 * ((len(looks) + 3) // 4)).view("<i4") & 0x7FFFFFFF
    plain = encode_submission([tokens.tolist()], [tokens.tolist()], [1.0], env_id=0, policy_step=0)
    assert inline_record(plain, lambda r: NONE[r.digest]) == plain  # a token array is never read as a reference
    assert list(refs_in(plain)) and not list(references(plain, array=False))
    assert not has_refs(encode_submission([[1]], [[1]], [1.0], env_id=0, policy_step=0))
    assert Ref.unpack(Ref(TAG, bytes(32), 7).pack()[len(MARKER) :]) == Ref(TAG, bytes(32), 7)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        value | st.binary(max_size=300) | st.text(min_size=32, max_size=70_000) | st.integers(-(2**63), 2**64 - 1),
        lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner, max_size=20),
        max_leaves=40,
    )
)
def test_values_are_walked_as_msgpack_reads_them(v: object) -> None:
    """The walker that finds a record's fields without reading its values ends each value where msgpack does."""
    packed = msgpack.packb(v, use_bin_type=True)
    view = memoryview(packed + b"\xc0")
    assert blobs_module._skip(view, 0) == len(packed)
    for size in (1, 2, 4, 8, 16, 56, 300, 70_000):  # fixext, ext 8/16/32
        ext = msgpack.packb(msgpack.ExtType(5, b"x" * size))
        assert blobs_module._skip(memoryview(ext + b"\xc0"), 0) == len(ext)


def test_json_shows_a_reference_not_put_back_as_its_digest_and_size() -> None:
    """What an export writes for a blob (the export does not put blobs back): its digest and size, never a 500."""
    record = encode_submission([[1]], [[1]], [1.0], env_id=0, policy_step=0, images=["x" * 5000])
    stored, blobs = externalize(record, 1024, TAG)
    (digest,) = blobs
    shown = orjson.loads(dumps(decode(stored).meta))
    assert shown == {"images": [{"blob": "sha256:" + digest.hex(), "size": len(blobs[digest])}]}
    try:
        dumps({"other": msgpack.ExtType(5, b"x")})
    except TypeError:
        pass
    else:
        raise AssertionError("another ext type was printed")
