"""Storing validated submissions, inside one store transaction: the checks that must see the store (the run
still what validation saw, keys not reused with other content, room in the queue), then each group queued,
held aside or dropped by the filters, and counted. Written once over `Txn`, for every store."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from api.errors import Conflict, InvalidData, Unavailable
from api.ingest import side_buffer
from api.ingest.idempotency import remember, same_content
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import Submission
from api.ingest.validation import check_policy_step, check_versions_step
from api.ledger.recorder import OFF, Recorder
from api.owners import ANYONE, Actor
from api.run import state, stats
from api.run.filters import filter_reason
from api.run.state import ANON_NAME, EnvRecord, RunState
from api.store.base import ANON_ENV, HELD, QUEUED, HeldGroup, HeldMeta, ItemMeta, QueueCounts, QueuedItem, Txn
from api.store.rollouts import LIVE
from api.tasks import leases as task_leases
from api.tasks import tokens as task_tokens
from api.wire.schema import ScoredReply


class QueueFull(Unavailable):
    """A queue limit refused a submission (counted as backpressure per env, in its own transaction)."""


class StaleRun(Exception):
    """What a submission was validated against no longer holds in the store (the trainer re-registered, the
    data was reset, the step moved under a group stamped with it): validate it again against `run`."""

    def __init__(self, run: RunState) -> None:
        super().__init__("the run changed since this submission was validated")
        self.run = run


VALIDATION_ROUNDS = 3
"""Times a submission is validated against a newer run state before the client is asked to send it again."""


def submit_txn(
    txn: Txn,
    subs: Sequence[Submission],
    seen_run: RunState,
    limits: QueueLimits,
    books: Recorder = OFF,
    caller: Actor = ANYONE,
) -> tuple[list[ScoredReply], RunState]:
    """Store validated submissions all-or-nothing, with the run state found: `StaleRun` if what they were
    validated against (`seen_run`) no longer holds, `QueueFull` past a limit, a 409 for a reused key with
    other content, a group under a task lease that is not its lease's submission refused (`check_submission`).
    A key already stored answers its first reply, marked `duplicate`. `books` records each new group's fate in
    the ledger (the ledger names `caller`'s key)."""
    run = state.load(txn, seen_run)
    if not still_valid(subs, seen_run, run):
        raise StaleRun(run)
    for sub in subs:  # against the step now, not the snapshot's: it may have moved since
        try:
            check_policy_step(sub.sent_policy_step, run.step)
            check_versions_step(sub.record, run.step)
        except InvalidData as exc:
            raise exc.at(*sub.loc) from None
    now = time.time()
    replies: list[ScoredReply | None] = []
    fresh: list[tuple[int, Submission]] = []
    first_in_request: dict[str, int] = {}  # a key used twice in one list: the later one repeats the first
    repeats: list[tuple[int, int]] = []
    for i, sub in enumerate(subs):
        old = txn.get_reply(sub.key) if sub.key else None
        if sub.key is not None and old is not None:
            if not same_content(old, sub.digest, sub.digest_as):
                raise Conflict(reused_key_message(sub))
            replies.append(ScoredReply.model_validate_json(old).model_copy(update={"duplicate": True}))
        elif sub.key is not None and sub.key in first_in_request:
            first = first_in_request[sub.key]
            if subs[first].digest != sub.digest:
                raise Conflict(reused_key_message(sub, earlier=subs[first].where))
            replies.append(None)
            repeats.append((i, first))
        else:
            replies.append(None)
            fresh.append((i, sub))
            if sub.key is not None:
                first_in_request[sub.key] = i
    for _, sub in fresh:  # acknowledged only what a task lease's holder sends while its lease is its task's
        if not sub.sealed:
            check_not_open(txn, run, sub)
        if task_tokens.is_token(sub.record.group_id):
            assert sub.record.group_id is not None
            task_leases.check_submission(txn, sub.record.group_id, caller, sub.record.producer_id, sub.loc)
    held_envs = {e.env_id for _, s in fresh if (e := held_env(run, s)) is not None}
    for env_id in sorted(held_envs):  # room that expired groups leave counts for what arrives now
        expire_held(txn, run, env_id, now, limits.side, books)
    check_capacity(limits, txn.counts(), txn.held.counts(), [s for _, s in fresh])
    reg = run.registration
    assert reg is not None
    received: dict[str, int] = {}
    arrivals = books.arrivals(txn, caller.owner, now)
    for i, sub in fresh:
        env_id = ANON_ENV if sub.env_id is None else sub.env_id
        env = run.env(env_id)
        name = env.wandb_name if env else ANON_NAME
        received[name] = received.get(name, 0) + 1
        step = sub.record.policy_step
        reason = filter_reason(sub.record.scores, reg)
        if reason is not None:
            arrivals.dropped(env_id, name, sub, reason, run.step)
            reply = queued_reply()
        elif env is not None and held_env(run, sub) is env:
            arrivals.flush()  # a released group's row must be there to move (`requeued`)
            reply, item_id, fate = hold_group(txn, env, sub, step, now, limits, books)
            arrivals.stored(item_id, env_id, sub, fate)
        else:
            item_id = enqueue(txn, env_id, sub.record.seqs, sub.record.n_tokens, step, sub.payload)
            reply = queued_reply()
            arrivals.stored(item_id, env_id, sub, QUEUED)
        if sub.key:
            txn.put_reply(sub.key, remember(reply_fields(reply), sub.digest))
        replies[i] = reply
    for i, first in repeats:
        first_reply = replies[first]
        assert first_reply is not None
        replies[i] = first_reply.model_copy(update={"duplicate": True})
    stats.count_received(txn, received)
    arrivals.close()
    return [r for r in replies if r is not None], run


def check_not_open(txn: Txn, run: RunState, sub: Submission) -> None:
    """A whole group may not take the id of a per-rollout group of its env still open (or sealing): that group's
    rollouts are acknowledged slot by slot, and its seal is stored under its id; a whole group there first would make
    the seal a 409 and the acknowledged rollouts would expire with it. One read, only for envs that ever opened a
    group (`EnvRecord.opens_groups`) and groups without an env."""
    group_id = sub.record.group_id
    env = None if sub.env_id is None else run.env(sub.env_id)
    if group_id is None or (env is not None and not env.opens_groups):
        return
    row = txn.rollouts.get(group_id)
    env_id = ANON_ENV if sub.env_id is None else sub.env_id
    if row is not None and row.state in LIVE and row.env_id == env_id:
        raise Conflict(
            f"group id {group_id!r} names a per-rollout group of this env still open: its rollouts are acknowledged "
            "one by one and its seal stores it under this id; send this group under another id",
            loc=(*sub.loc, "group_id"),
        )


def held_env(run: RunState, sub: Submission) -> EnvRecord | None:
    """The env whose side buffer `sub` goes to: a registered env's group of another size than its `group_size`,
    unless the env declared that its groups vary in size (queued whole)."""
    env = None if sub.env_id is None else run.env(sub.env_id)
    if env is None or env.variable_group_size or sub.record.seqs == env.group_size:
        return None
    return env


def check_capacity(
    lim: QueueLimits, counts: dict[int, QueueCounts], held: dict[int, QueueCounts], subs: Sequence[Submission]
) -> None:
    """QueueFull when storing `subs` would take the queue and side buffers (or an env's share of them) past a
    limit. (A side buffer's own bound is checked as a group is held: one that completes held groups fits.)
    Plain sums, not QueueCounts arithmetic: this runs for every request, and the counts say what is needed."""
    if not subs:
        return
    adds: dict[int, list[int]] = {}  # per env: groups, tokens, bytes (a new group is one item)
    for s in subs:
        env_id = ANON_ENV if s.env_id is None else s.env_id
        add = adds.get(env_id)
        if add is None:
            adds[env_id] = [1, s.record.n_tokens, len(s.payload)]
        else:
            add[0] += 1
            add[1] += s.record.n_tokens
            add[2] += len(s.payload)
    whole = (
        (lim.max_groups, 0, "groups", "max_queue_groups"),
        (lim.max_tokens, 1, "tokens", "max_queue_tokens"),
        (lim.max_bytes, 2, "bytes", "max_queue_bytes"),
    )
    one = (
        (lim.max_env_groups, 0, "groups", "max_env_queue_groups"),
        (lim.max_env_tokens, 1, "tokens", "max_env_queue_tokens"),
        (lim.max_env_bytes, 2, "bytes", "max_env_queue_bytes"),
    )
    full = None
    if any(limit is not None for limit, *_ in whole):  # what side buffers hold counts against them too
        have = [0, 0, 0]
        for stored in (counts, held):
            for c in stored.values():
                have[0] += c.groups
                have[1] += c.tokens
                have[2] += c.bytes
        more = [sum(a[k] for a in adds.values()) for k in range(3)]
        full = _over("the queue holds", have, more, whole)
    if full is None and any(limit is not None for limit, *_ in one):
        for env_id, more in adds.items():
            q, h = counts.get(env_id), held.get(env_id)
            have = [
                sum(c.groups for c in (q, h) if c),
                sum(c.tokens for c in (q, h) if c),
                sum(c.bytes for c in (q, h) if c),
            ]
            if (full := _over(f"env {env_id} has", have, more, one, " queued")) is not None:
                break
    if full:
        raise QueueFull(f"queue full: {full}; retry later", lim.retry_after)


def _over(
    who: str, have: list[int], more: list[int], bounds: tuple[tuple[int | None, int, str, str], ...], where: str = ""
) -> str | None:
    """The first bound (limit, index, unit, setting) that `have + more` passes, said as "<who> 5 groups<where>;
    ..."."""
    for limit, k, unit, name in bounds:
        if limit is not None and have[k] + more[k] > limit:
            return f"{who} {have[k]} {unit}{where}; the limit ({name}) is {limit}"
    return None


def enqueue(txn: Txn, env_id: int, seqs: int, tokens: int, step: int, payload: bytes) -> int:
    """Queue one stored group (or a released side-buffer group) behind its env's others; its item id."""
    meta = ItemMeta(item_id=txn.next_item_id(), seqs=seqs, tokens=tokens, policy_step=step)
    txn.append(env_id, QueuedItem(meta=meta, n_groups=1, payload=payload))
    return meta.item_id


def hold_group(
    txn: Txn,
    env: EnvRecord,
    sub: Submission,
    step: int,
    now: float,
    limits: QueueLimits,
    books: Recorder = OFF,
) -> tuple[ScoredReply, int, str]:
    """Hold a group whose size is not its env's group_size aside, or queue it with held groups that together
    with it make whole groups (Atropos's mixed-size buffering). Costs the group, not what the buffer holds.
    QueueFull if holding it would pass the side buffer's bound (one that completes held groups always fits).
    Returns the reply, and the new group's item id and ledger fate (HELD or QUEUED); the ledger rows of held
    groups released with it move to their queue ids."""
    held = txn.held.groups(env.env_id)
    meta = ItemMeta(txn.next_item_id(), sub.record.seqs, sub.record.n_tokens, step)
    picked = side_buffer.to_release(held, meta.seqs, env.group_size)
    if picked is None:
        holds = QueueCounts(
            len(held),
            len(held),
            sum(h.meta.seqs for h in held),
            sum(h.meta.tokens for h in held),
            sum(h.size for h in held),
        )
        why = side_buffer.full(holds, QueueCounts(1, 1, meta.seqs, meta.tokens, len(sub.payload)), limits.side)
        if why is not None:
            raise QueueFull(
                f"queue full: env {env.env_id}'s side buffer (groups of another size than its group_size) {why}; "
                "retry later, or send whole groups",
                limits.retry_after,
            )
        txn.held.add(env.env_id, HeldGroup(meta, now, sub.payload))
        reply = ScoredReply(status="buffered", buffer_size=sum(h.meta.seqs for h in held) + meta.seqs)
        return reply, meta.item_id, HELD
    old = [held[i].meta.item_id for i in picked if i < len(held)]
    released = {g.meta.item_id: g for g in txn.held.release(env.env_id, old)}
    new_id, fate = meta.item_id, HELD
    for i in picked:
        if i < len(held):
            g = released[held[i].meta.item_id]
            item_id = enqueue(txn, env.env_id, g.meta.seqs, g.meta.tokens, g.meta.policy_step, g.payload)
            books.requeued(txn, g.meta.item_id, item_id)
        else:
            new_id, fate = enqueue(txn, env.env_id, meta.seqs, meta.tokens, step, sub.payload), QUEUED
    if len(held) not in picked:  # the new group stays held (only if older ones already added up: a migration)
        txn.held.add(env.env_id, HeldGroup(meta, now, sub.payload))
    left = sum(h.meta.seqs for i, h in enumerate(held) if i not in set(picked))
    reply = ScoredReply(status="buffered", buffer_size=left + (0 if len(held) in picked else meta.seqs))
    return reply, new_id, fate


def expire_held(
    txn: Txn,
    run: RunState,
    env_id: int,
    now: float,
    limits: side_buffer.SideLimits,
    books: Recorder = OFF,
) -> int:
    """Drop env_id's held groups past the ttl, counted as `side_buffer_expired` (and so in the ledger); how many."""
    gone: list[HeldMeta] = side_buffer.expired(txn.held.groups(env_id), now, limits)
    if gone:
        released = txn.held.release(env_id, [h.meta.item_id for h in gone])
        ids, payloads = [g.meta.item_id for g in released], [g.payload for g in released]
        books.dropped(txn, run.env_name(env_id), side_buffer.EXPIRED, ids, payloads, step=run.step, at=now)
    return len(gone)


def expire_txn(
    txn: Txn,
    now: float,
    limits: side_buffer.SideLimits,
    known: RunState | None = None,
    books: Recorder = OFF,
) -> int:
    """The sweep: drop every env's expired held groups; how many (reads only the envs that hold some)."""
    run = state.load(txn, known)
    return sum(expire_held(txn, run, env_id, now, limits, books) for env_id in sorted(txn.held.counts()))


_QUEUED = ScoredReply.model_construct(status="received")


def queued_reply() -> ScoredReply:
    """A queued group's reply: one object for every such group (building one took 3% of a small group's ingest;
    replies are never changed in place, a duplicate's is a `model_copy`)."""
    return _QUEUED


def reply_fields(reply: ScoredReply) -> dict[str, Any]:
    """`reply.model_dump(exclude_none=True)`, without pydantic for most groups' reply (queued, not a duplicate):
    what the store remembers under a key and what /scored_data answers."""
    if reply.status == "received" and reply.duplicate is None and reply.buffer_size is None:
        return {"status": "received"}
    return reply.model_dump(exclude_none=True)


def still_valid(subs: Sequence[Submission], seen: RunState, run: RunState) -> bool:
    """Whether what validating `subs` against `seen` relied on holds in `run`: the trainer's registration (the
    limits), every env named, and the step stamped on groups that sent no `policy_step`."""
    if run.registration is not seen.registration and run.registration != seen.registration:  # parsed once a run
        return False
    for sub in subs:
        if sub.env_id is not None and run.env(sub.env_id) is None:
            return False
        if sub.sent_policy_step is None and run.step != seen.step:
            return False
    return True


def reused_key_message(sub: Submission, earlier: str | None = None) -> str:
    """The 409 for a key stored (or sent earlier in this request) with other content."""
    assert sub.key is not None
    kind, _, rest = sub.key.partition(":")
    if kind == "k":
        what = f"Idempotency-Key {rest!r}"
    else:
        env, _, gid = rest.partition(":")
        what = f"group_id {gid!r}" + ("" if env == "None" else f" of env_id {env}")
    before = f"by {earlier} of this request" if earlier else "before"
    return (
        f"{sub.where}: {what} was used {before} for a group with different content; nothing was stored. "
        "A group id names one group: send a new group under a new id (the same group again is acknowledged "
        "as a duplicate)."
    )
