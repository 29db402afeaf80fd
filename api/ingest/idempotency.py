"""Idempotency keys as payment APIs use them: the same key with the same content is a duplicate, the same
key with different content is a conflict. Pure: no I/O.

A group id (or an `Idempotency-Key` header) is remembered with the reply it got and a digest of the
group's content, in the store's reply table (`Txn.put_reply`), so the rule holds across processes,
restarts and backends without a change to the store interface. Replies remembered before digests existed
carry none: a resubmission under such a key is taken as a duplicate, as it was then.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import orjson
import xxhash

from api.wire.records import F32, FLOAT_FIELDS, GroupRecord, narrowest

DIGEST_KEY = "content_digest"
"""Key of the digest inside a remembered reply's JSON (ScoredReply ignores it when read back)."""
_F64 = np.dtype("<f8")
_F32 = np.dtype(F32)
_EMPTY_MAP = msgpack.packb({})


DIGEST_VERSION = "3:"
"""Prefix of the digests written now (XXH3-128). Those remembered before carry "2:" (SHA-256 over the same bytes)
or no prefix (BLAKE2b over float64 floats, `legacy_digest`): a resubmission is compared with a remembered one
by computing its own digest in that one's form (`digest_as`)."""
SHA256_VERSION = "2:"


def content_digest(rec: GroupRecord, sent_policy_step: int | None, *, narrowed: bool = False) -> str:
    """A digest of what the handler sent: the same group sent again, by either encoding, gives the same one.

    `sent_policy_step` is the step as sent (None when the server stamped it), so a retry of an unstamped
    group at a later step is still the same content. The arrays are hashed as they are stored, without a
    copy: a float field in its narrowest exact form (`narrowest`, as both encodings store it), so the same
    values give the same bytes. XXH3-128: 3 µs for a 262 KB group where SHA-256 takes 130. It tells
    a retry from a different group under a reused key, which needs no resistance to crafted collisions: a key
    holder can only make its own reused key look like a duplicate (docs/security.md). `narrowed`: the record's
    float fields are in that form already (validation leaves them so), and are hashed without checking again."""
    h = xxhash.xxh3_128()
    _feed(h, rec, sent_policy_step, narrowed)
    return DIGEST_VERSION + h.hexdigest()


def sha256_digest(rec: GroupRecord, sent_policy_step: int | None) -> str:
    """The digest replies were remembered with before XXH3 ("2:"): SHA-256 over the same bytes."""
    h = hashlib.sha256()
    _feed(h, rec, sent_policy_step, False)
    return SHA256_VERSION + h.hexdigest()[:32]


def digest_as(remembered: str, rec: GroupRecord, sent_policy_step: int | None) -> str:
    """This group's digest in the form of a `remembered` one (written by this version or an earlier one)."""
    if remembered.startswith(DIGEST_VERSION):
        return content_digest(rec, sent_policy_step)
    if remembered.startswith(SHA256_VERSION):
        return sha256_digest(rec, sent_policy_step)
    return legacy_digest(rec, sent_policy_step)


def _feed(h: Any, rec: GroupRecord, sent_policy_step: int | None, narrowed: bool) -> None:
    """What the "2:" and "3:" digests hash: the ids, the shape, the arrays as stored, the metadata."""
    _hash_ids(h, rec, sent_policy_step)
    for name in FLOAT_FIELDS:
        values = rec.floats.get(name)
        if values is None:
            h.update(b"\x00")
            continue
        if values.dtype != _F32 and not (narrowed and values.dtype == _F64):
            values = narrowest(np.asarray(values, _F64))
        h.update(b"\x04" if values.dtype == _F32 else b"\x08")
        h.update(np.ascontiguousarray(values, values.dtype.newbyteorder("<")).data)
    h.update(msgpack.packb(_canonical(rec.meta), use_bin_type=True) if rec.meta else _EMPTY_MAP)
    if rec.weight_versions is not None:  # hashed only when sent: the digests of groups without them are unchanged
        h.update(b"\x05")
        h.update(np.ascontiguousarray(rec.weight_versions, "<i4").data)


def _hash_ids(h: Any, rec: GroupRecord, sent_policy_step: int | None) -> None:
    """What every digest version hashes alike: the ids, the shape, the integer arrays and the scores."""
    h.update(msgpack.packb([rec.env_id, sent_policy_step, rec.group_id, rec.seqs, rec.n_tokens]))
    for arr in (rec.lengths, rec.tokens, rec.masks):
        h.update(np.ascontiguousarray(arr, "<i4").data)
    h.update(np.ascontiguousarray(rec.scores, _F64).data)


def legacy_digest(rec: GroupRecord, sent_policy_step: int | None) -> str:
    """The first digest replies were remembered with (no prefix: BLAKE2b over float64 floats)."""
    h = hashlib.blake2b(digest_size=16)
    _hash_ids(h, rec, sent_policy_step)
    for name in FLOAT_FIELDS:
        values = rec.floats.get(name)
        h.update(b"\x00" if values is None else b"\x01" + np.asarray(values, _F64).tobytes())
    h.update(msgpack.packb(_canonical(rec.meta), use_bin_type=True))
    return h.hexdigest()


def remember(reply: dict[str, Any], digest: str | None) -> str:
    """The text stored for a key: the reply's fields (as `model_dump(exclude_none=True)` gives them), with the
    content digest beside them."""
    return orjson.dumps(reply if digest is None else {**reply, DIGEST_KEY: digest}).decode()


def same_content(remembered: str, digest: str | None, digest_as: Callable[[str], str] | None = None) -> bool:
    """Whether a resubmission with this digest repeats the remembered one (unknown digests count as same); a
    digest remembered in an earlier form is compared with `digest_as(it)`, the resubmission's in that form."""
    old = orjson.loads(remembered).get(DIGEST_KEY)
    if old is None or digest is None:
        return True
    if not old.startswith(DIGEST_VERSION) and digest_as is not None:
        return bool(old == digest_as(old))
    return bool(old == digest)


def _canonical(value: Any) -> Any:
    """JSON-like values with object keys sorted (msgpack keeps a dict's order): key order is not content."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value
