"""Tokens too old to train on: a served group's trained tokens that weights older than its env's
`max_token_staleness` allows sampled, masked out of the loss. Pure: no I/O.

Judged when the batch is formed, against its step: a token whose `token_weight_versions` entry is below `oldest`
(the batch's step minus the env's `max_token_staleness`) and whose mask is not already -100 is served with -100,
the ignore value every trainer reads (`trainer_client`'s `trained`, Atropos's convention). The store keeps the group
as it came; the batch's header keeps each masked record's `oldest`, and serving the kept batch again masks it again
(`apply_masks`), so the bytes served are the same each time. The group's `policy_step` is left as stored (the
oldest version): staleness counts from it as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from api.wire.records import GroupRecord, decode, encode, msgpack_array_header, split_records
from api.wire.rules import MASK_IGNORE


def oldest_kept(step: int, max_token_staleness: int | None) -> int | None:
    """The oldest weights version a batch of `step` trains tokens of (None: the env masks none for their age)."""
    return None if max_token_staleness is None else step - max_token_staleness


def stale(rec: GroupRecord, oldest: int) -> np.ndarray:
    """bool [T]: the trained tokens (mask not -100) sampled by weights older than `oldest`; none without versions."""
    if rec.weight_versions is None:
        return np.zeros(rec.n_tokens, np.bool_)
    out: np.ndarray = (rec.weight_versions < oldest) & (rec.masks != MASK_IGNORE)
    return out


def mask(rec: GroupRecord, oldest: int) -> tuple[GroupRecord, int]:
    """The group with its stale trained tokens masked (-100), and how many were."""
    old = stale(rec, oldest)
    n = int(np.count_nonzero(old))
    if not n:
        return rec, 0
    return replace(rec, masks=np.where(old, np.int32(MASK_IGNORE), rec.masks).astype(np.int32)), n


def mask_payload(payload: bytes, oldest: int) -> tuple[bytes, int]:
    """A stored group (one record) as served at `oldest`, and the tokens masked: the payload itself when none are."""
    rec, n = mask(decode(payload), oldest)
    return (encode(rec), n) if n else (payload, 0)


def mask_item(payload: bytes, n_groups: int, oldest: int) -> tuple[bytes, list[int]]:
    """A queue item's payload (`n_groups` records back to back: a side buffer's groups are released as one item) as
    served at `oldest`, and the tokens masked in each of its records: the payload itself when none are."""
    if n_groups == 1:
        out, n = mask_payload(payload, oldest)
        return out, [n]
    parts = split_records(msgpack_array_header(n_groups) + payload, array=True)
    served = [mask_payload(bytes(p), oldest) for p in parts]
    counts = [n for _, n in served]
    return (b"".join(p for p, _ in served) if any(counts) else payload), counts


def apply_masks(records: bytes | memoryview, n_groups: int, oldest: Mapping[int, int]) -> bytes:
    """A batch's records (a msgpack array of `n_groups` records) with record `i` masked at `oldest[i]`, as it was
    when the batch was formed."""
    parts = split_records(records, array=True)
    assert len(parts) == n_groups, "a kept batch's records do not match its header"
    out = [mask_payload(bytes(p), oldest[i])[0] if i in oldest else p for i, p in enumerate(parts)]
    return b"".join([msgpack_array_header(n_groups), *out])
