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

from api.wire.records import F32, FLOAT_FIELDS, GroupRecord, narrowest

DIGEST_KEY = "content_digest"
"""Key of the digest inside a remembered reply's JSON (ScoredReply ignores it when read back)."""
_F64 = np.dtype("<f8")
_F32 = np.dtype(F32)
_EMPTY_MAP = msgpack.packb({})


DIGEST_VERSION = "2:"
"""Prefix of the digests written now. One without it was written before (`legacy_digest`): a resubmission is
compared with it by computing that one."""


def content_digest(rec: GroupRecord, sent_policy_step: int | None, *, narrowed: bool = False) -> str:
    """A digest of what the handler sent: the same group sent again, by either encoding, gives the same one.

    `sent_policy_step` is the step as sent (None when the server stamped it), so a retry of an unstamped
    group at a later step is still the same content. The arrays are hashed as they are stored, without a
    copy: a float field in its narrowest exact form (`narrowest`, as both encodings store it), so the same
    values give the same bytes. SHA-256 (with the CPU's SHA instructions) runs about 3x faster than BLAKE2b
    here, which for a large group was most of what the digest cost (issue 38). `narrowed`: the record's float
    fields are in that form already (validation leaves them so), and are hashed without checking again."""
    h = hashlib.sha256()
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
    return DIGEST_VERSION + h.hexdigest()[:32]


def _hash_ids(h: Any, rec: GroupRecord, sent_policy_step: int | None) -> None:
    """What both digest versions hash alike: the ids, the shape, the integer arrays and the scores."""
    h.update(msgpack.packb([rec.env_id, sent_policy_step, rec.group_id, rec.seqs, rec.n_tokens]))
    for arr in (rec.lengths, rec.tokens, rec.masks):
        h.update(np.ascontiguousarray(arr, "<i4").data)
    h.update(np.ascontiguousarray(rec.scores, _F64).data)


def legacy_digest(rec: GroupRecord, sent_policy_step: int | None) -> str:
    """The digest replies were remembered with before `DIGEST_VERSION` (BLAKE2b over float64 floats)."""
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


def same_content(remembered: str, digest: str | None, legacy: Callable[[], str] | None = None) -> bool:
    """Whether a resubmission with this digest repeats the remembered one (unknown digests count as same); a
    digest remembered in the legacy form is compared with `legacy()`, the resubmission's in that form."""
    old = orjson.loads(remembered).get(DIGEST_KEY)
    if old is None or digest is None:
        return True
    if not old.startswith(DIGEST_VERSION) and legacy is not None:
        return bool(old == legacy())
    return bool(old == digest)


def _canonical(value: Any) -> Any:
    """JSON-like values with object keys sorted (msgpack keeps a dict's order): key order is not content."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value
