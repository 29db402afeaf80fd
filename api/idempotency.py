"""Idempotency keys as payment APIs use them: the same key with the same content is a duplicate, the same
key with different content is a conflict. Pure: no I/O.

A group id (or an `Idempotency-Key` header) is remembered with the reply it got and a digest of the
group's content, in the store's reply table (`Txn.put_reply`), so the rule holds across processes,
restarts and backends without a change to the store interface. Replies remembered before digests existed
carry none: a resubmission under such a key is taken as a duplicate, as it was then.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import numpy as np
import orjson

from api.records import FLOAT_FIELDS, GroupRecord

DIGEST_KEY = "content_digest"
"""Key of the digest inside a remembered reply's JSON (ScoredReply ignores it when read back)."""
_F64 = np.dtype("<f8")


def content_digest(rec: GroupRecord, sent_policy_step: int | None) -> str:
    """A digest of what the handler sent: the same group sent again, by either encoding, gives the same one.

    `sent_policy_step` is the step as sent (None when the server stamped it), so a retry of an unstamped
    group at a later step is still the same content. Floats are hashed as float64, which every stored
    form (float32 or float64) converts to exactly.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(msgpack.packb([rec.env_id, sent_policy_step, rec.group_id, rec.seqs, rec.n_tokens]))
    for arr in (rec.lengths, rec.tokens, rec.masks):
        h.update(np.ascontiguousarray(arr, "<i4").tobytes())
    h.update(np.ascontiguousarray(rec.scores, _F64).tobytes())
    for name in FLOAT_FIELDS:
        values = rec.floats.get(name)
        h.update(b"\x00" if values is None else b"\x01" + np.asarray(values, _F64).tobytes())
    h.update(msgpack.packb(_canonical(rec.meta), use_bin_type=True))
    return h.hexdigest()


def remember(reply_json: str, digest: str | None) -> str:
    """The text stored for a key: the reply, with the content digest beside its fields."""
    if digest is None:
        return reply_json
    obj = orjson.loads(reply_json)
    obj[DIGEST_KEY] = digest
    return orjson.dumps(obj).decode()


def same_content(remembered: str, digest: str | None) -> bool:
    """Whether a resubmission with this digest repeats the remembered one (unknown digests count as same)."""
    old = orjson.loads(remembered).get(DIGEST_KEY)
    return old is None or digest is None or old == digest


def _canonical(value: Any) -> Any:
    """JSON-like values with object keys sorted (msgpack keeps a dict's order): key order is not content."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value
