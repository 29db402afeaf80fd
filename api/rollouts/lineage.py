"""A group's lineage (docs/rollouts.md, Lineage), as pure functions over its record's `lineage`: per slot, how
often its lease carried its turns to another producer (a resume, and the tokens it did not regenerate) or carried
none (a restart from the prompt), and which producer generated which of its turns and tokens.

Resumes and restarts are counted as the leases are handed out (the lease rewrites the record anyway). The turns'
producers and token ranges are read from the turns' keys (`TurnKey`, no data) while the group is open, and written
into its record when it is decided, because its turns are freed then: a sealed group keeps its lineage on every
store and across restarts, at the cost of one read of its turns' keys at its decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from api.ledger.rules import Resumes
from api.store.rollouts import TurnKey

__all__ = ["Lineage", "leased", "resumes", "runs", "with_runs"]

Lineage = dict[str, dict[str, Any]]
"""Slot (as text) -> {"resumes": n, "restarts": n, "saved": tokens, "turns": [[producer, turns, start, end], ...]}:
each key present only once it is not zero or empty."""


def leased(lineage: Lineage, slot: int, carried: int | None) -> None:
    """The slot's lease was handed to another producer, with `carried` tokens of acknowledged turns (a resume), or
    none (None: a restart from the prompt)."""
    entry = lineage.setdefault(str(slot), {})
    if carried is None:
        entry["restarts"] = entry.get("restarts", 0) + 1
    else:
        entry["resumes"] = entry.get("resumes", 0) + 1
        entry["saved"] = entry.get("saved", 0) + carried


def runs(keys: Iterable[TurnKey]) -> dict[str, list[list[Any]]]:
    """Per slot with turns (by slot, turn: `OpenGroupTxn.turn_keys`' order): its turns as runs of one producer each,
    `[producer, turns, first token, end token]` (the end exclusive, counted from the rollout's first token), a run
    per change of producer."""
    out: dict[str, list[list[Any]]] = {}
    ends: dict[str, int] = {}
    for k in keys:
        slot = str(k.slot)
        at = ends.get(slot, 0)
        got = out.setdefault(slot, [])
        if got and got[-1][0] == k.producer:
            got[-1][1] += 1
            got[-1][3] = at + k.tokens
        else:
            got.append([k.producer, 1, at, at + k.tokens])
        ends[slot] = at + k.tokens
    return out


def with_runs(lineage: Lineage, keys: Iterable[TurnKey]) -> Lineage:
    """The lineage with each slot's turns as `runs` makes them (what the record keeps once the turns are freed)."""
    out = {slot: dict(entry) for slot, entry in lineage.items()}
    for slot, made in runs(keys).items():
        out.setdefault(slot, {})["turns"] = made
    return out


def resumes(lineage: Lineage, slots: Iterable[int]) -> Resumes | None:
    """What the ledger row of the group sealed with these `slots` says of their resumes: the slots resumed at least
    once and the tokens all their resumes carried over; None if none of them was (a slot left out of the seal is
    not counted: its rollout is not in the group)."""
    kept = sorted(s for s in set(slots) if lineage.get(str(s), {}).get("resumes", 0) > 0)
    if not kept:
        return None
    return Resumes(tuple(kept), sum(int(lineage[str(s)].get("saved", 0)) for s in kept))
