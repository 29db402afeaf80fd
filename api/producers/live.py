"""Producers seen live, and the weights they follow: pure logic over plain records (no I/O).

Every producer (a `RolloutRunner`) heartbeats with what it does: its envs, in flight, groups/s, failures, the
weights step it generates with, what holds it back. The table of them is kept bounded (`max_producers`, and
`max_producers_per_key` per key; the longest-gone is forgotten first) and judged against the clock: a producer
not heard of for `gone_after` s is gone. From it, `stall_reason` says when a waiting trainer can get nothing: no
live producer for the envs it needs, or every live one held back waiting for the trainer. Envs fed by a handler
that never heartbeats (an Atropos handler, a hand-written loop) are never judged: something unknown may still
send.

A producer's "held back" is judged where the trainer stood when the producer judged it (`Producer.judged_now`): a
verdict from before the trainer's last batch or weights announcement may no longer hold (the producer starts
groups again at its next status read), so it counts only once a heartbeat carries one judged since. The
trainer's no-progress clock (`trainer_client`'s `NoProgress`) then starts on fresh evidence, not on a flag the
trainer's own step already made stale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

NOTHING_YET = "no environment is registered and no producer has reported"
"""The start of `stall_reason` for a run nothing has joined yet: a stall only once that has lasted `gone_after`
(producers wait for the trainer's first poll to register, so a fresh run always starts this way)."""
NOT_WAITING_ON_TRAINER = frozenset({"queue_full"})
"""Hold-back reasons that are not a wait for the trainer: a full queue means data is there to form batches."""


@dataclass(slots=True)
class Producer:
    """One producer as its last heartbeat described it; `last_seen` and `first_seen` are Unix times."""

    producer_id: str
    host: str
    env_ids: list[int]
    last_seen: float
    first_seen: float
    in_flight: int = 0
    groups_per_s: float = 0.0
    accepted: int = 0
    failures: int = 0
    weights_step: int | None = None
    held: dict[str, str] = field(default_factory=dict)
    """Env name -> why the producer does not start groups of it now (ahead_of_trainer, queue_full, ...)."""
    waiting_for: str | None = None
    """What the producer says it waits for, in words, or None."""
    drains: bool = False
    """It produces for a drain env (`on_new_weights="drain"`): a pending weight sync waits for it."""
    drained_for: int | None = None
    """The pending sync's step it has drained for (its drain envs idle), or None."""
    owner: str | None = None
    """The key that heartbeats under this id (None without keys): another key's heartbeat under it is refused
    while it is live (`api.owners`)."""
    judged_step: int | None = None
    """The trainer step its `held` verdicts were judged at: the run's step when the heartbeat was recorded, or the
    step the producer says it judged at (its last /status-env read), whichever is lower. None: not known (a record
    of an earlier release), never taken as current."""
    judged_weights: int | None = None
    """The weights step announced when the heartbeat was recorded (None: none announced yet)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Producer:
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def live(self, now: float, gone_after: float) -> bool:
        return now - self.last_seen <= gone_after

    def judged_now(self, step: int, weights: int | None) -> bool:
        """Whether its `held` verdicts were judged where the trainer stands now: at its current `step`, with no
        weights announced since (`weights`), and generating with the weights announced or newer (else it has not
        read the announcement yet). A verdict from before the trainer moved may no longer hold: ahead_of_trainer
        is judged against the trainer's step and the weights, and a drain ends with the announcement."""
        if self.judged_step is None or self.judged_step < step or self.judged_weights != weights:
            return False
        return weights is None or self.weights_step is None or self.weights_step >= weights


class TooManyProducers(Exception):
    """The table is full of live producers: a new one is refused until one goes."""


class ProducerTaken(Exception):
    """A live producer of another key heartbeats under this id."""


def record(
    table: dict[str, Producer],
    beat: Producer,
    now: float,
    gone_after: float,
    max_producers: int,
    may: Callable[[str | None], bool] = lambda owner: True,
    max_per_key: int | None = None,
) -> list[str]:
    """Take in one heartbeat (in place); the ids of the producers forgotten to make room. A new producer of a key
    that has `max_per_key` (a server with keys; `beat.owner` set) forgets that key's longest-gone one, and one in a
    full table the longest-gone of all; with every candidate live, `TooManyProducers`. `may(owner)`: whether the
    beat's key may act on a record of `owner`'s: a live producer's id is its owner's (`ProducerTaken`); a gone
    one's, or one recorded before owners were (no owner), is taken over."""
    old = table.get(beat.producer_id)
    if old is not None and old.owner is not None and old.live(now, gone_after) and not may(old.owner):
        raise ProducerTaken(f"producer id {beat.producer_id!r} is a live producer of another key: choose another id")
    if old is not None:
        beat.first_seen = old.first_seen
        table[beat.producer_id] = beat
        return []
    forgotten = []
    if beat.owner is not None and max_per_key is not None:
        mine = [p for p in table.values() if p.owner == beat.owner]
        if len(mine) >= max_per_key:
            forgotten.append(
                _forget(table, mine, now, gone_after, "of this key, the most one key may (max_producers_per_key)")
            )
    if len(table) >= max_producers:
        forgotten.append(
            _forget(table, list(table.values()), now, gone_after, "the most the server keeps (max_producers)")
        )
    table[beat.producer_id] = beat
    return forgotten


def _forget(table: dict[str, Producer], among: list[Producer], now: float, gone_after: float, bound: str) -> str:
    """Forget the longest-gone producer of `among` (its id), or `TooManyProducers` if each one is live."""
    gone = [p for p in among if not p.live(now, gone_after)]
    if not gone:
        raise TooManyProducers(f"{len(among)} live producers, {bound}")
    oldest = min(gone, key=lambda p: p.last_seen)
    del table[oldest.producer_id]
    return oldest.producer_id


def _ago(now: float, then: float) -> str:
    return f"{max(0.0, now - then):.0f} s ago"


def stall_reason(
    connected: dict[int, str],
    table: dict[str, Producer],
    now: float,
    gone_after: float,
    *,
    step: int,
    weights: int | None,
) -> str | None:
    """Why nothing can arrive for a waiting trainer, or None when something may. `connected`: the connected
    envs, id -> name; `step` and `weights`: where the trainer stands (its current step, the weights announced
    last). A producer held back counts as waiting for the trainer only on a verdict judged there
    (`Producer.judged_now`): one from before the trainer moved is no evidence of a stall."""
    live = [p for p in table.values() if p.live(now, gone_after)]
    if not connected:
        if live:
            return None  # a live producer between registrations (re-registering after a reset)
        if not table:
            return f"{NOTHING_YET}: start a producer (docs/bring-your-environment.md)"
        last = max(table.values(), key=lambda p: p.last_seen)
        return (
            f"no environment is connected and no producer is live: the last, {last.producer_id} on "
            f"{last.host}, was last seen {_ago(now, last.last_seen)} (gone after {gone_after:g} s)"
        )
    watched = {e for p in table.values() for e in p.env_ids}
    if any(env_id not in watched for env_id in connected):
        return None  # a handler that does not heartbeat may send
    feeding = {e for p in live for e in p.env_ids if e in connected}
    if not feeding:
        names = ", ".join(sorted(connected.values()))
        last = max((p for p in table.values() if set(p.env_ids) & set(connected)), key=lambda p: p.last_seen)
        return (
            f"no live producer for env(s) {names}: the last, {last.producer_id} on {last.host}, was last "
            f"seen {_ago(now, last.last_seen)} (producers are gone after {gone_after:g} s without a "
            "heartbeat)"
        )
    held: list[str] = []
    for p in live:
        for env_id in p.env_ids:
            if env_id not in connected:
                continue
            why = p.held.get(connected[env_id])
            if why is None or why in NOT_WAITING_ON_TRAINER or not p.judged_now(step, weights):
                return None  # this producer may start a group of a needed env (or may, since the trainer moved)
            held.append(f"{p.producer_id} on {p.host}: {connected[env_id]} held back ({why})")
    generating = sorted({p.weights_step for p in live if p.weights_step is not None})
    detail = "; ".join(held[:5]) + (f"; and {len(held) - 5} more" if len(held) > 5 else "")
    hint = ""
    if any("ahead_of_trainer" in h for h in held):
        hint = (
            f" (they generate with weights step {', '.join(map(str, generating))}"
            " or older: announce new weights with POST /weights, or raise max_staleness)"
        )
    return f"every live producer is held back waiting for the trainer: {detail}{hint}"


def undrained(table: dict[str, Producer], pending: int, now: float, gone_after: float) -> list[Producer]:
    """The live producers a weight sync to `pending` still waits for: those of drain envs that have not reported
    drained for it (or a later sync). A gone producer is not waited for: it samples nothing."""
    return sorted(
        (
            p
            for p in table.values()
            if p.drains and p.live(now, gone_after) and (p.drained_for is None or p.drained_for < pending)
        ),
        key=lambda p: p.first_seen,
    )
