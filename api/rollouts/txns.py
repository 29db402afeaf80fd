"""The rollout routes' transactions (docs/rollouts.md): each one store transaction over
api/rollouts/groups.py's pure rules, reading the group's record, deciding with `now`, writing it back. The flow
object that calls them, one a route, is `Rollouts` (api/rollouts/service.py).

What they share is api/rollouts/rows.py; the turns' own transactions are api/rollouts/turn_txns.py.

A post is the hot one: it reads its group's row and its own slot's, and writes its slot's row and its group's
counters (`OpenGroupTxn.add_slot`), whatever G and however many slots are in; the record is rewritten by what
changes it (a lease, a heartbeat, a decision), and the seal reads the slots once, as stored
(api/rollouts/assembly.py)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from api.config.groups import built
from api.config.settings import Settings
from api.errors import Conflict, InvalidData, NotFound, Unavailable
from api.ingest.queue_limits import QueueLimits, group_limits
from api.ingest.submissions import group_key
from api.ledger import rules as ledger
from api.ledger.recorder import OFF, Recorder
from api.owners import ANYONE, Actor
from api.rollouts import checks, lineage
from api.rollouts import groups as rg
from api.rollouts.assembly import Part, sealed_body
from api.rollouts.rows import (
    BY_KEY,
    COUNTS,
    OPEN_DONE,
    OPEN_LEASED,
    UNREADABLE,
    check_holder,
    check_rows,
    group_of,
    put,
    readable,
    row_of,
    settled,
    tally,
    view,
)
from api.rollouts.turn_txns import after_turns, prefix_txn
from api.run import state
from api.run.state import RunState
from api.store.base import ANON_ENV, DROPPED, LedgerGroup, Txn
from api.store.rollouts import LIVE, GroupRow, SlotRow
from api.tasks import leases as task_leases
from api.tasks import tokens as task_tokens
from api.wire.records import encode
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


class OpenBytesFull(Unavailable):
    """A post past its env's `rollout_max_open_bytes`: the 503 undoes its transaction, so the flow counts it
    (`refused`) apart, as the ingest flow counts a full queue's refusals."""


def digest(post: RolloutPost) -> str:
    content: list[Any] = [post.tokens, post.masks, post.inference_logprobs, post.score]
    if post.policy_step is not None or post.overrides is not None:  # posts without them digest as before
        content += [post.policy_step, post.overrides]
    if post.token_weight_versions is not None:
        content.append(post.token_weight_versions)
    return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()


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
        return view(txn, old)
    run = state.load(txn, known)
    checks.check_open(req, group_limits(run, built(QueueLimits, settings) if limits is None else limits))
    env = None
    if req.env_id is not None:
        env = run.env(req.env_id)
        if env is None or caller.hides(env.owner, "env"):
            raise NotFound(f"env {req.env_id} is not registered", loc=("body", "env_id"))
    acknowledged = group_key(req.env_id, req.group_id)
    if acknowledged is not None and txn.get_reply(acknowledged) is not None:
        raise Conflict(
            f"a group of this env was acknowledged under id {req.group_id!r} already: its seal would be that group's "
            "duplicate; open this one under another id",
            loc=("body", "group_id"),
        )
    if task_tokens.is_token(req.group_id):
        task_leases.check_submission(txn, req.group_id, caller, req.producer_id, ("body",))
    mine = txn.get_counts(BY_KEY).get(caller.owner, 0) if caller.owner is not None else 0
    if mine >= settings.rollout_max_open_groups_per_key:
        raise Unavailable(f"this key has {mine} open groups; the limit is rollout_max_open_groups_per_key; retry later")
    if req.env_id is not None or caller.owner is None:  # a key's groups without an env: its own bound alone
        n, _ = txn.rollouts.open_totals(ANON_ENV if req.env_id is None else req.env_id)
        if n >= settings.rollout_max_open_groups:
            raise Unavailable(
                f"env {req.env_id} has {n} open groups; the limit is rollout_max_open_groups; retry later"
            )
    g = rg.OpenGroup(
        key=req.group_id,
        env_id=req.env_id,
        group_size=req.group_size,
        min_group_size=least,
        deadline=now + req.deadline_s,
        producer=req.producer_id,
        expires_at=now + settings.rollout_lease_s,
        scores_at_seal=req.scores_at_seal,
        task=req.task,
        owner=caller.owner,
    )
    row = row_of(g, "open", None)
    txn.rollouts.put(row)
    if env is not None and not env.opens_groups:  # whole groups of this env are checked against its open ones now
        state.save_env(txn, run, replace(env, opens_groups=True))
    txn.add_counts(COUNTS, {"opened": 1})
    if caller.owner is not None:
        txn.add_counts(BY_KEY, {caller.owner: 1})
    return view(txn, row)


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
    check_rows(req.tokens, req.masks, req.inference_logprobs)
    row = group_of(txn, req.group_id, caller)
    g = rg.OpenGroup.of(row.record)
    if req.slot >= g.group_size:
        raise Conflict(f"the group has {g.group_size} slots", loc=("body", "slot"))
    if req.after_turns:
        check_holder(txn, g, req.slot, req.producer_id)
        req = after_turns(txn, req)
    run = state.load(txn, known_run)
    group_limit = group_limits(run, built(QueueLimits, settings) if limits is None else limits)
    packed = checks.check_rollout(req, g.env_id, g.key, run.step, group_limit)
    d = digest(req)
    had = txn.rollouts.slot(req.group_id, req.slot)
    known = None if had is None else (had.producer, had.digest)
    if known is None and row.state not in LIVE:
        txn.add_counts(COUNTS, {"redone": 1})
        return PostReply(status="redone", group=view(txn, row, lean=True)), False
    outcome = rg.post(req.producer_id, known, d)
    if outcome == rg.CONFLICT:
        raise Conflict(f"slot {req.slot} of group {req.group_id!r} was acknowledged with other content")
    if outcome != rg.ACCEPTED:
        if outcome == rg.REDONE:
            txn.add_counts(COUNTS, {"redone": 1})
        return PostReply(status=outcome, group=view(txn, row, lean=True)), False
    summary = txn.rollouts.turn_summary(req.group_id, req.slot) if row.turn_tokens else None
    turned = 0 if summary is None else summary.tokens  # its turns' tokens: counted in the group's since acknowledged
    if group_limit.max_group_tokens is not None:  # only what is new may be refused: never what was acknowledged
        checks.check_group_tokens(row.tokens + row.turn_tokens, max(0, len(req.tokens) - turned), group_limit)
    data = encode(packed)
    _, size = txn.rollouts.open_totals(row.env_id)
    if size + len(data) > settings.rollout_max_open_bytes:
        raise OpenBytesFull(f"env {g.env_id}'s open groups hold {size} bytes; the limit is rollout_max_open_bytes")
    txn.rollouts.add_slot(
        SlotRow(req.group_id, req.slot, req.producer_id, d, data, len(req.tokens), req.score, req.policy_step),
        len(data),
    )
    leased = str(req.slot) in g.leases and row.state in LIVE  # a sibling's lease ends with its slot in
    txn.add_counts(
        COUNTS, {"slots": 1, **({OPEN_DONE: 1} if row.state in LIVE else {}), **({OPEN_LEASED: -1} if leased else {})}
    )
    row = replace(
        row,
        done=row.done + 1,
        tokens=row.tokens + len(req.tokens),
        bytes=row.bytes + len(data),
        turn_tokens=row.turn_tokens - turned,
    )
    if row.state == "open" and g.leases:
        row = _recheck(txn, row)
    sealing = False
    if row.state == "open" and row.done == g.group_size:  # deadlines are the sweep's: a post never expires its group
        slots = txn.rollouts.slots(req.group_id)
        scored = {s.slot for s in slots if s.score is not None}
        decision = rg.seal_decision(g, [s.slot for s in slots], now, scored)
        if not decision.wait:
            rg.settle(g, [s.slot for s in slots])
            new = _decide(txn, g, row, decision, now, books, slots)
            put(txn, row, (row.done, len(g.leases)), new, g)
            row, sealing = new, decision.expired is None
    return PostReply(status="accepted", group=view(txn, row, lean=True)), sealing


def _decide(
    txn: Txn, g: rg.OpenGroup, row: GroupRow, decision: rg.Seal, now: float, books: Recorder, slots: list[SlotRow]
) -> GroupRow:
    """Apply a seal decision: `sealing` with its slots chosen, or `expired` (counted, and in the ledger). `slots`:
    the group's, as read."""
    if decision.expired is not None:
        return _expire(txn, g, row, decision.expired, now, books, slots)
    g.left_out = {str(s): why for s, why in decision.left_out.items()}
    return row_of(g, "sealing", row, g.deadline)


def seal_txn(txn: Txn, req: SealRequest, now: float, caller: Actor = ANYONE) -> bool:
    """The producer seals its group (with the group's scores); whether there is a seal to finish."""
    row = group_of(txn, req.group_id, caller)
    if row.state != "open":
        return row.state == "sealing"
    g = rg.OpenGroup.of(row.record)
    slots = txn.rollouts.slots(g.key)
    done = [s.slot for s in slots]
    rg.settle(g, done)
    decision = rg.seal_decision(g, done, now, set(), by_producer=True)
    if decision.wait:
        raise Conflict(f"group {req.group_id!r} has {len(done)} rollouts; its min_group_size is {g.min_group_size}")
    if req.scores is not None:
        if set(req.scores) != {str(s) for s in done}:
            raise InvalidData(("body", "scores"), "one score per acknowledged slot")
        checks.check_seal_scores(req.scores)
        g.scores = dict(req.scores)
    elif g.scores_at_seal:
        raise InvalidData(("body", "scores"), "the group is scored at its seal: send its scores")
    else:
        unscored = [s.slot for s in slots if s.score is None]
        if unscored:
            raise InvalidData(("body", "scores"), f"slots {unscored} were posted without a score: send scores")
    before = tally(row, g)
    put(txn, row, before, _decide(txn, g, row, decision, now, OFF, slots), g)  # a producer's seal never expires it
    return True


def group_body(txn: Txn, key: str) -> bytes | None:
    """The sealed group as a binary POST /scored_data would carry it (None unless it is `sealing`): its slots'
    stored records concatenated (api/rollouts/assembly.py), none parsed again."""
    sealed = sealed_group(txn, key)
    return None if sealed is None else sealed[0]


def sealed_group(txn: Txn, key: str) -> tuple[bytes, ledger.Resumes | None] | None:
    """The sealed group's body (`group_body`) and the resumes of the slots it holds (`lineage.resumes`, for its
    ledger row): None unless it is `sealing`. Its record holds its lineage from its decision on."""
    row = txn.rollouts.get(key)
    if row is None or row.state != "sealing":
        return None
    g = rg.OpenGroup.of(row.record)
    slots = [s for s in txn.rollouts.slots(key) if str(s.slot) not in g.left_out]
    parts = [
        Part(
            s.data, g.scores[str(s.slot)] if g.scores else float(s.score if s.score is not None else 0.0), s.policy_step
        )
        for s in slots
    ]
    body = sealed_body(parts, env_id=g.env_id, group_id=key, producer_id=g.producer)
    return body, lineage.resumes(g.lineage, [s.slot for s in slots])


EXPIRED_PREFIX = "rollouts_"
"""An expired open group's ledger row and drop counter say why as this and its reason (`rollouts_too_few_by_deadline`,
`rollouts_unscored_by_deadline`, `rollouts_refused`)."""


def _expire(
    txn: Txn, g: rg.OpenGroup, row: GroupRow, why: str, now: float, books: Recorder, slots: list[SlotRow]
) -> GroupRow:
    """The group expires: counted, kept with why (until `rollout_keep_s` after now), and recorded as a dropped
    group (the ledger's row of its acknowledged rollouts, `slots`, the env's drop counter; a task lease's task
    follows, as for any dropped group)."""
    short = why.split(":")[0]
    g.left_out = {"group": why}
    txn.add_counts(COUNTS, {"expired": 1, f"expired:{short}": 1})
    run = state.load(txn)
    mean, lo, hi, std = ledger.score_summary([s.score for s in slots if s.score is not None])
    books.expired_open(
        txn,
        run.env_name(g.env_id),
        LedgerGroup(
            id=txn.next_item_id(),
            env_id=row.env_id,
            group_id=g.key,
            handler=None,
            producer_id=g.producer,
            acked_at=now,
            policy_step=run.step,
            seqs=len(slots),
            tokens=sum(s.tokens for s in slots),
            bytes=row.bytes,
            score_mean=mean,
            score_min=lo,
            score_max=hi,
            score_std=std,
            fate=DROPPED,
            step=run.step,
            reason=EXPIRED_PREFIX + short,
            decided_at=now,
        ),
    )
    return row_of(g, "expired", row, now)


def mark_txn(txn: Txn, key: str, refused: str | None, now: float, books: Recorder = OFF) -> None:
    """The sealed group was ingested (or refused, with why: expired): counted once."""
    row = txn.rollouts.get(key)
    if row is None or row.state != "sealing":
        return
    g = settled(txn, row)
    before = tally(row, g)
    if refused is not None:
        put(txn, row, before, _expire(txn, g, row, refused, now, books, txn.rollouts.slots(key)), g)
        return
    partial = len(g.left_out) > 0
    txn.add_counts(COUNTS, {"sealed": 1, "left_out": len(g.left_out), **({"sealed_partial": 1} if partial else {})})
    put(txn, row, before, row_of(g, "sealed", row, now), g)  # kept `rollout_keep_s` from now


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
            slots = txn.rollouts.slots(row.key)
            done = [s.slot for s in slots]
            rg.settle(g, done)
            before = tally(row, g)
            if g.scores_at_seal:
                decision = rg.Seal(expired=rg.UNSCORED if len(done) >= g.min_group_size else rg.TOO_FEW)
            else:
                decision = rg.seal_decision(g, done, now, {s.slot for s in slots if s.score is not None})
            if decision.wait:
                continue
            new = _decide(txn, g, row, decision, now, books, slots)  # reads the rollouts before it writes anything
        except UNREADABLE as exc:
            unreadable[row.key] = f"{type(exc).__name__}: {exc}"
            continue
        put(txn, row, before, new, g)
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
    budget = settings.rollout_max_prefix_reply_bytes  # over the reply: the slots' turns carried whole while they fit
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
        done = txn.rollouts.done(g.key)
        rg.settle(g, done)
        before = tally(row, g)
        lapsed += drop_lapsed(g, now)  # the sweep may not see them: a group with a slot nobody leases stays due
        slots = rg.missing(g, done, now)[: n - len(out)]
        rg.lease_slots(g, producer, slots, until)
        for s in slots:
            prefix, carried = prefix_txn(txn, g.key, s, budget)
            budget -= carried
            lineage.leased(g.lineage, s, None if prefix is None else prefix.tokens)
            if prefix is not None:
                txn.add_counts(COUNTS, {"resumed": 1, "tokens_carried": prefix.tokens})
            else:
                txn.add_counts(COUNTS, {"restarted": 1})
            out.append(
                SlotLease(
                    group_id=g.key,
                    slot=s,
                    env_id=g.env_id,
                    group_size=g.group_size,
                    task=g.task,
                    expires_at=until,
                    prefix=prefix,
                )
            )
        put(txn, row, before, row_of(g, row.state, row), g)  # due again at once while a missing slot is leased out
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
    """Drop the group's sibling leases that lapsed (their slots missing again: `g` settled); how many."""
    gone = [k for k, v in g.leases.items() if float(v[1]) <= now]
    for k in gone:
        del g.leases[k]
    return len(gone)


def _recheck(txn: Txn, row: GroupRow) -> GroupRow:
    """The open row with its next check (`expires_at`) as its missing slots' leases make it now. The sweep walks
    groups by next check and passes each one once, so a row whose next check moved must say so: a post that fills
    the last missing slot nobody leased (its next check becomes the soonest sibling lease's end, after the holder's
    lapse the walk passed), or the slot of the soonest lease. Only groups whose siblings hold leases pay for it."""
    at = rg.next_check(settled(txn, row), row.done)
    if at == row.expires_at:
        return row
    row = replace(row, expires_at=at)
    txn.rollouts.put(row)
    return row


def unlease_txn(txn: Txn, keys: list[str], now: float) -> int:
    """Drop the lapsed sibling leases of these open groups (counted `lease_lapsed`; the slots are missing again,
    for `lease_txn` to hand out): `slots_leased` counts leases that hold. How many it dropped."""
    dropped = 0
    for key in keys:
        row = txn.rollouts.get(key)
        if row is None or row.state != "open" or readable(row) is None:
            continue
        g = settled(txn, row)
        before = tally(row, g)
        if not (gone := drop_lapsed(g, now)):
            _recheck(txn, row)  # none lapsed yet: looked at again when the soonest one ends
            continue
        put(txn, row, before, row_of(g, row.state, row), g)  # next check: the holder's lapse, or a lease's end
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
        g = settled(txn, row)
        before = tally(row, g)
        mine = [k for k, v in g.leases.items() if v[0] == producer]
        if g.producer != producer and not mine:
            out[key] = None
            continue
        until = now + lease_s
        if g.producer == producer:
            g.expires_at = until
        for k in mine:
            g.leases[k][1] = until
        put(txn, row, before, row_of(g, row.state, row), g)
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
        open=counts["open"],
        slots_done=counts.get(OPEN_DONE, 0),
        slots_leased=counts.get(OPEN_LEASED, 0),
        redispatched=counts.get("redispatched", 0),
        sealed=counts.get("sealed", 0),
        expired=counts.get("expired", 0),
        resumed=counts.get("resumed", 0),
        restarted=counts.get("restarted", 0),
        tokens_saved=counts.get("tokens_carried", 0),
    )
