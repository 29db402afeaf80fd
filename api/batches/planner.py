"""Batch formation: which queued items make the next batch. Pure functions over plain data; no I/O.

The store hands over a *window* of each environment's FIFO queue (at most what one batch could use), so
the cost of forming a batch depends on the batch size and the number of environments, never on the queue
length. See docs/batching.md for the rules in prose.

Exact mode (no token budget): a batch is exactly `batch_size` sequences of whole items. Each env earns
credit in proportion to its weight on every batch it has data for (deficit round-robin); a dynamic
program over per-env FIFO prefixes finds the exact fill closest to those credits that honours every
minimum allocation. Only when no prefix combination adds up exactly does a subset-sum fallback skip
items, so FIFO order within an env is broken only where an exact fill needs it. When the window holds no
exact fill at all, the store reads further (`LookAhead`, bounded in groups and sequences) and the planner
runs again on that longer window (`NoBatch.look_further`).

An env's oldest item passed over (a newer one of its env taken) becomes *due* `LookAhead.due_after` batches
later: from then on a batch must hold it, exactly if it can, else under the trainer's `no_exact_fill` policy
("smaller": the fullest batch under `batch_size` that holds it; "trim": whole groups cut to exactly `batch_size`,
`_trim_fill`; "wait": it waits for a fill that holds it).

Token mode (`max_batch_tokens`): whole items are taken greedily, env with the most credit first, while
they fit both the sequence and the token budget; see `_plan_tokens` for when such a batch is released.

At the end of a run fed by datasets, once nothing else can arrive (`final`, api/tasks/ending.py), what is queued is
the run's tail: served in batches short of `batch_size` where the trainer allows them, else left out (`_plan_tail`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from api.config.groups import setting
from api.store.items import ItemMeta

CREDIT_CAP_BATCHES = 2.0
"""Credit an env may bank, in batches: enough to smooth a few batches of imbalance, small enough that an
env returning after a long pause cannot take over the mix."""


WAIT = "wait"
SMALLER = "smaller"
TRIM = "trim"
WAIT_FOR_ARRIVALS_BATCHES = 2
"""No exact fill among queued groups whose sizes could still add up with more arrivals (6s and 8s towards 64) is
waited out only while fewer than this many batches' worth are queued: past it, arrivals are evidently not
completing one (survivor groups of 59-63 piling up behind rare whole ones), and it is treated as a stall.

Deliberately not a setting: it bounds no resource (the queue limits do), and the trade-off it touches is the
trainer's, made with `no_exact_fill`: under "wait" it changes only whether the reason is reported as a stall, under
"smaller" how long a fill of the arriving sizes is waited for before a smaller batch is served. A trainer that
wants exact batches however long they take registers "wait"; one that registers "smaller" wants progress, and two
batches' worth queued with no fill is already the evidence that arrivals are not completing one.

The wait is bounded in time too (`formation_arrival_wait_seconds`, applied by `api/batches/formation.py`): a run whose
producers stop would otherwise leave up to two batches' worth queued for good under "smaller"."""


@dataclass(frozen=True, slots=True)
class BatchSpec:
    batch_size: int
    max_tokens: int | None = None
    min_fill: float = 0.9
    no_exact_fill: str = SMALLER
    """Exact mode, when no exact fill exists (or none holds a due item): "smaller" forms the fullest batch
    under `batch_size`, "trim" exactly `batch_size` by cutting sequences off a group, "wait" forms none
    (docs/batching.md)."""


@dataclass(frozen=True, slots=True)
class LookAhead:
    """How far formation reads into each queue when its window holds no exact fill: the cost stays flat in
    the queue's depth (at most `groups` items per env are read and planned over)."""

    groups: int = setting("formation_look_ahead_groups")
    sequences: int = setting("formation_look_ahead_sequences")
    due_after: int = setting("formation_due_after")
    """Batches an env's oldest item may be passed over (newer items of its env taken) before a batch must
    hold it."""


@dataclass(frozen=True, slots=True)
class EnvWindow:
    """The head of one env's queue, as batch formation sees it."""

    env_id: int
    name: str
    weight: float
    min_share: float
    """Share of each batch reserved for this env (already scaled so that all shares add up to at most 1)."""
    items: Sequence[ItemMeta]
    """Oldest first; stale items already removed."""
    due: bool = False
    """The oldest item was passed over for `LookAhead.due_after` batches: a batch must hold it."""
    more: bool = False
    """More of the queue lies beyond these items (its read stopped at a bound): arrivals land beyond it."""
    stale: int = 0
    """Groups of this env dropped as stale while its queue was read for this batch (`max_staleness`)."""


@dataclass(frozen=True, slots=True)
class Plan:
    take: dict[int, list[int]]
    """Item ids per env, in FIFO order."""
    seqs: int
    tokens: int
    credits: dict[int, float]
    passed_over: dict[int, int] = field(default_factory=dict)
    """Per env whose oldest item stays queued while newer ones of its env are taken: that item's id."""
    smaller: bool = False
    """Fewer than `batch_size` sequences in exact mode: no exact fill (holding the due items) existed."""
    trim: dict[int, int] = field(default_factory=dict)
    """`no_exact_fill: "trim"`: per item cut, the sequences served (its first ones; the rest are left out).
    `seqs` counts what is served; `tokens` counts the items whole (the planner knows no per-sequence lengths:
    `take` counts the cut tokens out)."""


@dataclass(frozen=True, slots=True)
class NoBatch:
    reason: str
    blocked: bool
    """True when waiting for more data alone will not help: a minimum allocation or group sizes block it."""
    credits: dict[int, float] = field(default_factory=dict)
    look_further: bool = False
    """No exact fill in these windows: a longer read of the queues (`LookAhead`) may hold one."""
    holding: int | None = None
    """The env whose minimum allocation holds the batch back, if that is what blocks it."""
    awaiting: int | None = None
    """Sequences queued while an exact fill is waited for from arrivals (`WAIT_FOR_ARRIVALS_BATCHES`): the caller
    bounds that wait in time (`arrivals_waited_out`) and knows arrivals came when this number changes."""
    left_out: bool = False
    """The run's tail (`final`) under exact batch sizes ("trim", "wait"): what is queued makes no exact batch and
    nothing else can arrive, so it is left out (the caller drops it)."""


# ------------------------------------------------------------------------------------------- planning


def plan_batch(
    windows: Sequence[EnvWindow],
    spec: BatchSpec,
    credits: Mapping[int, float],
    *,
    looked_further: bool = True,
    arrivals_waited_out: bool = False,
    final: bool = False,
) -> Plan | NoBatch:
    """The next batch from these windows, or why there is none. `looked_further`: the windows are the longer
    read (`LookAhead`), or all that is queued; without it, a window with no exact fill asks for the longer read
    (`NoBatch.look_further`) before any policy for no exact fill applies. `arrivals_waited_out`: nothing arrived
    for as long as an exact fill is waited for (`NoBatch.awaiting`), so the trainer's policy applies now.

    `final`: nothing else can arrive (every dataset feeding the run is exhausted, api/tasks/ending.py), so what is
    queued is the run's tail and no wait can help: minimum shares no longer hold, and a batch short of
    `batch_size` is served where the trainer allows one (exact mode "smaller", and token mode: whatever fits the
    budgets); under "trim" and "wait" exact batches form while they can, and the rest is `NoBatch.left_out`."""
    if final:
        windows = [dataclasses.replace(w, min_share=0.0) for w in windows]
    active = [w for w in windows if w.items]
    credits_now = _earn(active, spec.batch_size, credits)
    lacking = [w for w in windows if w.min_share > 0 and _seqs(w.items) < _required(w, spec.batch_size)]
    available = sum(_seqs(w.items) for w in active)
    if lacking:
        w = lacking[0]
        need = _required(w, spec.batch_size)
        short = {x.env_id for x in lacking}
        if spec.max_tokens is None:
            blocked = available >= spec.batch_size
        else:  # token mode: blocked when the others would release a batch (budgets, not batch_size, bound it)
            unreserved = [dataclasses.replace(x, min_share=0.0) if x.env_id in short else x for x in active]
            blocked = isinstance(
                _plan_tokens(unreserved, spec, credits, _earn(unreserved, spec.batch_size, credits)), Plan
            )
        stale = f" ({_stale(w.stale)} just now)" if w.stale else ""
        reason = (
            f"env {w.name!r} has {_seqs(w.items)} sequences queued{stale}; its min_batch_allocation of "
            f"{w.min_share:.3g} needs {need} in every batch"
        )
        if blocked:
            return NoBatch(reason, blocked=True, credits=dict(credits), holding=w.env_id)
        return NoBatch(f"waiting for data: {reason}", blocked=False, credits=dict(credits))
    if spec.max_tokens is None:
        plan = _plan_exact(active, spec, credits, credits_now, looked_further, arrivals_waited_out, final)
    else:
        plan = _plan_tokens(active, spec, credits, credits_now, final)
    if isinstance(plan, NoBatch) and not plan.blocked and (note := _stale_note(windows)):
        return dataclasses.replace(plan, reason=f"{plan.reason}; {note}")
    return plan


def _stale(n: int) -> str:
    return f"{n} stale group{'s' if n != 1 else ''} dropped"


def _stale_note(windows: Sequence[EnvWindow]) -> str:
    """What staleness removed while the queues were read for this batch (groups generated more than
    `max_staleness` steps behind the trainer), so waiting for data says why queued data did not count."""
    dropped = [(w.name, w.stale) for w in windows if w.stale]
    if not dropped:
        return ""
    total = sum(n for _, n in dropped)
    per_env = ", ".join(f"{n} of {name!r}" for name, n in dropped)
    return f"{_stale(total)} just now ({per_env}): generated more than max_staleness steps behind the trainer"


def _seqs(items: Iterable[ItemMeta]) -> int:
    return sum(m.seqs for m in items)


def _required(w: EnvWindow, batch_size: int) -> int:
    return math.ceil(w.min_share * batch_size - 1e-9)


def _earn(active: Sequence[EnvWindow], batch_size: int, credits: Mapping[int, float]) -> dict[int, float]:
    """Credits after this batch's share is earned: only envs with data earn, in proportion to weight."""
    total_weight = sum(w.weight for w in active)
    cap = CREDIT_CAP_BATCHES * batch_size
    out = dict(credits)
    for w in active:
        share = batch_size * w.weight / total_weight if total_weight > 0 else batch_size / len(active)
        out[w.env_id] = min(cap, out.get(w.env_id, 0.0) + share)
    return out


def _spend(
    credits: dict[int, float], take: Mapping[int, Sequence[ItemMeta]], batch_size: int, trim: Mapping[int, int]
) -> dict[int, float]:
    floor = -CREDIT_CAP_BATCHES * batch_size
    for env, items in take.items():
        credits[env] = max(floor, credits.get(env, 0.0) - _served(items, trim))
    return credits


def _served(items: Iterable[ItemMeta], trim: Mapping[int, int]) -> int:
    """Sequences served of these items, a cut item counting what is kept of it."""
    return sum(trim.get(m.item_id, m.seqs) for m in items)


def _plan_from(
    take: Mapping[int, Sequence[ItemMeta]],
    credits_now: dict[int, float],
    batch_size: int,
    windows: Sequence[EnvWindow] = (),
    trim: Mapping[int, int] | None = None,
) -> Plan:
    trim = dict(trim or {})
    chosen = {env: items for env, items in take.items() if items}
    passed = {}
    for w in windows:
        got = chosen.get(w.env_id)
        if got and got[0].item_id != w.items[0].item_id:
            passed[w.env_id] = w.items[0].item_id
    seqs = sum(_served(items, trim) for items in chosen.values())
    return Plan(
        take={env: [m.item_id for m in items] for env, items in chosen.items()},
        seqs=seqs,
        tokens=sum(m.tokens for items in chosen.values() for m in items),
        credits=_spend(credits_now, chosen, batch_size, trim),
        passed_over=passed,
        smaller=bool(windows) and seqs < batch_size,  # exact mode passes its windows; token mode none
        trim=trim,
    )


def _plan_exact(
    active: Sequence[EnvWindow],
    spec: BatchSpec,
    credits: Mapping[int, float],
    credits_now: dict[int, float],
    looked_further: bool,
    arrivals_waited_out: bool = False,
    final: bool = False,
) -> Plan | NoBatch:
    """Exactly `batch_size` sequences holding every due item; else, once the longer read was planned over, the
    trainer's `no_exact_fill` policy (see the module's docstring); `final`: the run's tail (`_plan_tail`)."""
    batch_size = spec.batch_size
    available = sum(_seqs(w.items) for w in active)
    waiting = NoBatch(
        f"waiting for data: {available} of {batch_size} sequences queued", blocked=False, credits=dict(credits)
    )
    if available < batch_size and (not final or not available):
        return waiting
    if available >= batch_size:
        take = _prefix_fill(active, batch_size, credits_now) or _subset_fill(active, batch_size, credits_now)
        if take is not None:
            return _plan_from(take, credits_now, batch_size, active)
        if not looked_further:
            return NoBatch("no exact fill in the window", blocked=False, credits=dict(credits), look_further=True)
    if final:
        return _plan_tail(active, spec, credits, credits_now)
    due = [w for w in active if w.due]
    smaller = spec.no_exact_fill in (SMALLER, TRIM)  # "trim" serves a smaller batch where no cut fits (minimums)
    if due:
        if spec.no_exact_fill == TRIM and (cut := _trim_fill(active, batch_size, credits_now)) is not None:
            return _plan_from(cut[0], credits_now, batch_size, active, cut[1])
        if smaller and (take := _subset_fill(active, batch_size, credits_now, exact=False)) is not None:
            return _plan_from(take, credits_now, batch_size, active)
        # "wait": an exact fill without the due items, if there is one (they are passed over again)
        undue = [EnvWindow(w.env_id, w.name, w.weight, w.min_share, w.items) for w in active]
        take = _prefix_fill(undue, batch_size, credits_now) or _subset_fill(undue, batch_size, credits_now)
        if take is not None:
            return _plan_from(take, credits_now, batch_size, active)
    sizes = sorted({m.seqs for w in active for m in w.items})
    shares = " while meeting the minimum allocations" if any(w.min_share for w in active) else ""
    more = None if shares else arrival_that_fills([m.seqs for w in active for m in w.items], batch_size)
    if (
        more
        and not any(w.more for w in active)
        and available < WAIT_FOR_ARRIVALS_BATCHES * batch_size
        and not arrivals_waited_out
    ):
        # Not a stall: groups of the sizes already seen can still end it (mixed sizes 6 and 8 fill 64).
        return NoBatch(
            f"waiting for data: queued group sizes {sizes} do not add up to exactly batch_size {batch_size} "
            f"yet; {more} would form a batch",
            blocked=False,
            credits=dict(credits),
            awaiting=available,
        )
    if spec.no_exact_fill == TRIM and (cut := _trim_fill(active, batch_size, credits_now)) is not None:
        return _plan_from(cut[0], credits_now, batch_size, active, cut[1])
    if smaller and (take := _subset_fill(active, batch_size, credits_now, exact=False)) is not None:
        return _plan_from(take, credits_now, batch_size, active)
    groups = sum(len(w.items) for w in active)
    read = " (the oldest, as far as formation looks ahead)" if any(w.more for w in active) else ""
    policy = (
        "no_exact_fill is 'wait': register no_exact_fill 'smaller' to train on them in batches of fewer sequences, "
        "or 'trim' in batches of exactly batch_size with the sequences that do not fit left out"
        if not smaller
        else f"no {'trimmed or ' if spec.no_exact_fill == TRIM else ''}smaller batch meets the minimum allocations "
        "either"
    )
    return NoBatch(
        f"no choice of the {groups} queued groups{read} (sizes {sizes}) adds up to exactly batch_size "
        f"{batch_size}{shares}; {policy}",
        blocked=True,
        credits=dict(credits),
    )


def _plan_tail(
    active: Sequence[EnvWindow], spec: BatchSpec, credits: Mapping[int, float], credits_now: dict[int, float]
) -> Plan | NoBatch:
    """The run's tail in exact mode, when no exact fill of whole groups exists and nothing else can arrive:
    "smaller" serves the fullest batch under `batch_size` (the last batches: every group trains), "trim" a batch of
    exactly `batch_size` with the newest group cut while enough is queued, and what is left makes no batch under
    "trim" or "wait": it is left out (`NoBatch.left_out`), as a trainer that requires exact batch sizes said."""
    batch_size = spec.batch_size
    if spec.no_exact_fill == TRIM and (cut := _trim_fill(active, batch_size, credits_now)) is not None:
        return _plan_from(cut[0], credits_now, batch_size, active, cut[1])
    if spec.no_exact_fill == SMALLER and (take := _subset_fill(active, batch_size, credits_now, exact=False)):
        return _plan_from(take, credits_now, batch_size, active)
    groups = sum(len(w.items) for w in active)
    sizes = sorted({m.seqs for w in active for m in w.items})
    seqs = sum(_seqs(w.items) for w in active)
    return NoBatch(
        f"the run's tail: {groups} queued group{'s' if groups != 1 else ''} ({seqs} sequences, sizes {sizes}) make "
        f"no batch of exactly batch_size {batch_size}, and nothing else can arrive; no_exact_fill is "
        f"{spec.no_exact_fill!r}, so no smaller batch is served: they are left out (dropped as 'run_tail'); register "
        "no_exact_fill 'smaller' to train them in a last smaller batch",
        blocked=True,
        credits=dict(credits),
        left_out=True,
    )


def arrival_that_fills(queued: Sequence[int], batch_size: int) -> str | None:
    """What arrivals of the group sizes already queued would let a subset add up to exactly `batch_size`: one
    more group of some size, or more groups; None when no number of them can (a real stall)."""
    sizes = sorted(set(queued))
    mask = (1 << (batch_size + 1)) - 1
    reach = 1  # bit k: k sequences can be chosen from what is queued
    for n in queued:
        reach = (reach | (reach << n)) & mask
    for s in sizes:
        if ((reach | (reach << s)) >> batch_size) & 1:
            return f"one more group of {s}"
    unbounded = reach  # with any number of arrivals of these sizes
    while True:
        grown = unbounded
        for s in sizes:
            grown |= (grown << s) & mask
        if grown == unbounded:
            break
        unbounded = grown
    if (unbounded >> batch_size) & 1:
        return f"more groups of sizes {sizes}"
    return None


def _trim_fill(
    active: Sequence[EnvWindow], batch_size: int, targets: Mapping[int, float]
) -> tuple[dict[int, list[ItemMeta]], dict[int, int]] | None:
    """Exactly `batch_size` sequences by cutting sequences off groups (`no_exact_fill: "trim"`), or None when the
    minimum allocations leave no way.

    Whole groups are taken as FIFO prefixes per env: first each env's minimum allocation (and its due item), then
    the env furthest below its credit adds its oldest next group, until the batch holds at least `batch_size`.
    The excess (fewer sequences than the last group added) is then cut off one group, the newest taken that can
    lose that many keeping at least one sequence and its env's minimum (without minimums there always is one: the
    last group added); only where minimums leave none, off the newest taken groups first, each within those
    bounds. Older groups are served whole, as FIFO would."""
    take: dict[int, list[ItemMeta]] = {}
    need = {w.env_id: _required(w, batch_size) for w in active}
    pos: dict[int, int] = {}
    for w in active:
        k = 1 if w.due else 0
        while k < len(w.items) and _seqs(w.items[:k]) < need[w.env_id]:
            k += 1
        if _seqs(w.items[:k]) < need[w.env_id]:
            return None
        take[w.env_id], pos[w.env_id] = list(w.items[:k]), k
    total = sum(_seqs(items) for items in take.values())
    owed = {w.env_id: targets.get(w.env_id, 0.0) - _seqs(take[w.env_id]) for w in active}
    by_id = {w.env_id: w for w in active}
    while total < batch_size:
        ready = [e for e, w in by_id.items() if pos[e] < len(w.items)]
        if not ready:
            return None
        env = max(ready, key=lambda e: (owed[e], -by_id[e].items[pos[e]].item_id))
        m = by_id[env].items[pos[env]]
        take[env].append(m)
        pos[env] += 1
        total += m.seqs
        owed[env] -= m.seqs
    excess = total - batch_size
    spare = {e: _seqs(items) - need[e] for e, items in take.items()}
    newest_first = sorted(((e, m) for e, items in take.items() for m in items), key=lambda x: -x[1].item_id)
    alone = [(e, m) for e, m in newest_first if min(m.seqs - 1, spare[e]) >= excess]
    trim: dict[int, int] = {}
    for env, m in alone[:1] if alone else newest_first:  # one group when one can take the whole cut
        if excess == 0:
            break
        cut = min(excess, m.seqs - 1, spare[env])
        if cut > 0:
            trim[m.item_id] = m.seqs - cut
            spare[env] -= cut
            excess -= cut
    return (take, trim) if excess == 0 else None


def _prefix_fill(
    active: Sequence[EnvWindow], batch_size: int, targets: Mapping[int, float]
) -> dict[int, list[ItemMeta]] | None:
    """FIFO prefixes per env adding up to exactly batch_size, closest (least squares) to the targets.

    DP over envs on the number of sequences so far; each env contributes one of its prefix sums.
    O(envs x prefixes x batch_size), vectorised over the batch_size axis.
    """
    size = batch_size + 1
    inf = np.inf
    best = np.full(size, inf)
    best[0] = 0.0
    choices: list[np.ndarray] = []
    for w in active:
        prefix = np.concatenate([[0], np.cumsum([m.seqs for m in w.items])])
        prefix = prefix[prefix <= batch_size]
        need = _required(w, batch_size)
        target = min(max(targets.get(w.env_id, 0.0), float(need)), float(prefix[-1]))
        nxt = np.full(size, inf)
        choice = np.full(size, -1, dtype=np.int64)
        for k, s in enumerate(prefix.tolist()):
            if s < need or (k == 0 and w.due):
                continue
            cand = np.full(size, inf)
            cand[s:] = best[: size - s] + (s - target) ** 2
            better = cand < nxt
            nxt[better] = cand[better]
            choice[better] = k
        best = nxt
        choices.append(choice)
    if not np.isfinite(best[batch_size]):
        return None
    take: dict[int, list[ItemMeta]] = {}
    s = batch_size
    for w, choice in zip(reversed(active), reversed(choices), strict=True):
        k = int(choice[s])
        take[w.env_id] = list(w.items[:k])
        s -= _seqs(w.items[:k])
    return take


def _subset_fill(
    active: Sequence[EnvWindow], batch_size: int, targets: Mapping[int, float], *, exact: bool = True
) -> dict[int, list[ItemMeta]] | None:
    """Any items adding up to exactly batch_size (`exact`; else the most sequences up to it, at least one) with
    every minimum met and every due item held, if such a choice exists at all.

    Used only when no FIFO-prefix combination exists (mixed group sizes within an env). Per env, a bitset
    of the subset sums its window can make (at least its minimum); envs combine by shifting bitsets. Each
    env's sum is then picked closest to its credit, and its items oldest first.
    """
    full = (1 << (batch_size + 1)) - 1
    per_env: list[tuple[EnvWindow, int]] = []  # window, sums allowed
    combined = [1]  # combined[i]: totals reachable with the first i envs
    for w in active:
        rest = w.items[1:] if w.due else w.items
        reach = 1
        for m in rest:
            reach = (reach | (reach << m.seqs)) & full
        if w.due:
            reach = (reach << w.items[0].seqs) & full
        need = _required(w, batch_size)
        allowed = reach & ~((1 << need) - 1)
        per_env.append((w, allowed))
        total = 0
        for s in _bits(allowed):
            total |= combined[-1] << s
        combined.append(total & full)
    reachable = combined[-1] & full
    if exact:
        if not (reachable >> batch_size) & 1:
            return None
        remaining = batch_size
    else:
        if reachable <= 1:
            return None
        remaining = reachable.bit_length() - 1
    take: dict[int, list[ItemMeta]] = {}
    for i in range(len(active) - 1, -1, -1):
        w, allowed = per_env[i]
        options = [s for s in _bits(allowed) if s <= remaining and (combined[i] >> (remaining - s)) & 1]
        s = min(options, key=lambda x: (abs(x - targets.get(w.env_id, 0.0)), x))
        take[w.env_id] = _oldest_subset(w.items, s, w.due, full)
        remaining -= s
    return take


def _bits(mask: int) -> list[int]:
    out = []
    s = 0
    while mask:
        if mask & 1:
            out.append(s)
        mask >>= 1
        s += 1
    return out


def _oldest_subset(items: Sequence[ItemMeta], total: int, first: bool, full: int) -> list[ItemMeta]:
    """Items adding up to `total`, oldest first: each item is taken when the newer ones can still complete the
    sum (so the oldest item is held whenever any such choice holds it). `first`: the oldest item is taken."""
    n = len(items)
    suffix = [1] * (n + 1)  # suffix[i]: the sums items[i:] can make
    for i in range(n - 1, -1, -1):
        suffix[i] = (suffix[i + 1] | (suffix[i + 1] << items[i].seqs)) & full
    picked: list[ItemMeta] = []
    for i, m in enumerate(items):
        if total == 0:
            break
        if (i == 0 and first) or (m.seqs <= total and (suffix[i + 1] >> (total - m.seqs)) & 1):
            picked.append(m)
            total -= m.seqs
    assert total == 0, "a sum the bitsets allowed was not found"
    return picked


def _plan_tokens(
    active: Sequence[EnvWindow],
    spec: BatchSpec,
    credits: Mapping[int, float],
    credits_now: dict[int, float],
    final: bool = False,
) -> Plan | NoBatch:
    """Greedy fill under both budgets. Released when it holds `batch_size` sequences, or at least
    `min_fill` of the token budget, or when every env's next item is too big to fit (FIFO: waiting cannot
    help), or, `final`, with whatever fits (nothing else can arrive). Otherwise it waits for more data."""
    assert spec.max_tokens is not None
    budget_seqs, budget_tokens = spec.batch_size, spec.max_tokens
    take: dict[int, list[ItemMeta]] = {w.env_id: [] for w in active}
    pos = {w.env_id: 0 for w in active}
    seqs = tokens = 0

    def fits(m: ItemMeta) -> bool:
        return seqs + m.seqs <= budget_seqs and tokens + m.tokens <= budget_tokens

    # Minimum allocations first, as FIFO prefixes.
    for w in active:
        need = _required(w, spec.batch_size)
        while pos[w.env_id] < len(w.items) and _seqs(take[w.env_id]) < need and fits(w.items[pos[w.env_id]]):
            m = w.items[pos[w.env_id]]
            take[w.env_id].append(m)
            pos[w.env_id] += 1
            seqs += m.seqs
            tokens += m.tokens
    # Then by credit: the env furthest below its earned share goes next.
    owed = {w.env_id: credits_now.get(w.env_id, 0.0) - _seqs(take[w.env_id]) for w in active}
    by_id = {w.env_id: w for w in active}
    while True:
        ready = [env for env, w in by_id.items() if pos[env] < len(w.items) and fits(w.items[pos[env]])]
        if not ready:
            break
        env = max(ready, key=lambda e: (owed[e], -by_id[e].items[pos[e]].item_id))
        m = by_id[env].items[pos[env]]
        take[env].append(m)
        pos[env] += 1
        seqs += m.seqs
        tokens += m.tokens
        owed[env] -= m.seqs
    full = seqs >= budget_seqs or tokens >= spec.min_fill * budget_tokens
    stuck = all(pos[w.env_id] < len(w.items) for w in active)  # every env's next item is too big
    if seqs > 0 and (full or stuck or final):
        return _plan_from(take, credits_now, spec.batch_size)
    if stuck and active:  # nothing fits even an empty batch: every env's oldest group exceeds a budget (FIFO)
        heads = ", ".join(f"{w.name!r} {w.items[0].seqs} sequences, {w.items[0].tokens} tokens" for w in active)
        return NoBatch(
            f"the oldest group of every env is larger than a batch may hold ({heads}; batch_size {budget_seqs}, "
            f"max_batch_tokens {budget_tokens}): queues are served in order, so no batch can form; register "
            "larger budgets",
            blocked=True,
            credits=dict(credits),
        )
    waiting = [w.name for w in active if pos[w.env_id] == len(w.items)]
    more = f" (more from {', '.join(map(repr, waiting))} would fit)" if waiting and seqs else ""
    return NoBatch(
        f"waiting for data: {tokens} of {budget_tokens} tokens ({seqs} sequences) fit so far, under "
        f"min_batch_fill {spec.min_fill:.3g}{more}",
        blocked=False,
        credits=dict(credits),
    )
