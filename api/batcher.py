"""Batch formation: which queued items make the next batch. Pure functions over plain data; no I/O.

The store hands over a *window* of each environment's FIFO queue (at most what one batch could use), so
the cost of forming a batch depends on the batch size and the number of environments, never on the queue
length. See docs/batching.md for the rules in prose.

Exact mode (no token budget): a batch is exactly `batch_size` sequences of whole items. Each env earns
credit in proportion to its weight on every batch it has data for (deficit round-robin); a dynamic
program over per-env FIFO prefixes finds the exact fill closest to those credits that honours every
minimum allocation. Only when no prefix combination adds up exactly does a subset-sum fallback skip
items, so FIFO order within an env is broken only where an exact fill needs it.

Token mode (`max_batch_tokens`): whole items are taken greedily, env with the most credit first, while
they fit both the sequence and the token budget; see `_plan_tokens` for when such a batch is released.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from api.items import ItemMeta

CREDIT_CAP_BATCHES = 2.0
"""Credit an env may bank, in batches: enough to smooth a few batches of imbalance, small enough that an
env returning after a long pause cannot take over the mix."""


@dataclass(frozen=True, slots=True)
class BatchSpec:
    batch_size: int
    max_tokens: int | None = None
    min_fill: float = 0.9


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


@dataclass(frozen=True, slots=True)
class Plan:
    take: dict[int, list[int]]
    """Item ids per env, in FIFO order."""
    seqs: int
    tokens: int
    credits: dict[int, float]


@dataclass(frozen=True, slots=True)
class NoBatch:
    reason: str
    blocked: bool
    """True when waiting for more data alone will not help: a minimum allocation or group sizes block it."""
    credits: dict[int, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- windows


@dataclass(frozen=True, slots=True)
class Window:
    items: list[ItemMeta]
    stale: list[ItemMeta]


def take_window(
    head: Iterable[ItemMeta], *, min_step: int | None, max_seqs: int, max_tokens: int | None = None
) -> Window:
    """Read an env's queue from the head until it holds enough fresh items for any batch; set stale ones aside.

    Reads `max_seqs` sequences' worth of fresh items (or `max_tokens` tokens' worth), plus the stale items
    met on the way, which are to be dropped.
    """
    items: list[ItemMeta] = []
    stale: list[ItemMeta] = []
    seqs = tokens = 0
    for meta in head:
        if min_step is not None and meta.policy_step < min_step:
            stale.append(meta)
            continue
        items.append(meta)
        seqs += meta.seqs
        tokens += meta.tokens
        if seqs >= max_seqs or (max_tokens is not None and tokens >= max_tokens):
            break
    return Window(items, stale)


def scale_shares(shares: Mapping[int, float | None]) -> dict[int, float]:
    """Minimum allocations as given, scaled down proportionally when they add up past 1."""
    given = {env: s for env, s in shares.items() if s}
    total = sum(given.values())
    factor = 1.0 / total if total > 1.0 else 1.0
    return {env: s * factor for env, s in given.items()}


# ------------------------------------------------------------------------------------------- planning


def plan_batch(windows: Sequence[EnvWindow], spec: BatchSpec, credits: Mapping[int, float]) -> Plan | NoBatch:
    """The next batch from these windows, or why there is none."""
    active = [w for w in windows if w.items]
    credits_now = _earn(active, spec.batch_size, credits)
    lacking = [w for w in windows if w.min_share > 0 and _seqs(w.items) < _required(w, spec.batch_size)]
    available = sum(_seqs(w.items) for w in active)
    if lacking:
        w = lacking[0]
        need = _required(w, spec.batch_size)
        reason = (
            f"env {w.name!r} has {_seqs(w.items)} sequences queued; its min_batch_allocation of "
            f"{w.min_share:.3g} needs {need} in every batch"
        )
        return NoBatch(reason, blocked=available >= spec.batch_size, credits=dict(credits))
    if spec.max_tokens is None:
        return _plan_exact(active, spec.batch_size, credits, credits_now)
    return _plan_tokens(active, spec, credits, credits_now)


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


def _spend(credits: dict[int, float], take: Mapping[int, Sequence[ItemMeta]], batch_size: int) -> dict[int, float]:
    floor = -CREDIT_CAP_BATCHES * batch_size
    for env, items in take.items():
        credits[env] = max(floor, credits.get(env, 0.0) - _seqs(items))
    return credits


def _plan_from(take: Mapping[int, Sequence[ItemMeta]], credits_now: dict[int, float], batch_size: int) -> Plan:
    chosen = {env: items for env, items in take.items() if items}
    return Plan(
        take={env: [m.item_id for m in items] for env, items in chosen.items()},
        seqs=sum(_seqs(items) for items in chosen.values()),
        tokens=sum(m.tokens for items in chosen.values() for m in items),
        credits=_spend(credits_now, chosen, batch_size),
    )


def _plan_exact(
    active: Sequence[EnvWindow], batch_size: int, credits: Mapping[int, float], credits_now: dict[int, float]
) -> Plan | NoBatch:
    available = sum(_seqs(w.items) for w in active)
    if available < batch_size:
        return NoBatch(
            f"waiting for data: {available} of {batch_size} sequences queued", blocked=False, credits=dict(credits)
        )
    take = _prefix_fill(active, batch_size, credits_now) or _subset_fill(active, batch_size, credits_now)
    if take is None:
        sizes = sorted({m.seqs for w in active for m in w.items})
        shares = " while meeting the minimum allocations" if any(w.min_share for w in active) else ""
        if not shares and (more := arrival_that_fills([m.seqs for w in active for m in w.items], batch_size)):
            # Not a stall: groups of the sizes already seen can still end it (mixed sizes 6 and 8 fill 64).
            return NoBatch(
                f"waiting for data: queued group sizes {sizes} do not add up to exactly batch_size {batch_size} "
                f"yet; {more} would form a batch",
                blocked=False,
                credits=dict(credits),
            )
        return NoBatch(
            f"queued group sizes {sizes} cannot add up to exactly batch_size {batch_size}{shares}",
            blocked=True,
            credits=dict(credits),
        )
    return _plan_from(take, credits_now, batch_size)


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
            if s < need:
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
    active: Sequence[EnvWindow], batch_size: int, targets: Mapping[int, float]
) -> dict[int, list[ItemMeta]] | None:
    """Any items adding up to exactly batch_size with every minimum met, if such a choice exists at all.

    Used only when no FIFO-prefix combination exists (mixed group sizes within an env). Per env, a bitset
    of the subset sums its window can make (at least its minimum); envs combine by shifting bitsets. Each
    env's sum is then picked closest to its credit, and its items oldest first.
    """
    full = (1 << (batch_size + 1)) - 1
    per_env: list[tuple[EnvWindow, list[int], int]] = []  # window, per-item prefix reach, sums allowed
    combined = [1]  # combined[i]: totals reachable with the first i envs
    for w in active:
        reach = [1]
        for m in w.items:
            reach.append((reach[-1] | (reach[-1] << m.seqs)) & full)
        need = _required(w, batch_size)
        allowed = reach[-1] & ~((1 << need) - 1)
        per_env.append((w, reach, allowed))
        total = 0
        for s in _bits(allowed):
            total |= combined[-1] << s
        combined.append(total & full)
    if not (combined[-1] >> batch_size) & 1:
        return None
    take: dict[int, list[ItemMeta]] = {}
    remaining = batch_size
    for i in range(len(active) - 1, -1, -1):
        w, reach, allowed = per_env[i]
        options = [s for s in _bits(allowed) if s <= remaining and (combined[i] >> (remaining - s)) & 1]
        s = min(options, key=lambda x: (abs(x - targets.get(w.env_id, 0.0)), x))
        take[w.env_id] = _oldest_subset(w.items, reach, s)
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


def _oldest_subset(items: Sequence[ItemMeta], reach: Sequence[int], total: int) -> list[ItemMeta]:
    """Items adding up to `total`, preferring older ones: a later item is used only when needed."""
    picked: list[ItemMeta] = []
    for i in range(len(items), 0, -1):
        if (reach[i - 1] >> total) & 1:
            continue
        picked.append(items[i - 1])
        total -= items[i - 1].seqs
    return picked[::-1]


def _plan_tokens(
    active: Sequence[EnvWindow], spec: BatchSpec, credits: Mapping[int, float], credits_now: dict[int, float]
) -> Plan | NoBatch:
    """Greedy fill under both budgets. Released when it holds `batch_size` sequences, or at least
    `min_fill` of the token budget, or when every env's next item is too big to fit (FIFO: waiting cannot
    help). Otherwise it waits for more data."""
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
    if seqs > 0 and (full or stuck):
        return _plan_from(take, credits_now, spec.batch_size)
    return NoBatch(
        f"waiting for data: {tokens} of {budget_tokens} tokens ({seqs} sequences) fit so far",
        blocked=False,
        credits=dict(credits),
    )
