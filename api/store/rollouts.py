"""The open groups' store contract (`OpenGroupTxn`, reached as `txn.rollouts`): groups whose rollouts arrive one
by one (docs/rollouts.md), each slot acknowledged in the transaction that stores it, stored beside the queue so
that a group's seal and its ingest see one store.

The logic (what opening, posting, leasing and sealing do) is written once, in api/rollouts/groups.py and
api/rollouts/txns.py, over these rows; a backend only stores them. Every method costs the rows it names or
returns (indexed by key, deadline and holder expiry), never the groups ever opened.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from api.wire.records import F64, I32, GroupRecord, encode, narrowest

__all__ = [
    "DECIDED",
    "LIVE",
    "GroupRow",
    "OpenGroupTxn",
    "SlotRow",
    "TurnKey",
    "TurnRow",
    "TurnSummary",
    "lean_record",
    "packed_slot",
    "turn_counts",
    "turn_shape",
]

LIVE = ("open", "sealing")
"""States of a group still waiting for its seal to finish."""
DECIDED = ("sealed", "expired")
"""States of a group decided: kept `rollout_keep_s` after its decision, then pruned (`decided`, `delete`)."""


@dataclass(frozen=True, slots=True)
class GroupRow:
    """One group opened for per-rollout submission."""

    key: str
    """The group's id (the `group_id` its sealed group is ingested under)."""
    env_id: int
    state: str
    """`open`, `sealing` (its slots are chosen, its ingest under way), `sealed` or `expired`."""
    deadline: float
    expires_at: float
    """When its holder (or the earliest sibling lease) lapses unless heartbeated: its missing slots are leased out.
    A decided group's: when it was decided (its retention counts from it)."""
    bytes: int
    """What its acknowledged slots hold (the per-env bound on open bytes)."""
    record: str
    """JSON text of api/rollouts/groups.py's `OpenGroup`: what the group is and what was leased or decided, never
    what each slot holds (that is the slots' rows), so that a post never rewrites it."""
    done: int = 0
    """Acknowledged slots: moved by `add_slot` with the slot's row, so that the post that completes the group knows
    it without reading the others."""
    tokens: int = 0
    """Tokens of its acknowledged slots (the trainer's token budget per group), moved by `add_slot` alike."""
    turn_tokens: int = 0
    """Tokens of the acknowledged turns of its slots not acknowledged whole: moved up by `add_turn`, down by
    `add_slot` (the slot's whole rollout counts in `tokens` then), to 0 by `drop_turns`. With `tokens`, what the
    group's acknowledged content holds: what the trainer's token budget counts when a turn is acknowledged, so
    that whatever was acknowledged can always be completed."""


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One acknowledged rollout of an open group."""

    key: str
    slot: int
    producer: str
    digest: str
    data: bytes
    """The rollout as the one sequence of a group record (api/wire/records.py `encode`: its tokens, masks, logprobs
    and `overrides` as checked when it was acknowledged), so that the seal concatenates the slots' arrays without
    parsing any rollout again."""
    tokens: int
    score: float | None
    """As posted (None: scored at the seal)."""
    policy_step: int | None
    """As posted (None: not sent)."""


@dataclass(frozen=True, slots=True)
class TurnRow:
    """One acknowledged turn of a slot not yet acknowledged whole (docs/rollouts.md, Turns): what a producer that
    takes the slot's lease continues from."""

    key: str
    slot: int
    turn: int
    """0, 1, ...: a slot's turns are acknowledged in order, with no gap."""
    producer: str
    digest: str
    """Of its content: the same turn again is a duplicate, other content a conflict."""
    data: bytes
    """The turn as JSON (api/rollouts/turns.py `TurnData`: tokens, masks, logprobs, versions, tool results, snapshot),
    checked when it was acknowledged."""
    bytes: int
    """What it holds (`len(data)`): the bounds on turn bytes count it."""
    tokens: int
    """The tokens it appends to its slot's rollout: what its slot's and group's counters move by, and where the
    lineage of the slot's rollout says each turn's tokens start and end."""


@dataclass(frozen=True, slots=True)
class TurnKey:
    """A turn's row without its data: what the views, the lineage and the freeing of a group's turns read."""

    slot: int
    turn: int
    producer: str
    bytes: int
    tokens: int


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """A slot's acknowledged turns, counted as they are added (`add_turn`): what a turn post reads instead of the
    slot's turns, so that turn 1,000 costs what turn 1 does."""

    turns: int
    """How many (the next turn's number)."""
    tokens: int
    bytes: int
    fields: int
    """Which optional per-token fields its turns with tokens send (`turn_shape`); 0 while none had tokens."""


def turn_shape(tokens: int, logprobs: bool, versions: bool) -> int:
    """A turn's optional per-token fields as `TurnSummary.fields` keeps them: 0 for a turn without tokens (it has
    no say), else 1, plus 2 with logprobs, plus 4 with weights versions."""
    return 0 if tokens == 0 else 1 | (2 if logprobs else 0) | (4 if versions else 0)


class OpenGroupTxn(ABC):
    """Synchronous view of the open groups inside the enclosing store transaction (same atomicity)."""

    @abstractmethod
    def get(self, key: str) -> GroupRow | None: ...

    @abstractmethod
    def put(self, row: GroupRow) -> None:
        """Insert, or replace the row of the same key."""

    @abstractmethod
    def due(self, now: float, limit: int) -> list[GroupRow]:
        """Up to `limit` live groups to seal now: deadline passed, or `sealing` (an interrupted seal)."""

    @abstractmethod
    def lapsed(self, now: float, limit: int, envs: Collection[int] | None = None) -> list[GroupRow]:
        """Up to `limit` open groups whose `expires_at` passed, soonest first (of these envs only, if given)."""

    @abstractmethod
    def lapsed_since(self, after: tuple[float, str], now: float, limit: int) -> list[GroupRow]:
        """Up to `limit` open groups whose (`expires_at`, key) is past `after` and whose `expires_at` is at most
        `now`, in that order: the sweep's walk over what lapsed since it last looked (indexed by lapse)."""

    @abstractmethod
    def decided(self, before: float, limit: int) -> list[str]:
        """Keys of up to `limit` sealed or expired groups decided at or before `before` (what retention prunes).
        Costs at most the live groups and `limit` decided ones (memory, SQLite: the decided ones are walked in the
        order they were decided); PostgreSQL scans the table, which retention bounds."""

    @abstractmethod
    def delete(self, keys: Collection[str]) -> None:
        """Remove these groups' rows, their acknowledged slots and turns."""

    @abstractmethod
    def scan(self, after: str, limit: int) -> list[GroupRow]:
        """Up to `limit` groups in any state whose key sorts after `after`, by key (the export's pages)."""

    @abstractmethod
    def open_totals(self, env_id: int) -> tuple[int, int]:
        """(live groups, their bytes) of env_id."""

    @abstractmethod
    def slots(self, key: str) -> list[SlotRow]:
        """The group's acknowledged slots, by slot (what its seal or expiry reads)."""

    @abstractmethod
    def slot(self, key: str, slot: int) -> SlotRow | None:
        """One acknowledged slot, by its key: what a post compares itself with."""

    @abstractmethod
    def done(self, key: str) -> dict[int, str]:
        """The group's acknowledged slots -> the producer that sent each, without their data (the views, leases)."""

    @abstractmethod
    def add_slot(self, row: SlotRow, size: int) -> None:
        """Store a slot not yet acknowledged, and move its group's `done`, `tokens` and `bytes` (by `size`), and its
        `turn_tokens` down by the slot's turns' tokens (its whole rollout counts in `tokens` now): the group's
        record is not rewritten, and no other slot is read."""

    @abstractmethod
    def turns(self, key: str, slot: int) -> list[TurnRow]:
        """The slot's acknowledged turns, by turn (what a lease carries, what a final post after its turns
        concatenates)."""

    @abstractmethod
    def turn_keys(self, key: str) -> list[TurnKey]:
        """The group's turns without their data, by slot and turn (the views; what freeing them releases)."""

    @abstractmethod
    def turn(self, key: str, slot: int, turn: int) -> TurnRow | None:
        """One acknowledged turn: what a turn posted again compares itself with."""

    @abstractmethod
    def turn_summary(self, key: str, slot: int) -> TurnSummary | None:
        """The slot's acknowledged turns counted (None: none), one row whatever their number."""

    @abstractmethod
    def add_turn(self, row: TurnRow, fields: int) -> None:
        """Store a turn not yet acknowledged (its slot's turns before it are in): its slot's summary counts it, with
        `fields` its turns' fields now, and its group's `turn_tokens` move by its tokens."""

    @abstractmethod
    def drop_turns(self, key: str) -> None:
        """Remove the group's turns and their summaries, its `turn_tokens` to 0 (its decision: the slots it keeps
        hold whole rollouts)."""


# ------------------------------------------------------------------ what earlier layouts stored, as this one does


def packed_slot(text: str) -> tuple[bytes, int, float | None, int | None]:
    """A slot's `data` as layouts before SQLite 13 and PostgreSQL 11 stored it (the post's JSON: tokens, masks,
    inference_logprobs, score, policy_step, overrides, checked when it was acknowledged) as this one stores it:
    (its record, tokens, score, policy_step). The schema steps that bring those layouts here convert with it."""
    r: dict[str, Any] = json.loads(text)
    tokens = np.asarray(r["tokens"], dtype=np.int64)
    floats = {}
    if r.get("inference_logprobs") is not None:
        floats["inference_logprobs"] = narrowest(np.asarray(r["inference_logprobs"], dtype=F64))
    rec = GroupRecord(
        env_id=None,
        lengths=np.array([tokens.shape[0]], dtype=I32),
        tokens=tokens.astype(I32),
        masks=np.asarray(r["masks"], dtype=np.int64).astype(I32),
        scores=np.array([0.0 if r.get("score") is None else r["score"]], dtype=F64),
        policy_step=0 if r.get("policy_step") is None else int(r["policy_step"]),
        floats=floats,
        meta={} if r.get("overrides") is None else {"overrides": [r["overrides"]]},
    )
    score = r.get("score")
    return encode(rec), int(tokens.shape[0]), None if score is None else float(score), r.get("policy_step")


def lean_record(text: str) -> str:
    """A group's record as earlier layouts stored it (with `done`, slot -> producer, and `tokens`) as this one does:
    those are the slots' rows and the group's counters now."""
    record: dict[str, Any] = json.loads(text)
    done = record.pop("done", {})
    record.pop("tokens", None)
    record["leases"] = {k: v for k, v in record.get("leases", {}).items() if k not in done}
    return json.dumps(record, separators=(",", ":"))


def turn_counts(data: bytes) -> tuple[int, int]:
    """A turn's stored JSON (api/rollouts/turns.py `TurnData`) as the layouts with turn summaries count it: (its
    tokens, its `turn_shape`). The schema steps that add the summaries count the turns stored before with it."""
    r: dict[str, Any] = json.loads(bytes(data))
    n = len(r["tokens"])
    return n, turn_shape(n, r.get("inference_logprobs") is not None, r.get("token_weight_versions") is not None)
