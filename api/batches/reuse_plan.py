"""Planning a batch with reuse (docs/replay.md): which groups served before may fill a batch that fresh groups
cannot. Pure functions over plain data; no I/O.

Fresh groups come first: the batch is planned from the fresh windows alone (`plan_batch`, as without reuse), and
when that plan is a batch of `batch_size` (or, with a token budget, a released one), it is the batch: reuse never
displaces a fresh group. Otherwise each env's window is extended, after its fresh items, with its reuse
candidates: those its policy still allows (served fewer than `max_served` times, within `max_age` steps of the
policy step that generated them, scores not all equal), in the policy's order, up to the policy's share of the
batch per env and the batch's share overall. The planner then plans over the extended windows as it plans over
fresh ones, so weights, credits and minimum shares hold over the whole batch (a reused group counts towards its
env's share as a fresh one does), and reused sequences never pass the shares: no more than them were offered.

The candidates arrive in each env's order (the store keeps them indexed by it), and are read only as far as the
shares allow and at most `SCAN_LIMIT` per env, so the cost grows with the batch, not with the pool.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from api.batches.planner import BatchSpec, EnvWindow, NoBatch, Plan, plan_batch
from api.store.items import ItemMeta
from api.wire.replay import ReuseOrder, ReusePolicy

SCAN_LIMIT = 1024
"""The most candidates one env's pool is read for a batch (eligible or not, fitting or not): what bounds the cost
of planning a batch with reuse whatever the pool's size. Past it the env offers what it found: a pool whose
first 1024 groups in its order hold nothing a batch may take (aged out, past their budget, too large for what is
left of the share) is one the store should prune, not one planning should walk."""


MISS_LIMIT = 32
"""Eligible candidates in a row too large for what is left of a share after which an env offers no more to this
batch: what is skipped never fits later (what is left only shrinks), and an env of one group size would otherwise
read on to `SCAN_LIMIT` for nothing."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A group served before and kept for reuse, as planning sees it (its payload stays in the store)."""

    meta: ItemMeta
    """Its item id (the one it was queued under: older groups have smaller ids), sequences, tokens and the policy
    step that generated it."""
    served: int
    """Batches it was served in so far (at least 1)."""
    advantage: float
    """max |score - the group's mean score|: its strongest GRPO signal (order `advantage`)."""
    spread: float
    """max score - min score (order `spread`); 0 when all its scores are equal: never reused."""


def candidate(meta: ItemMeta, served: int, scores: Sequence[float]) -> Candidate:
    """A group served `served` times as a reuse candidate, its orders' keys computed from its scores: the largest
    |score - mean| (the GRPO advantage the server computes) and max - min; a group whose scores are all equal has
    a spread of 0 and is never reused."""
    if not scores or min(scores) == max(scores):
        return Candidate(meta, served, 0.0, 0.0)
    mean = math.fsum(scores) / len(scores)
    return Candidate(meta, served, max(abs(x - mean) for x in scores), max(scores) - min(scores))


def order_key(order: ReuseOrder, c: Candidate) -> tuple[float, int]:
    """How candidates sort under `order` (smallest first); ties go to the group queued first."""
    if order == "advantage":
        return (-c.advantage, c.meta.item_id)
    if order == "spread":
        return (-c.spread, c.meta.item_id)
    if order == "recent":
        return (-float(c.meta.policy_step), c.meta.item_id)
    return (float(c.meta.policy_step), c.meta.item_id)


def eligible(c: Candidate, policy: ReusePolicy, step: int) -> bool:
    """Whether batch `step` may serve `c` again: its policy's budget and age limit allow it, and it has a learning
    signal (a group whose scores are all equal teaches GRPO nothing, however often it is served)."""
    if c.served >= policy.max_served or c.spread <= 0.0:
        return False
    return policy.max_age is None or step - c.meta.policy_step <= policy.max_age


def share_seqs(share: float, batch_size: int) -> int:
    """The sequences a share of a batch allows reused groups (rounded down: a share is a largest share)."""
    return math.floor(share * batch_size + 1e-9)


def offer(
    pools: Mapping[int, Iterable[Candidate]],
    policies: Mapping[int, ReusePolicy],
    weights: Mapping[int, float],
    total: int,
    batch_size: int,
    step: int,
) -> dict[int, list[Candidate]]:
    """The candidates offered to the planner, per env: each env's eligible candidates in its order (`pools`
    yields them so), as many as its policy's share allows, and together at most `total` sequences. Where the
    batch's share cannot hold every env's offer, envs are offered one candidate at a time, the env with the
    fewest sequences offered for its weight first, so the offer follows the weights."""
    caps = {env: share_seqs(policies[env].max_reused_share, batch_size) for env in pools if env in policies}
    streams = {env: _eligible(pools[env], policies[env], step) for env, cap in caps.items() if cap > 0}
    out: dict[int, list[Candidate]] = {env: [] for env in streams}
    offered = dict.fromkeys(streams, 0)
    heads: dict[int, Candidate] = {}
    left = total
    while streams and left > 0:
        for env in list(streams):  # each env's next candidate that still fits (what does not, never will)
            room = min(caps[env] - offered[env], left)
            head = heads.pop(env, None)
            if room <= 0:
                head = None
            elif head is None or head.meta.seqs > room:
                head = _next_fitting(streams[env], room)
            if head is None:
                del streams[env]
            else:
                heads[env] = head
        if not streams:
            break
        env = min(streams, key=lambda e: (offered[e] / max(weights.get(e, 1.0), 1e-12), e))
        c = heads.pop(env)
        out[env].append(c)
        offered[env] += c.meta.seqs
        left -= c.meta.seqs
    return {env: cs for env, cs in out.items() if cs}


def _next_fitting(stream: Iterator[Candidate], room: int) -> Candidate | None:
    """The stream's next candidate of at most `room` sequences; None once it ends, or after `MISS_LIMIT` larger ones
    in a row (an env of one group size has nothing smaller further on)."""
    for misses, c in enumerate(stream):
        if c.meta.seqs <= room:
            return c
        if misses + 1 >= MISS_LIMIT:
            return None
    return None


def _eligible(pool: Iterable[Candidate], policy: ReusePolicy, step: int) -> Iterator[Candidate]:
    """The pool's eligible candidates among its first `SCAN_LIMIT`."""
    return (c for c in itertools.islice(pool, SCAN_LIMIT) if eligible(c, policy, step))


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """A batch's plan and which of its groups are reused: each with the serve it is (its k-th), for its ledger
    row and the batch's fields."""

    plan: Plan
    reused: dict[int, int]
    """Item id of each reused group taken: the serve this is (2 for its first reuse)."""


def plan_with_reuse(
    windows: Sequence[EnvWindow],
    spec: BatchSpec,
    credits: Mapping[int, float],
    pools: Mapping[int, Iterable[Candidate]],
    policies: Mapping[int, ReusePolicy],
    batch_share: float,
    step: int,
    **how: bool,
) -> ReusePlan | NoBatch:
    """The batch from fresh `windows` and, where they cannot make one, reused groups (the module's docstring).
    `windows`: one per env that may take part, an env with reuse to offer and nothing queued included (with no
    items). `pools`: each env's candidates in its policy's order (an env without a window is not offered);
    `policies`: each env's policy (an env without one is
    never reused); `batch_share`: the largest share of the batch all reused groups together may take. `how`:
    `plan_batch`'s keywords, passed to both plans."""
    fresh = plan_batch(windows, spec, credits, **how)
    if isinstance(fresh, Plan) and not fresh.smaller:
        return ReusePlan(fresh, {})
    weights = {w.env_id: w.weight for w in windows}
    pools = {env: pool for env, pool in pools.items() if env in weights}
    offers = offer(pools, policies, weights, share_seqs(batch_share, spec.batch_size), spec.batch_size, step)
    if not offers:
        return fresh if isinstance(fresh, NoBatch) else ReusePlan(fresh, {})
    extended = _extend(windows, offers)
    plan = plan_batch(extended, spec, credits, **how)
    serves = {c.meta.item_id: c.served + 1 for cs in offers.values() for c in cs}
    taken = {i for ids in plan.take.values() for i in ids} if isinstance(plan, Plan) else set()
    # Reuse serves a batch only where it fills one (a smaller batch only where fresh groups alone made a smaller
    # one, and then a fuller one): where fresh groups wait for more, reuse that fills no batch does not end the wait.
    fuller = isinstance(plan, Plan) and (not plan.smaller or (isinstance(fresh, Plan) and plan.seqs > fresh.seqs))
    if not isinstance(plan, Plan) or not fuller or not taken & serves.keys():
        return fresh if isinstance(fresh, NoBatch) else ReusePlan(fresh, {})
    # A reused group is never the head of its env's queue: no fresh group counts as passed over for it.
    passed = {env: i for env, i in plan.passed_over.items() if i not in serves}
    plan = dataclasses.replace(plan, passed_over=passed)
    return ReusePlan(plan, {i: k for i, k in serves.items() if i in taken})


def _extend(windows: Sequence[EnvWindow], offers: Mapping[int, Sequence[Candidate]]) -> list[EnvWindow]:
    """Each env's window with its offered candidates after its fresh items (`due` holds for a fresh head only)."""
    out = []
    for w in windows:
        extra = [c.meta for c in offers.get(w.env_id, ())]
        out.append(dataclasses.replace(w, items=[*w.items, *extra], due=w.due and bool(w.items)))
    return out
