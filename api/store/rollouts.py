"""The open groups' store contract (`OpenGroupTxn`, reached as `txn.rollouts`): groups whose rollouts arrive one
by one (docs/rollouts.md), each slot acknowledged in the transaction that stores it, stored beside the queue so
that a group's seal and its ingest see one store.

The logic (what opening, posting, leasing and sealing do) is written once, in api/rollouts/groups.py and
api/rollouts/txns.py, over these rows; a backend only stores them. Every method costs the rows it names or
returns (indexed by key, deadline and holder expiry), never the groups ever opened.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["DECIDED", "LIVE", "GroupRow", "OpenGroupTxn", "SlotRow"]

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
    """JSON text of api/rollouts/groups.py's `OpenGroup`."""


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One acknowledged rollout of an open group."""

    key: str
    slot: int
    producer: str
    digest: str
    data: str
    """JSON text of the rollout as posted (tokens, masks, logprobs, score...)."""


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
        """Remove these groups' rows and their acknowledged slots."""

    @abstractmethod
    def scan(self, after: str, limit: int) -> list[GroupRow]:
        """Up to `limit` groups in any state whose key sorts after `after`, by key (the export's pages)."""

    @abstractmethod
    def open_totals(self, env_id: int) -> tuple[int, int]:
        """(live groups, their bytes) of env_id."""

    @abstractmethod
    def slots(self, key: str) -> list[SlotRow]:
        """The group's acknowledged slots, by slot."""

    @abstractmethod
    def put_slot(self, row: SlotRow) -> None:
        """Store an acknowledged slot (never replaced: the first acknowledged is kept)."""
