"""One counter over the records (`crash.records`): per side, what its producers were told was acknowledged, what
of it the trainer's checkpoint trained, and what the fault made them do again. Pure: records in, counts out.

- **acknowledged**: distinct units some producer was told were acknowledged: group ids (whole groups), tasks
  `(epoch, index)` (the task of the lease token a group was acknowledged under), rollouts `(group, slot)`.
- **lost**: acknowledged and never trained.
- **trained twice**: trained in more than one step (a task: under any of its lease tokens; a rollout: its group
  trained again).
- **at-least-once**: units trained twice that a documented at-least-once edge allows, with its reason; counted
  here, never in **trained twice**, and never passed off as 0 (`EDGES` says which edges exist).
- **redone**: work done again because of the fault: whole groups finished and never acknowledged (thrown
  away; a new group takes its place), tasks acknowledged under a lease other than their first (their first
  lease lapsed or was handed back, its rollouts thrown away, whole or in part, or never begun), rollouts finished
  more than once (a sibling redid a slot whose rollout had finished but was not acknowledged).
- **recover_s**: from the fault until the side had both a group acknowledged and a group trained after it.

The episodes side is counted as per-rollout groups are (its units are rollouts `(group, slot)`), and its turns
and tokens against a reference, what an uninterrupted run with the same group id, slot, env and task makes
(`crash.episodes.reference`, computed in process by the caller: the counter stays pure): **not token-exact**
(a trained rollout that is not one of its group's reference rollouts), **turns lost** (an acknowledged turn that
is not part of its slot's trained rollout), **redone** (completions generated beyond those the trained rollouts
hold: turns generated twice), and what resuming saved (`EpisodesCell`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from crash.records import SIDES, Producer, Step

if TYPE_CHECKING:
    from crash.episodes import Expected

FILLER = "filler-"
"""Group ids of the groups the harness sends to complete the last batch: counted on no side."""

EDGES: dict[str, tuple[Callable[[Any], bool], str]] = {}
"""Per side, a documented at-least-once edge: which units trained twice it covers, and why it is kept. None is
kept today: whole groups are idempotent by group id (the runner always sends one: docs/stores.md's "a submission
without either can be stored twice" cannot happen), a task's group is acknowledged only as its lease's
submission (docs/tasks.md), and a slot's second rollout is `redone`, not stored (docs/rollouts.md)."""


@dataclass
class Cell:
    """One side's counts in one run."""

    acknowledged: int = 0
    lost: int = 0
    trained_twice: int = 0
    at_least_once: int = 0
    at_least_once_reason: str | None = None
    redone: int = 0
    recover_s: float | None = None
    unclaimed: int = 0
    """Trained units no producer's record claims (its acknowledgement never reached a producer that lived on to
    write it): not lost, not twice; shown so that a count that hides one is seen."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """A few of the lost and trained-twice units, to reproduce from."""

    def failed(self) -> bool:
        return failed(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EpisodesCell(Cell):
    """The episodes side's cell: its rollouts counted as per-rollout groups' are (`redone`: completions generated
    again), and its turns."""

    turns_acknowledged: int = 0
    """Distinct turns (group, slot, turn) some producer was told were acknowledged."""
    turns_lost: int = 0
    """Acknowledged turns that are not part of their slot's trained rollout: the slot's rollout was not trained
    token-exact, or the turn's tokens are not that rollout's turn (a turn acknowledged twice with other tokens
    is lost once). **Must be 0.**"""
    not_token_exact: int = 0
    """Trained rollouts whose tokens are not those of any slot of their group as an uninterrupted run makes it
    (or of a group the records never opened). **Must be 0.**"""
    slots_resumed: int = 0
    """Slots continued from another producer's acknowledged turns."""
    slots_restarted: int = 0
    """Slots with turns in that were started again from the prompt."""
    tokens_resumed: int = 0
    """Tokens the resumed slots took from their turns instead of generating them again."""


def failed(cell: Mapping[str, Any]) -> bool:
    """A cell (as `as_dict` gives it, or as the matrix's JSON keeps it) that lost or trained twice something, or
    whose episodes are not what an uninterrupted run makes."""
    keys = ("lost", "trained_twice", "turns_lost", "not_token_exact")
    return any(cell.get(k, 0) for k in keys)


@dataclass(frozen=True)
class Task:
    epoch: int
    index: int
    lease: int


def parse_token(group_id: str) -> Task | None:
    """A lease token's task and lease number (`task:DATASET:EPOCH:INDEX:LEASE.NONCE`), or None: read here, not
    imported from the server, so that the counter depends only on the documented format."""
    if not group_id.startswith("task:"):
        return None
    parts = group_id.rsplit(":", 3)
    try:
        return Task(int(parts[1]), int(parts[2]), int(parts[3].split(".", 1)[0]))
    except (IndexError, ValueError):
        return None


def _key(side: str, group_id: str) -> Any:
    if side == "tasks":
        task = parse_token(group_id)
        return None if task is None else (task.epoch, task.index)
    return group_id


def _twice(trained: Counter[Any], side: str) -> tuple[int, int, str | None, list[Any]]:
    """(trained twice, at-least-once, its reason, examples) over units trained more than once."""
    over = [(k, n - 1) for k, n in trained.items() if n > 1]
    edge = EDGES.get(side)
    allowed = [(k, n) for k, n in over if edge is not None and edge[0](k)]
    plain = [(k, n) for k, n in over if not (edge is not None and edge[0](k))]
    reason = edge[1] if edge is not None and allowed else None
    return sum(n for _, n in plain), sum(n for _, n in allowed), reason, [k for k, _ in plain[:5]]


def _redone(side: str, made: set[str], acked: set[str]) -> int:
    if side == "groups":
        return len(made - acked)
    again = {(t.epoch, t.index) for t in map(parse_token, acked) if t is not None and t.lease > 1}
    return len(again)


def _recover(acks: Iterable[float], trained: Iterable[float], fault_at: float | None) -> float | None:
    if fault_at is None:
        return None
    ack = min((t for t in acks if t >= fault_at), default=None)
    step = min((t for t in trained if t >= fault_at), default=None)
    if ack is None or step is None:
        return None
    return round(max(ack, step) - fault_at, 2)


def count(
    producers: list[Producer],
    steps: list[Step],
    fault_at: float | None = None,
    reference: Mapping[str, Sequence[Expected]] | None = None,
) -> dict[str, Cell]:
    """Per side, its cell. `steps`: the trainer's checkpoint; `fault_at`: when the fault began (wall clock);
    `reference`: per episodes group id, each slot as an uninterrupted run makes it (`crash.episodes.reference`)."""
    by_side = {side: [p for p in producers if p.side == side] for side in SIDES}
    whole_ids = {a for p in by_side["groups"] for _, a in p.acks} | {m for p in by_side["groups"] for _, m in p.made}
    out: dict[str, Cell] = {}
    for side in ("groups", "tasks"):
        mine = by_side[side]
        acked = {_key(side, a) for p in mine for _, a in p.acks} - {None}
        made = {m for p in mine for _, m in p.made}
        acked_ids = {a for p in mine for _, a in p.acks}
        belongs: Callable[[str], bool]
        if side == "groups":
            belongs = whole_ids.__contains__
        else:
            belongs = lambda g: parse_token(g) is not None  # noqa: E731
        trained: Counter[Any] = Counter()
        times: list[float] = []
        for s in steps:
            for g in s.groups:
                if belongs(g):
                    trained[_key(side, g)] += 1
                    times.append(s.at)
        twice, edge, reason, examples = _twice(trained, side)
        lost = sorted(map(str, acked - set(trained)))
        out[side] = Cell(
            acknowledged=len(acked),
            lost=len(lost),
            trained_twice=twice,
            at_least_once=edge,
            at_least_once_reason=reason,
            redone=_redone(side, made, acked_ids),
            recover_s=_recover((t for p in mine for t, _ in p.acks), times, fault_at),
            unclaimed=len(set(trained) - acked),
            examples={"lost": lost[:5], "trained_twice": list(map(str, examples))},
        )
    out["rollouts"] = _per_rollout(by_side["rollouts"], steps, fault_at)
    out["episodes"] = _episodes(by_side["episodes"], steps, fault_at, reference or {})
    return out


def _trained_once(groups: set[str], steps: list[Step]) -> tuple[dict[str, list[str]], int, list[str], list[float]]:
    """Of per-rollout groups: each group's digests as first trained, the sequences trained again in a later step,
    those groups, and the times of the steps that trained any."""
    first: dict[str, tuple[int, list[str]]] = {}
    again = 0
    again_groups: list[str] = []
    times: list[float] = []
    for s in steps:
        for g, digests in s.seqs.items():
            if g not in groups:
                continue
            times.append(s.at)
            if g in first and first[g][0] != s.step:
                again += len(digests)
                again_groups.append(g)
                continue
            first.setdefault(g, (s.step, []))[1].extend(digests)
    return {g: d for g, (_, d) in first.items()}, again, again_groups, times


def _per_rollout(mine: list[Producer], steps: list[Step], fault_at: float | None) -> Cell:
    acked_slots = {(a[0], a[1]): a[2] for p in mine for _, a in p.acks}
    acked_seqs = Counter((g, d) for (g, _), d in acked_slots.items())
    first, again, again_groups, times = _trained_once({g for g, _ in acked_slots}, steps)
    trained_seqs = Counter((g, d) for g, digests in first.items() for d in digests)
    lost_seqs = acked_seqs - trained_seqs
    done = Counter(m for p in mine for _, m in p.made)
    return Cell(
        acknowledged=len(acked_slots),
        lost=sum(lost_seqs.values()),
        trained_twice=again,
        redone=sum(n - 1 for n in done.values() if n > 1),
        recover_s=_recover((t for p in mine for t, _ in p.acks), times, fault_at),
        unclaimed=sum((trained_seqs - acked_seqs).values()),
        examples={"lost": [f"{g}:{d}" for g, d in list(lost_seqs)[:5]], "trained_twice": again_groups[:5]},
    )


def _episodes(
    mine: list[Producer], steps: list[Step], fault_at: float | None, reference: Mapping[str, Sequence[Expected]]
) -> EpisodesCell:
    acked_slots = {(a[0], a[1]): a[2] for p in mine for _, a in p.acks}
    acked_seqs = Counter((g, d) for (g, _), d in acked_slots.items())
    groups = {g for g, _ in acked_slots} | {g for p in mine for g in p.opens}
    first, again, again_groups, times = _trained_once(groups, steps)
    trained_seqs = Counter((g, d) for g, digests in first.items() for d in digests)
    lost_seqs = acked_seqs - trained_seqs
    inexact: list[str] = []
    for g, digests in first.items():
        want = Counter(e.digest for e in reference.get(g, ()))
        inexact += [f"{g}:{d}" for d in (Counter(digests) - want).elements()]
    turns = {a for p in mine for _, a in p.turns}
    lost_turns = [f"{g}#{s}:{k}" for g, s, k, d in sorted(turns) if not _kept(g, s, k, d, first, reference)]
    needed = sum(e.generations for g in first for e in reference.get(g, ()))
    generated = sum(p.generated for p in mine)
    return EpisodesCell(
        acknowledged=len(acked_slots),
        lost=sum(lost_seqs.values()),
        trained_twice=again,
        redone=max(0, generated - needed),
        recover_s=_recover((t for p in mine for t, _ in p.acks + p.turns), times, fault_at),
        unclaimed=sum((trained_seqs - acked_seqs).values()),
        examples={
            "lost": [f"{g}:{d}" for g, d in list(lost_seqs)[:5]],
            "trained_twice": again_groups[:5],
            "turns_lost": lost_turns[:5],
            "not_token_exact": inexact[:5],
        },
        turns_acknowledged=len({(g, s, k) for g, s, k, _ in turns}),
        turns_lost=len(lost_turns),
        not_token_exact=len(inexact),
        slots_resumed=sum(len(p.resumed) for p in mine),
        slots_restarted=sum(p.restarted for p in mine),
        tokens_resumed=sum(n for p in mine for _, _, n in p.resumed),
    )


def _kept(
    g: str,
    slot: int,
    turn: int,
    turn_digest: str,
    first: Mapping[str, list[str]],
    ref: Mapping[str, Sequence[Expected]],
) -> bool:
    """Whether acknowledged turn `turn` of slot `slot` is part of the slot's trained rollout: the group was trained,
    with the slot's rollout as an uninterrupted run makes it, and that rollout's turn `turn` has these tokens."""
    slots = ref.get(g, ())
    if g not in first or not 0 <= slot < len(slots):
        return False
    want = slots[slot]
    return want.digest in first[g] and turn < len(want.turns) and want.turns[turn] == turn_digest
