"""Task lease tokens (docs/tasks.md, "Leases"): `task:DATASET:EPOCH:INDEX:LEASE.NONCE`, the group id a producer
sends its task's group under. Made, parsed (totally: any string is a token or None) and matched against the
lease a task row holds, in constant time for the random part."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from api.store.tasks import TaskRow

TOKEN_PREFIX = "task:"
"""Lease tokens are group ids: a group sent with one (`group_id`) is its task's submission, idempotent as any. A
group id with this prefix is a lease token or refused."""


_N = "(0|[1-9][0-9]{0,17})"


_TOKEN = re.compile(rf"task:([A-Za-z0-9_.\-]{{1,64}}):{_N}:{_N}:{_N}(?:\.([0-9a-f]{{24}}))?")
"""`task:DATASET:EPOCH:INDEX:LEASE.NONCE`: ASCII digits only (`str.isdigit` takes `²`, which `int` refuses), at
most 18 of them (below 2^63 on every store) and no leading zero (one lease has one token: `token_of`'s), and the
nonce's 24 hex digits (96 random bits; absent only from a lease taken before tokens had one)."""


NONCE_BYTES = 12


def token_of(name: str, epoch: int, index: int, leases: int, nonce: str | None) -> str:
    base = f"{TOKEN_PREFIX}{name}:{epoch}:{index}:{leases}"
    return base if nonce is None else f"{base}.{nonce}"


@dataclass(frozen=True, slots=True)
class Token:
    """A lease token, parsed."""

    dataset: str
    epoch: int
    index: int
    lease: int
    """The task's lease number it was given with (a lease that lapsed is told apart from the one after it)."""
    nonce: str | None


def parse_token(token: str) -> Token | None:
    """The token's parts, or None if `token` is not a lease token. Total: any string parses or is None."""
    found = _TOKEN.fullmatch(token) if token.startswith(TOKEN_PREFIX) else None
    if found is None:
        return None
    name, epoch, index, lease, nonce = found.groups()
    return Token(name, int(epoch), int(index), int(lease), nonce)


def is_token(group_id: str | None) -> bool:
    """Whether a group id claims to be a lease token (it has the prefix): it must then parse and be held."""
    return group_id is not None and group_id.startswith(TOKEN_PREFIX)


def same_lease(row: TaskRow, token: Token) -> bool:
    """Whether `token` is the token of `row`'s current lease (its number, and its random part, compared in
    constant time; a lease taken before tokens had one matches a token without)."""
    if row.leases != token.lease:
        return False
    if row.nonce is None or token.nonce is None:
        return row.nonce is None and token.nonce is None
    return hmac.compare_digest(row.nonce, token.nonce)
