"""What an open group does, as pure functions over its record (docs/rollouts.md): which slots are missing and
may be leased out, what a posted rollout does to a slot, and when and how the group is sealed.

No store and no clock here: api/rollouts/txns.py reads the record, calls these with `now`, and writes back. The
record holds what the group is and what was leased or decided; which slots are in (`done`, slot -> producer) is the
slots' own rows, read where a rule needs it, so that a post writes its slot's row and never the record.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ACCEPTED",
    "CONFLICT",
    "DUPLICATE",
    "REDONE",
    "OpenGroup",
    "Seal",
    "missing",
    "post",
    "seal_decision",
    "settle",
]

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
"""The same content for a slot already acknowledged, from the producer that sent it: its first reply again."""
REDONE = "redone"
"""A slot already acknowledged, sent by another producer (a sibling leased while a slow one came back): the
first acknowledged is kept, this one counted and dropped."""
CONFLICT = "conflict"
"""Other content for a slot its own producer already acknowledged: a 409."""

TOO_FEW = "too_few_by_deadline"
UNSCORED = "unscored_by_deadline"
NOT_DONE = "not_done_by_deadline"


@dataclass(slots=True)
class OpenGroup:
    """An open group's record, stored as JSON text in its row (`api.store.rollouts.GroupRow.record`)."""

    key: str
    env_id: int | None
    group_size: int
    min_group_size: int
    deadline: float
    producer: str
    """The producer that opened it and holds its missing slots while it heartbeats."""
    expires_at: float
    """When the holder's lease on its missing slots lapses unless heartbeated."""
    scores_at_seal: bool = False
    """Scored as a group (a verifier that needs all G): sealed only by its producer, with the scores."""
    task: Any = None
    """What a sibling needs to redo a slot (the prompt, a task lease's task): handed out with the slot's lease."""
    leases: dict[str, list[Any]] = field(default_factory=dict)
    """Slots leased to a sibling producer -> [producer, expires_at]. A post does not rewrite the record, so a leased
    slot may be in since: a lease counts only for a missing slot (`settle` drops the others before a write)."""
    redispatched: int = 0
    left_out: dict[str, str] = field(default_factory=dict)
    """Sealed: slots not in the sealed group -> why. Expired: `group` -> why."""
    scores: dict[str, float] | None = None
    """Scores posted with the seal (scored as a group), by slot."""
    owner: str | None = None
    """The key that opened it (None without keys): only that key's producers post, seal, heartbeat and lease its
    slots (`api.owners`)."""
    lineage: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per slot, its resumes, restarts and (once decided) its turns' producers (api/rollouts/lineage.py)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def of(text: str) -> OpenGroup:
        return OpenGroup(**json.loads(text))


@dataclass(frozen=True, slots=True)
class Seal:
    """A decision about an open group: `slots` sealed into the group (the rest `left_out`, with why), or the
    group expired (`expired`: why), or nothing yet (`wait`)."""

    wait: bool = False
    slots: tuple[int, ...] = ()
    left_out: dict[int, str] = field(default_factory=dict)
    expired: str | None = None


def settle(g: OpenGroup, done: Collection[int]) -> int:
    """Drop the leases of slots acknowledged since they were leased (a post leaves the record as it is); how many."""
    gone = [k for k in g.leases if int(k) in done]
    for k in gone:
        del g.leases[k]
    return len(gone)


def missing(g: OpenGroup, done: Collection[int], now: float) -> list[int]:
    """Slots neither acknowledged nor under a live sibling lease, once the holder lapsed (before: none)."""
    if g.expires_at > now:
        return []
    return [s for s in range(g.group_size) if s not in done and not (str(s) in g.leases and g.leases[str(s)][1] > now)]


def lease_slots(g: OpenGroup, producer: str, slots: list[int], until: float) -> None:
    """Lease these missing slots to a sibling producer until `until` (counted as redispatched)."""
    for s in slots:
        g.leases[str(s)] = [producer, until]
    g.redispatched += len(slots)


def next_check(g: OpenGroup, done: int) -> float:
    """When the group's missing slots should be looked at again: its holder's lapse while a missing slot is leased
    to nobody (it is handed out from then on), else the soonest end of a sibling lease of a missing slot. `done`:
    how many slots are in; `g`'s leases are of missing slots (`settle`)."""
    pending = [float(v[1]) for v in g.leases.values()]
    if len(pending) < g.group_size - done or not pending:
        return g.expires_at
    return max(g.expires_at, min(pending))


def post(producer: str, known: tuple[str, str] | None, digest: str) -> str:
    """What a rollout posted for a slot does, given the slot's acknowledged (producer, digest) if any."""
    if known is None:
        return ACCEPTED
    first, first_digest = known
    if first_digest == digest:
        return DUPLICATE
    return CONFLICT if first == producer else REDONE


def seal_decision(
    g: OpenGroup, in_: Collection[int], now: float, scored: set[int], *, by_producer: bool = False
) -> Seal:
    """Whether to seal now, and with which slots (`in_`: those acknowledged): all G in (and scored, unless the
    producer seals with scores); at the deadline, the slots in if at least `min_group_size` are (and scored), the
    rest left out with why; below that at the deadline, the group expires."""
    done, got = sorted(in_), set(in_)
    if by_producer:
        if len(done) >= g.min_group_size:
            return Seal(slots=tuple(done), left_out={s: NOT_DONE for s in range(g.group_size) if s not in got})
        return Seal(wait=True)
    if len(done) == g.group_size and not g.scores_at_seal and scored >= set(done):
        return Seal(slots=tuple(done))
    if now < g.deadline:
        return Seal(wait=True)
    usable = [s for s in done if s in scored] if not g.scores_at_seal else []
    if len(usable) < g.min_group_size:
        return Seal(expired=UNSCORED if len(done) >= g.min_group_size else TOO_FEW)
    left = {s: NOT_DONE for s in range(g.group_size) if s not in got}
    left.update({s: "unscored" for s in done if s not in scored})
    return Seal(slots=tuple(usable), left_out=left)
