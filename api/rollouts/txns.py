"""The rollout routes' transactions (docs/rollouts.md): each one store transaction over
api/rollouts/groups.py's pure rules, reading the group's record, deciding with `now`, writing it back. The flow
object that calls them, one a route, is `Rollouts` (api/rollouts/service.py)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from api.config.groups import built
from api.config.settings import Settings
from api.errors import Conflict, InvalidData, NotFound, Unavailable
from api.ingest.queue_limits import QueueLimits, group_limits
from api.ledger import rules as ledger
from api.ledger.recorder import OFF, Recorder
from api.owners import ANYONE, Actor
from api.rollouts import checks
from api.rollouts import groups as rg
from api.run import state
from api.run.state import RunState
from api.store.base import ANON_ENV, DROPPED, LedgerGroup, Txn
from api.store.rollouts import LIVE, GroupRow, SlotRow
from api.tasks import leases as task_leases
from api.wire.rollouts import (
    GroupView,
    OpenGroupsStatus,
    OpenRequest,
    PostReply,
    RolloutPost,
    SealRequest,
    SlotLease,
)

log = logging.getLogger("rollbuf")


COUNTS = "rollouts"
"""Counter kind: opened, sealed, sealed_partial, expired, slots, left_out, redispatched, redone, refused,
lease_lapsed, pruned."""


UNREADABLE = (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError)
"""What reading a group this release cannot read raises (a record or a rollout written by another release, or
damaged): what touches many groups at once (the sweep, sibling leases, heartbeats) passes such a group by instead of
failing for all of them."""


def readable(row: GroupRow) -> rg.OpenGroup | None:
    """The row's group, or None if this release cannot read it (`UNREADABLE`)."""
    try:
        return rg.OpenGroup.of(row.record)
    except UNREADABLE:
        return None


def _row(g: rg.OpenGroup, state_: str, size: int, expires_at: float | None = None) -> GroupRow:
    env_id = ANON_ENV if g.env_id is None else g.env_id
    at = rg.next_check(g) if expires_at is None else expires_at
    return GroupRow(g.key, env_id, state_, g.deadline, at, size, g.to_json())


OPEN_DONE, OPEN_LEASED = "open_slots_done", "open_slots_leased"
"""Counters kept as the groups change: slots acknowledged in live groups, and missing slots of live groups leased
to a sibling (a lapsed sibling lease stops counting at the first sweep after its lapse, `unlease`), so that the
views read them without a scan of the open groups."""


def _tally(row: GroupRow | None) -> tuple[int, int]:
    """(slots done, slots leased to siblings) of a live group; nothing for a decided one."""
    if row is None or row.state not in LIVE:
        return 0, 0
    g = rg.OpenGroup.of(row.record)
    return len(g.done), sum(1 for k in g.leases if k not in g.done)


def _put(txn: Txn, old: GroupRow | None, new: GroupRow) -> None:
    """Write the group's row, and move the open-slot counters (and its key's live groups, once decided) by what
    changed."""
    txn.rollouts.put(new)
    (done0, leased0), (done1, leased1) = _tally(old), _tally(new)
    moved = {OPEN_DONE: done1 - done0, OPEN_LEASED: leased1 - leased0}
    if any(moved.values()):
        txn.add_counts(COUNTS, {k: n for k, n in moved.items() if n})
    if old is not None and old.state in LIVE and new.state not in LIVE:
        owner = rg.OpenGroup.of(new.record).owner
        if owner is not None and txn.get_counts(BY_KEY).get(owner, 0) > 0:  # > 0: not one opened before counting
            txn.add_counts(BY_KEY, {owner: -1})


BY_KEY = "rollouts_by_key"
"""Counter kind: the live open groups of each key (by its name), moved as they open and are decided, so that a
key's bound (`rollout_max_open_groups_per_key`) costs one read."""


def view(row: GroupRow) -> GroupView:
    g = rg.OpenGroup.of(row.record)
    return GroupView(
        group_id=g.key, env_id=g.env_id, state=row.state, group_size=g.group_size,
        min_group_size=g.min_group_size, producer=g.producer, deadline=g.deadline, expires_at=g.expires_at,
        done=sorted(int(s) for s in g.done), leased={k: str(v[0]) for k, v in g.leases.items() if k not in g.done},
        redispatched=g.redispatched, left_out=dict(g.left_out),
    )  # fmt: skip


def digest(post: RolloutPost) -> str:
    content: list[Any] = [post.tokens, post.masks, post.inference_logprobs, post.score]
    if post.policy_step is not None or post.overrides is not None:  # posts without them digest as before
        content += [post.policy_step, post.overrides]
    return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()


def group_of(txn: Txn, key: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "group_id")) -> GroupRow:
    """The open group `actor` acts on: 404 if none was opened under `key`, or it is another key's (alike)."""
    row = txn.rollouts.get(key)
    unknown = NotFound(f"no group {key!r} was opened", loc=loc)
    if row is None:
        raise unknown
    actor.check(rg.OpenGroup.of(row.record).owner, "open_group", unknown)
    return row


def open_txn(
    txn: Txn,
    req: OpenRequest,
    now: float,
    settings: Settings,
    caller: Actor = ANYONE,
    *,
    limits: QueueLimits | None = None,
    known: RunState | None = None,
) -> GroupView:
    """Open the group (the same spec again: its view); 409 for another spec under its id or another key's group
    of that id, 404 for an env unknown to the key, 503 past the env's or the key's bound on open groups or before a
    trainer registered. Nothing acknowledged is refused later, so what its sealed group will be held to is checked
    now (`checks.check_open`: G within the trainer's batch, `limits` the server's own, default from `settings`),
    and a group opened under a task lease token must be its holder's, as its sealed group will be. `known`: the
    run state this process read last."""
    if req.deadline_s > settings.rollout_max_deadline_s:
        raise InvalidData(("body", "deadline_s"), f"at most rollout_max_deadline_s ({settings.rollout_max_deadline_s})")
    least = req.group_size if req.min_group_size is None else req.min_group_size
    if least > req.group_size:
        raise InvalidData(("body", "min_group_size"), "at most group_size")
    old = txn.rollouts.get(req.group_id)
    if old is not None:
        g = rg.OpenGroup.of(old.record)
        if caller.hides(g.owner, "open_group"):
            raise Conflict(f"the group id {req.group_id!r} is another key's: choose another", loc=("body", "group_id"))
        if (g.env_id, g.group_size, g.min_group_size, g.scores_at_seal, g.task) != (
            req.env_id,
            req.group_size,
            least,
            req.scores_at_seal,
            req.task,
        ):
            raise Conflict(f"group {req.group_id!r} was opened before with another spec")
        return view(old)
    run = state.load(txn, known)
    checks.check_open(req, group_limits(run, built(QueueLimits, settings) if limits is None else limits))
    if req.env_id is not None:
        env = run.env(req.env_id)
        if env is None or caller.hides(env.owner, "env"):
            raise NotFound(f"env {req.env_id} is not registered", loc=("body", "env_id"))
    if task_leases.is_token(req.group_id):
        task_leases.check_submission(txn, req.group_id, caller, req.producer_id, ("body",))
    mine = txn.get_counts(BY_KEY).get(caller.owner, 0) if caller.owner is not None else 0
    if mine >= settings.rollout_max_open_groups_per_key:
        raise Unavailable(f"this key has {mine} open groups; the limit is rollout_max_open_groups_per_key; retry later")
    if req.env_id is not None or caller.owner is None:  # a key's groups without an env: its own bound alone
        n, _ = txn.rollouts.open_totals(ANON_ENV if req.env_id is None else req.env_id)
        if n >= settings.rollout_max_open_groups:
            raise Unavailable(f"env {req.env_id} has {n} open groups; the limit is rollout_max_open_groups; retry "
                              "later")  # fmt: skip
    g = rg.OpenGroup(
        key=req.group_id, env_id=req.env_id, group_size=req.group_size, min_group_size=least,
        deadline=now + req.deadline_s, producer=req.producer_id, expires_at=now + settings.rollout_lease_s,
        scores_at_seal=req.scores_at_seal, task=req.task, owner=caller.owner,
    )  # fmt: skip
    row = _row(g, "open", 0)
    txn.rollouts.put(row)
    txn.add_counts(COUNTS, {"opened": 1})
    if caller.owner is not None:
        txn.add_counts(BY_KEY, {caller.owner: 1})
    return view(row)


def post_txn(
    txn: Txn,
    req: RolloutPost,
    now: float,
    settings: Settings,
    books: Recorder = OFF,
    caller: Actor = ANYONE,
    *,
    limits: QueueLimits | None = None,
    known_run: RunState | None = None,
) -> tuple[PostReply, bool]:
    """Acknowledge one rollout; whether the group is now complete and is being sealed. The rollout is checked first
    against every rule its sealed group meets at ingest (`checks.check_rollout`; 503 before a trainer registered),
    so that no rollout acknowledged is refused with its group. `limits` and `known_run` as for `open_txn`."""
    if len(req.masks) != len(req.tokens):
        raise InvalidData(("body", "masks"), "one mask per token")
    if req.inference_logprobs is not None and len(req.inference_logprobs) != len(req.tokens):
        raise InvalidData(("body", "inference_logprobs"), "one logprob per token")
    row = group_of(txn, req.group_id, caller)
    first = row
    g = rg.OpenGroup.of(row.record)
    if req.slot >= g.group_size:
        raise Conflict(f"the group has {g.group_size} slots", loc=("body", "slot"))
    run = state.load(txn, known_run)
    group_limit = group_limits(run, built(QueueLimits, settings) if limits is None else limits)
    checks.check_rollout(req, g.env_id, g.key, run.step, group_limit)
    d = digest(req)
    slots = txn.rollouts.slots(req.group_id)
    known = next(((s.producer, s.digest) for s in slots if s.slot == req.slot), None)
    if known is None and row.state not in LIVE:
        txn.add_counts(COUNTS, {"redone": 1})
        return PostReply(status="redone", group=view(row)), False
    if known is None and (group_limit.max_group_tokens is not None or g.tokens is not None):
        have = g.tokens if g.tokens is not None else sum(len(json.loads(s.data)["tokens"]) for s in slots)
        checks.check_group_tokens(have, len(req.tokens), group_limit)
        g.tokens = have + len(req.tokens)
    outcome = rg.post(g, req.slot, req.producer_id, known, d)
    if outcome == rg.CONFLICT:
        raise Conflict(f"slot {req.slot} of group {req.group_id!r} was acknowledged with other content")
    if outcome != rg.ACCEPTED:
        if outcome == rg.REDONE:
            txn.add_counts(COUNTS, {"redone": 1})
        return PostReply(status=outcome, group=view(row)), False
    data = req.model_dump_json(include={"tokens", "masks", "inference_logprobs", "score", "policy_step", "overrides"})
    _, size = txn.rollouts.open_totals(row.env_id)
    if size + len(data) > settings.rollout_max_open_bytes:
        txn.add_counts(COUNTS, {"refused": 1})
        raise Unavailable(f"env {g.env_id}'s open groups hold {size} bytes; the limit is rollout_max_open_bytes")
    txn.rollouts.put_slot(SlotRow(req.group_id, req.slot, req.producer_id, d, data))
    txn.add_counts(COUNTS, {"slots": 1})
    row = _row(g, row.state, row.bytes + len(data))
    sealing = False
    if row.state == "open" and rg.complete(g):  # deadlines are the sweep's: a post never expires its own group
        scored = {s.slot for s in txn.rollouts.slots(req.group_id) if json.loads(s.data)["score"] is not None}
        decision = rg.seal_decision(g, now, scored)
        if not decision.wait:
            row, sealing = _decide(txn, g, row, decision, now, books), decision.expired is None
    _put(txn, first, row)
    return PostReply(status="accepted", group=view(row)), sealing


def _decide(txn: Txn, g: rg.OpenGroup, row: GroupRow, decision: rg.Seal, now: float, books: Recorder) -> GroupRow:
    """Apply a seal decision: `sealing` with its slots chosen, or `expired` (counted, and in the ledger)."""
    if decision.expired is not None:
        return _expire(txn, g, row, decision.expired, now, books)
    g.left_out = {str(s): why for s, why in decision.left_out.items()}
    return _row(g, "sealing", row.bytes, g.deadline)


def seal_txn(txn: Txn, req: SealRequest, now: float, caller: Actor = ANYONE) -> bool:
    """The producer seals its group (with the group's scores); whether there is a seal to finish."""
    row = group_of(txn, req.group_id, caller)
    if row.state != "open":
        return row.state == "sealing"
    g = rg.OpenGroup.of(row.record)
    decision = rg.seal_decision(g, now, set(), by_producer=True)
    if decision.wait:
        raise Conflict(f"group {req.group_id!r} has {len(g.done)} rollouts; its min_group_size is {g.min_group_size}")
    if req.scores is not None:
        if set(req.scores) != set(g.done):
            raise InvalidData(("body", "scores"), "one score per acknowledged slot")
        checks.check_seal_scores(req.scores)
        g.scores = dict(req.scores)
    elif g.scores_at_seal:
        raise InvalidData(("body", "scores"), "the group is scored at its seal: send its scores")
    else:
        unscored = [s.slot for s in txn.rollouts.slots(g.key) if json.loads(s.data)["score"] is None]
        if unscored:
            raise InvalidData(("body", "scores"), f"slots {unscored} were posted without a score: send scores")
    _put(txn, row, _decide(txn, g, row, decision, now, OFF))  # a producer's seal never expires the group
    return True


def group_body(txn: Txn, key: str) -> bytes | None:
    """The sealed group as POST /scored_data would carry it (None unless it is `sealing`)."""
    row = txn.rollouts.get(key)
    if row is None or row.state != "sealing":
        return None
    g = rg.OpenGroup.of(row.record)
    rollouts = [(s.slot, json.loads(s.data)) for s in txn.rollouts.slots(key) if str(s.slot) not in g.left_out]
    body: dict[str, Any] = {
        "tokens": [r["tokens"] for _, r in rollouts],
        "masks": [r["masks"] for _, r in rollouts],
        "scores": [g.scores[str(s)] if g.scores else r["score"] for s, r in rollouts],
        "env_id": g.env_id,
        "group_id": key,
        "producer_id": g.producer,
    }
    if all(r.get("inference_logprobs") is not None for _, r in rollouts):
        body["inference_logprobs"] = [r["inference_logprobs"] for _, r in rollouts]
    steps = [r["policy_step"] for _, r in rollouts if r.get("policy_step") is not None]
    if steps:  # staleness counts from the oldest weights in the group
        body["policy_step"] = min(steps)
    if any(r.get("overrides") is not None for _, r in rollouts):
        body["overrides"] = [r.get("overrides") or {} for _, r in rollouts]
    return json.dumps(body, separators=(",", ":")).encode()


EXPIRED_PREFIX = "rollouts_"
"""An expired open group's ledger row and drop counter say why as this and its reason (`rollouts_too_few_by_deadline`,
`rollouts_unscored_by_deadline`, `rollouts_refused`)."""


def _expire(txn: Txn, g: rg.OpenGroup, row: GroupRow, why: str, now: float, books: Recorder) -> GroupRow:
    """The group expires: counted, kept with why (until `rollout_keep_s` after now), and recorded as a dropped
    group (the ledger's row of its acknowledged rollouts, the env's drop counter; a task lease's task follows, as
    for any dropped group)."""
    slots = [json.loads(s.data) for s in txn.rollouts.slots(g.key)]  # read before anything is written
    short = why.split(":")[0]
    g.left_out = {"group": why}
    txn.add_counts(COUNTS, {"expired": 1, f"expired:{short}": 1})
    run = state.load(txn)
    mean, lo, hi, std = ledger.score_summary([r["score"] for r in slots if r["score"] is not None])
    books.expired_open(txn, run.env_name(g.env_id), LedgerGroup(
        id=txn.next_item_id(), env_id=row.env_id, group_id=g.key, handler=None, producer_id=g.producer,
        acked_at=now, policy_step=run.step, seqs=len(slots), tokens=sum(len(r["tokens"]) for r in slots),
        bytes=row.bytes, score_mean=mean, score_min=lo, score_max=hi, score_std=std, fate=DROPPED, step=run.step,
        reason=EXPIRED_PREFIX + short, decided_at=now,
    ))  # fmt: skip
    return _row(g, "expired", row.bytes, now)


def mark_txn(txn: Txn, key: str, refused: str | None, now: float, books: Recorder = OFF) -> None:
    """The sealed group was ingested (or refused, with why: expired): counted once."""
    row = txn.rollouts.get(key)
    if row is None or row.state != "sealing":
        return
    g = rg.OpenGroup.of(row.record)
    if refused is not None:
        _put(txn, row, _expire(txn, g, row, refused, now, books))
        return
    partial = len(g.left_out) > 0
    txn.add_counts(COUNTS, {"sealed": 1, "left_out": len(g.left_out), **({"sealed_partial": 1} if partial else {})})
    _put(txn, row, _row(g, "sealed", row.bytes, now))  # kept `rollout_keep_s` from now


@dataclass(frozen=True, slots=True)
class Swept:
    decided: int
    """Open groups the sweep sealed or expired (a `sealing` one it only finishes again is not counted: a full
    queue keeps it so, and a job that ran again at once for it would spin)."""
    sealing: list[str]
    """The keys of the groups to finish (ingest and mark sealed)."""
    unreadable: dict[str, str] = field(default_factory=dict)
    """Due groups it could not read (key -> why): left as they are (`UNREADABLE`)."""


def sweep_txn(txn: Txn, now: float, limit: int, books: Recorder = OFF, skip: Collection[str] = ()) -> Swept:
    """Decide on the groups past their deadline (sealed with what is in, or expired), and what to finish. The
    groups in `skip` (this process could not finish them before) are read past; a group it cannot read is left
    as it is and reported (`Swept.unreadable`), and the sweep goes on with the others."""
    out, decided, unreadable = [], 0, {}
    for row in txn.rollouts.due(now, limit + len(skip)):  # skipped groups stay due: read past them
        if row.key in skip:
            continue
        if row.state == "sealing":
            out.append(row.key)
            continue
        try:
            g = rg.OpenGroup.of(row.record)
            if g.scores_at_seal:
                decision = rg.Seal(expired=rg.UNSCORED if len(g.done) >= g.min_group_size else rg.TOO_FEW)
            else:
                scored = {s.slot for s in txn.rollouts.slots(row.key) if json.loads(s.data)["score"] is not None}
                decision = rg.seal_decision(g, now, scored)
            if decision.wait:
                continue
            new = _decide(txn, g, row, decision, now, books)  # reads the rollouts before it writes anything
        except UNREADABLE as exc:
            unreadable[row.key] = f"{type(exc).__name__}: {exc}"
            continue
        _put(txn, row, new)
        decided += 1
        if new.state == "sealing":
            out.append(row.key)
    return Swept(decided, out, unreadable)


def lease_txn(
    txn: Txn,
    producer: str,
    n: int,
    now: float,
    settings: Settings,
    envs: list[str] | None = None,
    caller: Actor = ANYONE,
) -> list[SlotLease]:
    """Lease up to `n` missing slots of groups whose holder lapsed (counted as redispatched); with `envs`, of
    groups of the envs registered under these names only (each producer registers its own env of a name: the
    name is what a group's siblings share), so that a producer never takes a slot it cannot roll out."""
    out: list[SlotLease] = []
    until = now + settings.rollout_lease_s
    lapsed = 0
    ids = None
    if envs is not None:
        names = set(envs)
        ids = [e.env_id for e in state.load(txn).envs if e.desired_name in names]
        if not ids:
            return out
    for row in txn.rollouts.lapsed(now, settings.rollout_sweep_limit, ids):
        if len(out) >= n:
            break
        g = readable(row)
        if g is None:
            continue  # a group this release cannot read: the sweep logs it
        if not caller.may(g.owner):
            continue  # another key's group: its slots are its own producers' to redo
        lapsed += drop_lapsed(g, now)  # the sweep may not see them: a group with a slot nobody leases stays due
        slots = rg.missing(g, now)[: n - len(out)]
        rg.lease_slots(g, producer, slots, until)
        out += [SlotLease(group_id=g.key, slot=s, env_id=g.env_id, group_size=g.group_size, task=g.task,
                          expires_at=until) for s in slots]  # fmt: skip
        _put(txn, row, _row(g, row.state, row.bytes))  # due again at once while a missing slot is leased to nobody
        if slots:
            txn.add_counts(COUNTS, {"redispatched": len(slots)})
    if lapsed:
        txn.add_counts(COUNTS, {"lease_lapsed": lapsed})
    return out


SIBLINGS_DUE_GROUPS = 16
"""Open groups a heartbeat's `siblings_due_in` looks at (the soonest due): one indexed read of a few rows."""


def siblings_due_txn(
    txn: Txn, envs: Collection[str], now: float, horizon: float, caller: Actor = ANYONE, known: RunState | None = None
) -> float:
    """Seconds until `lease_txn` may give a slot of a group of the envs registered under these names: 0 when it
    may now, `horizon` when no open group of them is due before then. What a producer's heartbeat answers, so
    that it leases only when a sibling's group lapses (or is about to) instead of polling: an idle producer costs
    its heartbeat alone. Another key's groups are left out, as the lease leaves them."""
    names = set(envs)
    ids = [e.env_id for e in state.load(txn, known).envs if e.desired_name in names]
    for row in txn.rollouts.lapsed(now + horizon, SIBLINGS_DUE_GROUPS, ids):
        g = readable(row)
        if g is not None and caller.may(g.owner):
            return max(0.0, min(horizon, row.expires_at - now))  # soonest first: a missing slot or its next check
    return horizon


def drop_lapsed(g: rg.OpenGroup, now: float) -> int:
    """Drop the group's sibling leases that lapsed (their slots missing again); how many."""
    gone = [k for k, v in g.leases.items() if k not in g.done and float(v[1]) <= now]
    for k in gone:
        del g.leases[k]
    return len(gone)


def unlease_txn(txn: Txn, keys: list[str], now: float) -> int:
    """Drop the lapsed sibling leases of these open groups (counted `lease_lapsed`; the slots are missing again,
    for `lease_txn` to hand out): `slots_leased` counts leases that hold. How many it dropped."""
    dropped = 0
    for key in keys:
        row = txn.rollouts.get(key)
        if row is None or row.state != "open" or (g := readable(row)) is None:
            continue
        if not (gone := drop_lapsed(g, now)):
            continue
        _put(txn, row, _row(g, row.state, row.bytes))  # its next check: the holder's lapse, or the next lease's end
        dropped += gone
    if dropped:
        txn.add_counts(COUNTS, {"lease_lapsed": dropped})
    return dropped


def prune_txn(txn: Txn, before: float, limit: int) -> int:
    """Delete up to `limit` sealed or expired groups decided at or before `before`, with their slots (counted as
    pruned); the views' counters are untouched (a decided group counts in none of the open ones)."""
    keys = txn.rollouts.decided(before, limit)
    if keys:
        txn.rollouts.delete(keys)
        txn.add_counts(COUNTS, {"pruned": len(keys)})
    return len(keys)


def heartbeat_txn(
    txn: Txn, producer: str, keys: list[str], now: float, lease_s: float, caller: Actor = ANYONE
) -> dict[str, float | None]:
    """Extend what `producer` holds of these groups; per group, the new expiry or None where it holds nothing
    (the group decided, not its own nor leased to it, another key's: alike)."""
    out: dict[str, float | None] = {}
    for key in keys:
        row = txn.rollouts.get(key)
        if row is None or row.state != "open" or (g := readable(row)) is None:
            out[key] = None
            continue
        if caller.hides(g.owner, "open_group"):
            out[key] = None
            continue
        mine = [k for k, v in g.leases.items() if v[0] == producer and k not in g.done]
        if g.producer != producer and not mine:
            out[key] = None
            continue
        until = now + lease_s
        if g.producer == producer:
            g.expires_at = until
        for k in mine:
            g.leases[k][1] = until
        txn.rollouts.put(_row(g, row.state, row.bytes))
        out[key] = until
    return out


def totals_txn(txn: Txn) -> dict[str, int]:
    """The counters, with the groups open now (opened less sealed and expired)."""
    counts = txn.get_counts(COUNTS)
    counts["open"] = counts.get("opened", 0) - counts.get("sealed", 0) - counts.get("expired", 0)
    return counts


def open_groups_txn(txn: Txn) -> OpenGroupsStatus | None:
    """The views' block (/status, the dashboard): None in runs that never opened a group. Counters only."""
    counts = totals_txn(txn)
    if not counts.get("opened"):
        return None
    return OpenGroupsStatus(
        open=counts["open"], slots_done=counts.get(OPEN_DONE, 0), slots_leased=counts.get(OPEN_LEASED, 0),
        redispatched=counts.get("redispatched", 0), sealed=counts.get("sealed", 0), expired=counts.get("expired", 0),
    )  # fmt: skip
