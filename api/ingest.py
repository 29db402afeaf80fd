"""Storing validated submissions, inside one store transaction: the checks that must see the store (the run
still what validation saw, keys not reused with other content, room in the queue), then each group queued,
held aside or dropped by the filters, and counted. Written once over `Txn`, for every store."""

from __future__ import annotations

from collections.abc import Sequence

from api import state, stats
from api.errors import Conflict, InvalidData, Unavailable
from api.filters import filter_reason, release_from_buffer
from api.idempotency import remember, same_content
from api.limits import QueueLimits
from api.schema import ScoredReply
from api.state import ANON_NAME, EnvRecord, RunState
from api.store.base import ANON_ENV, BufferedGroup, ItemMeta, QueueCounts, QueuedItem, Txn
from api.submissions import Submission
from api.validation import check_policy_step


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
    txn: Txn, subs: Sequence[Submission], seen_run: RunState, limits: QueueLimits
) -> tuple[list[ScoredReply], RunState]:
    """Store validated submissions all-or-nothing, with the run state found: `StaleRun` if what they were
    validated against (`seen_run`) no longer holds, `QueueFull` past a limit, a 409 for a reused key with
    other content. A key already stored answers its first reply, marked `duplicate`."""
    run = state.load(txn, seen_run)
    if not still_valid(subs, seen_run, run):
        raise StaleRun(run)
    for sub in subs:  # against the step now, not the snapshot's: it may have moved since
        try:
            check_policy_step(sub.sent_policy_step, run.step)
        except InvalidData as exc:
            raise exc.at(*sub.loc) from None
    counts = txn.counts()
    replies: list[ScoredReply | None] = []
    fresh: list[tuple[int, Submission]] = []
    first_in_request: dict[str, int] = {}  # a key used twice in one list: the later one repeats the first
    repeats: list[tuple[int, int]] = []
    for i, sub in enumerate(subs):
        old = txn.get_reply(sub.key) if sub.key else None
        if sub.key is not None and old is not None:
            if not same_content(old, sub.digest):
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
    check_capacity(limits, counts, [s for _, s in fresh])
    reg = run.registration
    assert reg is not None
    received: dict[str, int] = {}
    for i, sub in fresh:
        env_id = ANON_ENV if sub.env_id is None else sub.env_id
        env = run.env(env_id)
        name = env.wandb_name if env else ANON_NAME
        received[name] = received.get(name, 0) + 1
        step = sub.record.policy_step
        reason = filter_reason(sub.record.scores, reg)
        if reason is not None:
            state.count_dropped(txn, name, reason)
            reply = ScoredReply(status="received")
        elif env is not None and sub.record.seqs != env.group_size:
            reply = buffer_group(txn, env, sub, step)
        else:
            enqueue(txn, env_id, sub.record.seqs, sub.record.n_tokens, step, sub.payload)
            reply = ScoredReply(status="received")
        if sub.key:
            txn.put_reply(sub.key, remember(reply.model_dump_json(exclude_none=True), sub.digest))
        replies[i] = reply
    for i, first in repeats:
        first_reply = replies[first]
        assert first_reply is not None
        replies[i] = first_reply.model_copy(update={"duplicate": True})
    stats.count_received(txn, received)
    return [r for r in replies if r is not None], run


def check_capacity(lim: QueueLimits, counts: dict[int, QueueCounts], subs: Sequence[Submission]) -> None:
    """QueueFull when storing `subs` would take the queue (or an env's share of it) past a limit."""
    if not subs:
        return
    total = sum(counts.values(), QueueCounts())
    per_env: dict[int, QueueCounts] = {}
    for s in subs:
        env_id = ANON_ENV if s.env_id is None else s.env_id
        adds = QueueCounts(1, 1, s.record.seqs, s.record.n_tokens, len(s.payload))
        per_env[env_id] = per_env.get(env_id, QueueCounts()) + adds
    add = sum(per_env.values(), QueueCounts())
    full = None
    if lim.max_groups is not None and total.groups + add.groups > lim.max_groups:
        full = f"the queue holds {total.groups} groups; the limit is {lim.max_groups}"
    elif lim.max_tokens is not None and total.tokens + add.tokens > lim.max_tokens:
        full = f"the queue holds {total.tokens} tokens; the limit is {lim.max_tokens}"
    elif lim.max_bytes is not None and total.bytes + add.bytes > lim.max_bytes:
        full = f"the queue holds {total.bytes} bytes; the limit (max_queue_bytes) is {lim.max_bytes}"
    else:
        for env_id, more in per_env.items():
            have = counts.get(env_id, QueueCounts())
            if lim.max_env_groups is not None and have.groups + more.groups > lim.max_env_groups:
                full = f"env {env_id} has {have.groups} groups queued; the limit is {lim.max_env_groups}"
            elif lim.max_env_tokens is not None and have.tokens + more.tokens > lim.max_env_tokens:
                full = f"env {env_id} has {have.tokens} tokens queued; the limit is {lim.max_env_tokens}"
            elif lim.max_env_bytes is not None and have.bytes + more.bytes > lim.max_env_bytes:
                full = f"env {env_id} has {have.bytes} bytes queued; the limit is {lim.max_env_bytes}"
    if full:
        raise QueueFull(f"queue full: {full}; retry later", lim.retry_after)


def enqueue(txn: Txn, env_id: int, seqs: int, tokens: int, step: int, payload: bytes) -> None:
    """Queue one stored group (or a released side-buffer group) behind its env's others."""
    meta = ItemMeta(item_id=txn.next_item_id(), seqs=seqs, tokens=tokens, policy_step=step)
    txn.append(env_id, QueuedItem(meta=meta, n_groups=1, payload=payload))


def buffer_group(txn: Txn, env: EnvRecord, sub: Submission, step: int) -> ScoredReply:
    """Hold a group whose size is not its env's group_size aside, releasing held groups that together make
    whole groups (Atropos's mixed-size buffering)."""
    buffer = [*txn.get_buffer(env.env_id), BufferedGroup(sub.record.seqs, sub.record.n_tokens, step, sub.payload)]
    picked = release_from_buffer([g.seqs for g in buffer], env.group_size)
    if picked:
        for i in picked:
            g = buffer[i]
            enqueue(txn, env.env_id, g.seqs, g.tokens, g.policy_step, g.payload)
        buffer = [g for i, g in enumerate(buffer) if i not in set(picked)]
    txn.set_buffer(env.env_id, buffer)
    return ScoredReply(status="buffered", buffer_size=sum(g.seqs for g in buffer))


def still_valid(subs: Sequence[Submission], seen: RunState, run: RunState) -> bool:
    """Whether what validating `subs` against `seen` relied on holds in `run`: the trainer's registration (the
    limits), every env named, and the step stamped on groups that sent no `policy_step`."""
    if run.registration != seen.registration:
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
