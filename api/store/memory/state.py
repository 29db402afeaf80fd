"""What the memory store holds (`State`), and the undo log a transaction replays if its function raises."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from api.store.base import HeldGroup, LedgerGroup, LedgerStep, QueueCounts, QueuedItem
from api.store.memory.rollouts import OpenGroupState
from api.store.memory.tasks import TaskState


class State:
    """Everything the store holds, shared by its transactions (one at a time: they never await)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.queues: dict[int, deque[QueuedItem]] = {}
        self.counts: dict[int, QueueCounts] = {}
        self.held: dict[int, dict[int, HeldGroup]] = {}
        """Side buffers: held groups by env, then by item id (oldest first)."""
        self.held_counts: dict[int, QueueCounts] = {}
        self.replies: dict[str, str] = {}
        self.envs: dict[int, tuple[str, int, str]] = {}
        """(name, version, record) by env id."""
        self.counters: dict[str, dict[str, int]] = {}
        self.batches: dict[int, tuple[bytes, list[int]]] = {}
        self.kept: dict[int, bytes] = {}
        """Payloads of popped items that a kept batch refers to, by item id."""
        self.retained: dict[int, bytes] = {}
        """Retained payloads of served and dropped groups, by ledger id."""
        self.ledger: dict[int, LedgerGroup] = {}
        self.named: dict[str, int | frozenset[int]] = {}
        """Ledger ids by group id (`ledger.named` costs the rows it finds): one id as itself, more as a set."""
        self.order: list[int] = []
        """Ledger ids, ascending, including some no longer in the ledger (skipped, compacted by pruning): pages
        and prunes cost what they walk, not the ledger."""
        self.kept_ids: dict[int, None] = {}
        """Ledger ids whose payload is retained."""
        self.steps: dict[int, LedgerStep] = {}
        """Step rows, in the order they were formed."""
        self.dropped: dict[int, frozenset[int]] = {}
        """Ledger ids of dropped groups by their `step` (`ledger.dropped` costs the rows it finds)."""
        self.next_id = 1
        self.tasks = TaskState()
        self.rollouts = OpenGroupState()


class Undo:
    """A transaction's undo log: its writes apply directly, and are undone backwards if it fails."""

    def __init__(self) -> None:
        self._log: list[Callable[[], None]] = []

    def append(self, undo: Callable[[], None]) -> None:
        self._log.append(undo)

    def restore(self, mapping: dict[Any, Any], key: object) -> None:
        """Record `mapping[key]` as it is now (or its absence), to be put back."""
        if key in mapping:
            old = mapping[key]
            self._log.append(lambda: mapping.__setitem__(key, old))
        else:
            self._log.append(lambda: mapping.pop(key, None))

    def rollback(self) -> None:
        for undo in reversed(self._log):
            undo()
        self._log.clear()
