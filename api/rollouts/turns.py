"""A slot's turns (docs/rollouts.md, Turns), as pure functions: what one turn stores, who may post a slot's turns,
what a turn posted again or out of order is, and the rollout its turns and a final post make together.

No store and no clock: api/rollouts/txns.py reads the slot's turns, calls these, and writes the turn's row. A turn
is stored as JSON (`TurnData.encode`): it is read back only by a lease, a view of the slot's turns and the final
post that concatenates them, never by the seal (the slot's row holds the whole rollout by then).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from api.errors import InvalidData
from api.rollouts import groups as rg
from api.store.rollouts import turn_shape

__all__ = ["ACCEPTED", "DUPLICATE", "Joined", "TurnData", "concatenate", "holder", "joined_fields", "outcome"]

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
"""The same turn again (a retry whose reply was lost): its first acknowledgement stands."""
CONFLICT = "conflict"
"""Another content for a turn already acknowledged: a 409."""
GAP = "gap"
"""A turn past the slot's next one: a 409 naming the next."""


@dataclass(frozen=True, slots=True)
class TurnData:
    """What one turn stores: the tokens it appends to its slot's rollout, one mask (and logprob, and weights version,
    if sent) per token, its tools' results and the env's state after it."""

    tokens: list[int]
    masks: list[int]
    inference_logprobs: list[float] | None = None
    token_weight_versions: list[int] | None = None
    tool_results: list[Any] | None = None
    snapshot: dict[str, str] | None = None
    """`{"data": base64}` or `{"uri": ...}`: opaque to rollbuf."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> TurnData:
        return TurnData(**json.loads(bytes(data)))

    def digest(self) -> str:
        """Of its content (what decides `duplicate` against another content): not of who posted it."""
        return hashlib.sha256(self.encode()).hexdigest()


def holder(g: rg.OpenGroup, slot: int) -> str:
    """The producer whose turns the slot takes: the sibling it is leased to, else the group's opener (while no
    sibling holds it, the opener may come back to it). A producer the slot's lease passed from is stale."""
    lease = g.leases.get(str(slot))
    return g.producer if lease is None else str(lease[0])


def outcome(turns: int, stored: str | None, turn: int, digest: str) -> str:
    """What turn `turn` with this digest is to a slot with `turns` acknowledged turns, `stored` the digest of its
    turn `turn` if acknowledged: `ACCEPTED` (the next one), `DUPLICATE` (the same as acknowledged), `CONFLICT`
    (another content for an acknowledged turn) or `GAP` (past the next one)."""
    if turn < turns:
        return DUPLICATE if stored == digest else CONFLICT
    return ACCEPTED if turn == turns else GAP


OPTIONAL = ((2, "inference_logprobs"), (4, "token_weight_versions"))
"""The optional per-token fields, as `TurnSummary.fields` has them (api/store/rollouts.py `turn_shape`)."""


def joined_fields(fields: int, turn: TurnData) -> int:
    """The optional fields of a slot's turns with this one, `fields` those of the turns before it: a turn without
    tokens has no say; one that sends another set than the turns before with tokens is a 422 naming the field
    (as `concatenate` refuses it: the sealed rollout has each on every token or none)."""
    shape = turn_shape(len(turn.tokens), turn.inference_logprobs is not None, turn.token_weight_versions is not None)
    if not shape or not fields:
        return fields or shape
    for bit, name in OPTIONAL:
        if (shape ^ fields) & bit:
            raise InvalidData(("body", name), "every turn of a slot (and its final post) sends them, or none does")
    return fields


@dataclass(frozen=True, slots=True)
class Joined:
    """A rollout made of pieces (turns, then a final post's tail): each per-token field concatenated."""

    tokens: list[int]
    masks: list[int]
    inference_logprobs: list[float] | None
    token_weight_versions: list[int] | None


def concatenate(pieces: Sequence[TurnData]) -> Joined:
    """The pieces' fields end to end. A field optional per token (logprobs, versions) is the concatenation where
    every piece with tokens sent it, None where none did; a piece without tokens has no say. Some but not all: a
    422 naming the field (`body.inference_logprobs`), since the sealed rollout must have it on every token or none."""
    tokens = [t for p in pieces for t in p.tokens]
    masks = [m for p in pieces for m in p.masks]
    return Joined(tokens, masks, _optional(pieces, "inference_logprobs"), _optional(pieces, "token_weight_versions"))


def _optional(pieces: Sequence[TurnData], name: str) -> Any:
    rows = [getattr(p, name) for p in pieces if p.tokens]
    sent = [r is not None for r in rows]
    if not any(sent):
        return None
    if not all(sent):
        raise InvalidData(("body", name), "every turn of a slot (and its final post) sends them, or none does")
    return [x for r in rows for x in r]
