"""The ledger as one recorder: the transactions that decide a group's fate (`api/ingest/submit.py`,
`api/batches/formation.py`, `api/batches/acknowledge.py`) say what they decided, and the recorder writes it, so
they hold no ledger conditionals.

Three twins, picked from the settings by `recorder`: `Recorder` (the ledger off) keeps only the drop counters
every run keeps; `Ledger` also writes the ledger's rows; `Retaining` also keeps the payloads of served and
dropped groups (retention). Every ledger or retained-payload write of a decision goes through here: a change
to `Txn`'s ledger methods is a change to this module only (docs/ledger.md). With the ledger on, a group sent
under a task's lease moves its task's fate with it (`api.tasks.fates`, docs/tasks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from api.ledger import rules as ledger
from api.run import state
from api.store.base import DROPPED, SERVED, LedgerGroup, LedgerStep, Txn
from api.tasks import fates as task_fates

if TYPE_CHECKING:  # the ledger records what ingest submits; ingest sits above it (api/layers.py)
    from api.ingest.submissions import Submission


class Arrivals:
    """One ingest transaction's new groups, the ledger off: a group dropped by the filters is counted."""

    __slots__ = ("txn",)

    def __init__(self, txn: Txn) -> None:
        self.txn = txn

    def dropped(self, env_id: int, env_name: str, sub: Submission, reason: str, step: int) -> None:
        """A group the filters dropped as it arrived (at step `step`)."""
        state.count_dropped(self.txn, env_name, reason)

    def stored(self, item_id: int, env_id: int, sub: Submission, fate: str) -> None:
        """A group queued or held aside under `item_id`."""

    def flush(self) -> None:
        """Write the rows gathered so far: a group released from a side buffer moves its row (`requeued`)."""

    def close(self) -> None:
        """Write what is left, once every group is stored."""


class LedgerArrivals(Arrivals):
    """The ledger on: each new group's row, written together (one write for a request's list)."""

    __slots__ = ("handler", "now", "retain", "rows", "retained", "retained_bytes")

    def __init__(self, txn: Txn, handler: str | None, now: float, retain: bool) -> None:
        super().__init__(txn)
        self.handler = handler
        self.now = now
        self.retain = retain
        self.rows: list[LedgerGroup] = []
        self.retained = 0
        self.retained_bytes = 0

    def dropped(self, env_id: int, env_name: str, sub: Submission, reason: str, step: int) -> None:
        super().dropped(env_id, env_name, sub, reason, step)
        row = self._row(self.txn.next_item_id(), env_id, sub, DROPPED)
        self.rows.append(replace(row, step=step, reason=reason, decided_at=self.now, kept=self.retain))
        if self.retain:  # what keeping dropped groups costs: a payload written that is never queued
            self.txn.ledger.keep_payloads([(row.id, sub.payload)])
            self.retained += 1
            self.retained_bytes += len(sub.payload)

    def stored(self, item_id: int, env_id: int, sub: Submission, fate: str) -> None:
        self.rows.append(self._row(item_id, env_id, sub, fate))

    def flush(self) -> None:
        if self.rows:
            self.txn.ledger.add(self.rows)
            task_fates.on_acknowledged(self.txn, self.rows)  # groups sent under a task's lease: submitted
            self.rows = []

    def close(self) -> None:
        self.flush()
        ledger.count_retained(self.txn, self.retained, self.retained_bytes)

    def _row(self, item_id: int, env_id: int, sub: Submission, fate: str) -> LedgerGroup:
        size = len(sub.payload)
        return ledger.group_row(item_id, env_id, sub.record, size, self.handler, fate, self.now, sub.resumes)


class Recorder:
    """The ledger off: a decision leaves only the drop counters (`state.count_dropped`), which every run keeps."""

    __slots__ = ()

    retain = False
    """Whether the payloads of served and dropped groups stay as retained payloads (`Txn.pop`'s `retain`)."""

    def arrivals(self, txn: Txn, handler: str | None, now: float) -> Arrivals:
        """What records one ingest transaction's new groups (`handler`: the key that sent them)."""
        return Arrivals(txn)

    def dropped(
        self,
        txn: Txn,
        env_name: str,
        reason: str,
        ids: Sequence[int],
        payloads: Sequence[bytes],
        *,
        step: int,
        at: float,
        popped: bool = False,
    ) -> None:
        """Stored groups (`ids`, their `payloads`) dropped for `reason` at step `step`. `popped`: they left the
        queue by `Txn.pop` with `retain=self.retain`, which kept their payloads already."""
        state.count_dropped(txn, env_name, reason, len(ids))
        self._decided(txn, ids, DROPPED, reason, step, at, self.retain)
        self._retained(txn, ids, payloads, popped)

    def lost(self, txn: Txn, env_name: str, reason: str, ids: Sequence[int], *, step: int, at: float) -> None:
        """Queued groups whose payloads the store lost (`Txn.drop_lost` removed them): dropped for `reason`,
        nothing of them retained."""
        state.count_dropped(txn, env_name, reason, len(ids))
        self._decided(txn, ids, DROPPED, reason, step, at, False)

    def expired_open(self, txn: Txn, env_name: str, row: LedgerGroup) -> None:
        """An open group (docs/rollouts.md) expired before its seal: its acknowledged rollouts were never queued,
        so `row` (fate dropped, its reason) is both its first row and its last; its payload is never retained."""
        state.count_dropped(txn, env_name, row.reason or "dropped")

    def served(self, txn: Txn, row: LedgerStep, payloads: Sequence[bytes]) -> None:
        """A batch formed (`row`: the ledger's row of it) of groups popped with `retain`, whose `payloads`."""

    def committed(self, txn: Txn, first: int, before: int, at: float) -> None:
        """The kept batches of the steps in [first, before) acknowledged at `at` (freed)."""

    def trained(self, txn: Txn, first: int, before: int, at: float) -> None:
        """The committed mark moved from `first` to `before` at `at`: the trainer acknowledged those steps, kept or
        not (next mode without `?step=` keeps none)."""

    def requeued(self, txn: Txn, old_id: int, new_id: int) -> None:
        """A side-buffered group released into the queue under a new id."""

    def _decided(
        self, txn: Txn, ids: Sequence[int], fate: str, reason: str | None, step: int, at: float, kept: bool
    ) -> None:
        """The ledger's share of a decision on stored groups (`kept`: their payloads retained): none."""

    def _retained(self, txn: Txn, ids: Sequence[int], payloads: Sequence[bytes], popped: bool) -> None:
        """Retention's share of a decision: none."""


class Ledger(Recorder):
    """The ledger on: each decision's rows, in the transaction that makes it."""

    __slots__ = ()

    def arrivals(self, txn: Txn, handler: str | None, now: float) -> Arrivals:
        return LedgerArrivals(txn, handler, now, self.retain)

    def expired_open(self, txn: Txn, env_name: str, row: LedgerGroup) -> None:
        super().expired_open(txn, env_name, row)
        txn.ledger.add([row])
        task_fates.on_acknowledged(txn, [row])  # under a task's lease: its task is retried or dropped, with why

    def served(self, txn: Txn, row: LedgerStep, payloads: Sequence[bytes]) -> None:
        self._decided(txn, row.group_ids, SERVED, None, row.step, row.formed_at, self.retain)
        txn.ledger.put_step(row)
        self._retained(txn, row.group_ids, payloads, popped=True)

    def committed(self, txn: Txn, first: int, before: int, at: float) -> None:
        txn.ledger.committed(first, before, at)

    def trained(self, txn: Txn, first: int, before: int, at: float) -> None:
        task_fates.on_trained(txn, first, before, at)  # their served tasks are trained

    def requeued(self, txn: Txn, old_id: int, new_id: int) -> None:
        txn.ledger.requeue(old_id, new_id)
        task_fates.on_requeued(txn, old_id, new_id)

    def _decided(
        self, txn: Txn, ids: Sequence[int], fate: str, reason: str | None, step: int, at: float, kept: bool
    ) -> None:
        txn.ledger.decide(ids, fate, step=step, reason=reason, at=at, kept=kept)
        task_fates.on_decided(txn, ids, fate, step=step, reason=reason, now=at)  # their tasks follow


class Retaining(Ledger):
    """The ledger on, with retention: the payloads of served and dropped groups stay, counted against the byte
    budget, until pruning lets them go (`ledger.prune_txn`)."""

    __slots__ = ()

    retain = True

    def _retained(self, txn: Txn, ids: Sequence[int], payloads: Sequence[bytes], popped: bool) -> None:
        if not popped:  # released from a side buffer: the store let them go, so they are kept here
            txn.ledger.keep_payloads(list(zip(ids, payloads, strict=True)))
        ledger.count_retained(txn, len(payloads), sum(len(p) for p in payloads))


OFF = Recorder()
LEDGER = Ledger()
RETAINING = Retaining()


def recorder(books: ledger.LedgerSettings) -> Recorder:
    """The recorder the settings ask for."""
    if books.retaining:
        return RETAINING
    return LEDGER if books.enabled else OFF
