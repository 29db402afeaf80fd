"""A task's states and every move between them (docs/tasks-fates.md), as pure functions over `TaskRow`: the one
place a task's state is written, so the rules below hold wherever a lease, a group's fate or a trainer's
acknowledgement moves a task. api/tasks/leases.py and fates.py find the rows, keep their dataset's record
(api/tasks/records.py; `counted` moves the tallies with each row) and store them; a store keeps each row as a
move left it, and the views read it as stored.

    (new) -lease-> leased -submit-> submitted -serve-> served -acknowledge-> trained
    leased -expire, hand_back-> waiting -lease-> leased
    waiting -submit-> submitted  (a group on a lapsed lease that nothing leased again takes its task back)
    submitted -drop-> dropped, and leased -fail-> failed, or either back to waiting while retries last

`served` is a step's: its group is in batch `step`, which the trainer has not acknowledged yet (commit mode: a
commit past it; next mode: asking for a later batch). The acknowledgement moves it to `trained` in that same step.
A batch served again (a trainer that crashed and asks for it anew) is the same step: nothing moves, so a task is
trained once, in the step it was served in. `trained`, `dropped` and `failed` are final: no move leaves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from api.errors import RollbufError
from api.store import tasks as stored
from api.store.tasks import TaskRow

NEW = ""
"""The state of a row not stored yet: a task of the cursor, leased for the first time in its epoch."""
LEASED = stored.LEASED
"""Held by `producer` until `expires_at` unless heartbeated."""
WAITING = stored.FRONT
"""At the front of its dataset (an expired lease, a task handed back or retried), before the cursor moves on."""
SUBMITTED = "submitted"
"""Its group was acknowledged (`ledger_id`)."""
SERVED = "served"
"""Its group is in batch `step`, not acknowledged by the trainer yet."""
TRAINED = "trained"
"""Its group is in batch `step`, and the trainer acknowledged that batch."""
DROPPED = "dropped"
"""Its group was dropped (`reason`) and no retry is left."""
FAILED = "failed"
"""Its producer failed it (`reason`) and no retry is left."""
STATES = (LEASED, WAITING, SUBMITTED, SERVED, TRAINED, DROPPED, FAILED)
"""Every state a stored row can be in, in the order a task moves through them."""
FINAL = (TRAINED, DROPPED, FAILED)
RUN_TAIL = "run_tail"
"""The drop reason of the groups a trainer of exact batch sizes (`no_exact_fill` "trim" or "wait") leaves out at the
end of its run: fewer than an exact batch, and nothing else can arrive. Their tasks are dropped, never retried
(another try would make the same tail)."""

MOVES: dict[str, frozenset[str]] = {
    "lease": frozenset({NEW, WAITING}),
    "expire": frozenset({LEASED}),
    "hand_back": frozenset({LEASED}),
    "submit": frozenset({LEASED, WAITING}),
    "serve": frozenset({SUBMITTED}),
    "acknowledge": frozenset({SERVED}),
    "drop": frozenset({SUBMITTED}),
    "fail": frozenset({LEASED}),
}
"""Each move and the states it may leave from: the whole state machine."""


class IllegalMove(RollbufError):
    """A move asked of a row in a state it does not leave from: a bug in the caller, which checks `may` where a
    request may find a task moved on already."""

    status_code = 500
    code = "internal"


def may(move: str, row: TaskRow) -> bool:
    """Whether `move` leaves from `row`'s state."""
    return row.state in MOVES[move]


def _from(move: str, row: TaskRow) -> None:
    if not may(move, row):
        raise IllegalMove(f"task {row.dataset}:{row.epoch}:{row.index} is {row.state or 'new'}: it cannot {move}")


def lease(row: TaskRow, *, producer: str, until: float, holder: str | None, nonce: str, now: float) -> TaskRow:
    """Held by `producer` (and the key `holder`) until `until`, under a new lease number and random part."""
    _from("lease", row)
    return replace(
        row,
        state=LEASED,
        leases=row.leases + 1,
        producer=producer,
        expires_at=until,
        updated_at=now,
        holder=holder,
        nonce=nonce,
    )


def expire(row: TaskRow, seq: int) -> TaskRow:
    """Its lease ended without a heartbeat: back at the front, at place `seq` (not a retry)."""
    _from("expire", row)
    return replace(row, state=WAITING, seq=seq, expires_at=None)


def hand_back(row: TaskRow, seq: int, now: float) -> TaskRow:
    """Its producer handed it back untried: back at the front, at place `seq` (not a retry)."""
    _from("hand_back", row)
    return replace(row, state=WAITING, seq=seq, expires_at=None, updated_at=now)


def submit(row: TaskRow, ledger_id: int, now: float) -> TaskRow:
    """Its group was acknowledged under ledger id `ledger_id`."""
    _from("submit", row)
    return replace(row, state=SUBMITTED, ledger_id=ledger_id, updated_at=now, expires_at=None)


def serve(row: TaskRow, step: int, now: float) -> TaskRow:
    """Its group was formed into batch `step`."""
    _from("serve", row)
    return replace(row, state=SERVED, step=step, updated_at=now)


def acknowledge(row: TaskRow, now: float) -> TaskRow:
    """The trainer acknowledged the batch it was served in: trained, in that step."""
    _from("acknowledge", row)
    return replace(row, state=TRAINED, updated_at=now)


def retried(row: TaskRow, reason: str, max_retries: int) -> bool:
    """Whether a task dropped or failed for `reason` is offered again: while it was retried fewer than
    `max_retries` times (the dataset's), and never one left out as the run's tail."""
    return row.retries < max_retries and reason != RUN_TAIL


def drop(row: TaskRow, reason: str, step: int | None, now: float, *, max_retries: int, seq: int) -> TaskRow:
    """Its group was dropped for `reason` at step `step`: back at the front at place `seq` while its retries last
    (`retried`), else dropped."""
    _from("drop", row)
    return _ended(row, DROPPED, reason, step, now, max_retries, seq)


def fail(row: TaskRow, reason: str, now: float, *, max_retries: int, seq: int) -> TaskRow:
    """Its producer failed it for `reason`: back at the front at place `seq` while its retries last, else failed."""
    _from("fail", row)
    return _ended(row, FAILED, reason, None, now, max_retries, seq)


def _ended(row: TaskRow, fate: str, reason: str, step: int | None, now: float, max_retries: int, seq: int) -> TaskRow:
    if retried(row, reason, max_retries):
        return replace(
            row,
            state=WAITING,
            retries=row.retries + 1,
            reason=f"{fate}: {reason}",
            step=step,
            updated_at=now,
            seq=seq,
            expires_at=None,
        )
    return replace(row, state=fate, reason=reason, step=step, updated_at=now, expires_at=None)


def counted(counts: Mapping[str, int], before: str, after: str) -> dict[str, int]:
    """A dataset's tallies (`counts`: tasks per state, and events) after one of its rows moved from `before` to
    `after` (`NEW`: a row stored for the first time)."""
    out = dict(counts)
    if before != after:
        if before != NEW:
            out[before] = out.get(before, 0) - 1
        out[after] = out.get(after, 0) + 1
    return out
