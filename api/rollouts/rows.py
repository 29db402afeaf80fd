"""What the rollout routes' transactions share (docs/rollouts.md): the group's row as its record and counters make
it, the counters kept as groups change, the group's view, and the checks every post and turn makes first. Below
both the lease and post transactions (api/rollouts/txns.py) and the turn transactions (api/rollouts/turn_txns.py),
so that neither imports the other's module for them."""

from __future__ import annotations

from dataclasses import replace

from api.errors import Conflict, InvalidData, NotFound
from api.owners import Actor
from api.rollouts import groups as rg
from api.rollouts import lineage
from api.rollouts import turns as tn
from api.store.base import ANON_ENV, Txn
from api.store.rollouts import LIVE, GroupRow, TurnKey
from api.wire.rollouts import GroupView, SlotLineage, SlotTurns, TurnRun

COUNTS = "rollouts"
"""Counter kind: opened, sealed, sealed_partial, expired, slots, left_out, redispatched, redone, refused,
lease_lapsed, pruned; turns and turn_bytes (acknowledged), resumed (slot leases that carried turns) and
tokens_carried (their tokens), restarted (slot leases that carried none)."""

TURN_BYTES = "rollout_turn_bytes"
"""Counter kind: bytes of acknowledged turns held by live groups, per env (`env:<id>`) and per key (`key:<name>`),
moved as turns are acknowledged and freed, so that their bounds cost one read."""


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


def row_of(g: rg.OpenGroup, state_: str, base: GroupRow | None, expires_at: float | None = None) -> GroupRow:
    """The group's row with `g` as its record: its counters (`done`, `tokens`, `bytes`, `turn_tokens`) those of
    `base`, its next check `expires_at` or what `g`'s leases make it."""
    env_id = ANON_ENV if g.env_id is None else g.env_id
    done, tokens, size, turned = (
        (0, 0, 0, 0) if base is None else (base.done, base.tokens, base.bytes, base.turn_tokens)
    )
    at = rg.next_check(g, done) if expires_at is None else expires_at
    return GroupRow(g.key, env_id, state_, g.deadline, at, size, g.to_json(), done, tokens, turned)


def settled(txn: Txn, row: GroupRow) -> rg.OpenGroup:
    """The row's group, its leases those of missing slots only (a post does not rewrite the record: a slot
    acknowledged since its lease is dropped here, by one read of that slot's row)."""
    g = rg.OpenGroup.of(row.record)
    rg.settle(g, [int(k) for k in g.leases if txn.rollouts.slot(g.key, int(k)) is not None])
    return g


OPEN_DONE, OPEN_LEASED = "open_slots_done", "open_slots_leased"
"""Counters kept as the groups change: slots acknowledged in live groups, and missing slots of live groups leased
to a sibling (a lapsed sibling lease stops counting at the first sweep after its lapse, `unlease`), so that the
views read them without a scan of the open groups."""


def tally(row: GroupRow, g: rg.OpenGroup) -> tuple[int, int]:
    """(slots done, slots leased to siblings) of a live group (`g` settled: its leases are of missing slots);
    nothing for a decided one."""
    if row.state not in LIVE:
        return 0, 0
    return row.done, len(g.leases)


def put(txn: Txn, old: GroupRow, before: tuple[int, int], new: GroupRow, g: rg.OpenGroup) -> None:
    """Write the group's row (`g` its record), and move the open-slot counters from `before` (the old row's
    `_tally`, of its settled group) by what changed (and its key's live groups, once decided). Decided: its turns'
    lineage goes into its record before they are freed."""
    keys = None
    if old.state == "open" and new.state != "open":
        keys = txn.rollouts.turn_keys(g.key)
        if keys:
            g.lineage = lineage.with_runs(g.lineage, keys)
            new = replace(new, record=g.to_json())
    txn.rollouts.put(new)
    (done0, leased0), (done1, leased1) = before, tally(new, g)
    moved = {OPEN_DONE: done1 - done0, OPEN_LEASED: leased1 - leased0}
    if any(moved.values()):
        txn.add_counts(COUNTS, {k: n for k, n in moved.items() if n})
    if keys is not None:
        free_turns(txn, g, keys)
    if old.state in LIVE and new.state not in LIVE:
        if g.owner is not None and txn.get_counts(BY_KEY).get(g.owner, 0) > 0:  # > 0: not one opened before counting
            txn.add_counts(BY_KEY, {g.owner: -1})


def free_turns(txn: Txn, g: rg.OpenGroup, keys: list[TurnKey]) -> None:
    """The group is decided (sealing, or expired): its turns go, and stop counting against their bounds (the slots
    it keeps hold whole rollouts). Kept until then, so that a final post sent again concatenates the same turns."""
    held = sum(k.bytes for k in keys)
    if held:
        txn.add_counts(TURN_BYTES, {f"env:{g.env_id}": -held, **({f"key:{g.owner}": -held} if g.owner else {})})
    txn.rollouts.drop_turns(g.key)


BY_KEY = "rollouts_by_key"
"""Counter kind: the live open groups of each key (by its name), moved as they open and are decided, so that a
key's bound (`rollout_max_open_groups_per_key`) costs one read."""


def view(txn: Txn, row: GroupRow, *, lean: bool = False) -> GroupView:
    """The group as GET /rollouts/group shows it (its slots in: one read of their numbers). `lean`: as a post's
    reply shows it, from its row alone, without the lists that grow with its slots."""
    g = rg.OpenGroup.of(row.record)
    base = GroupView(
        group_id=g.key,
        env_id=g.env_id,
        state=row.state,
        group_size=g.group_size,
        min_group_size=g.min_group_size,
        producer=g.producer,
        deadline=g.deadline,
        expires_at=g.expires_at,
        done=None,
        slots_done=row.done,
        leased=None,
        redispatched=g.redispatched,
        left_out=dict(g.left_out),
        turns=None,
        lineage=None,
    )
    if lean:
        return base
    done = txn.rollouts.done(g.key)
    keys = txn.rollouts.turn_keys(g.key) if row.state == "open" else []  # a decided group's are in its record
    return base.model_copy(
        update={
            "done": sorted(done),
            "slots_done": len(done),
            "leased": {k: str(v[0]) for k, v in g.leases.items() if int(k) not in done},
            "turns": slot_turns(keys),
            "lineage": lineage_view(lineage.with_runs(g.lineage, keys)),
        }
    )


def lineage_view(made: lineage.Lineage) -> dict[str, SlotLineage]:
    """The record's lineage as the views show it."""
    return {
        slot: SlotLineage(
            resumes=e.get("resumes", 0),
            restarts=e.get("restarts", 0),
            tokens_saved=e.get("saved", 0),
            turns=[TurnRun(producer=p, turns=n, start=a, end=b) for p, n, a, b in e.get("turns", [])],
        )
        for slot, e in sorted(made.items(), key=lambda kv: int(kv[0]))
    }


def slot_turns(keys: list[TurnKey]) -> dict[str, SlotTurns]:
    """Per slot with turns in: how many, and who posted them (each once, in order)."""
    out: dict[str, SlotTurns] = {}
    for k in keys:
        got = out.setdefault(str(k.slot), SlotTurns(n=0, producers=[]))
        got.n += 1
        if k.producer not in got.producers:
            got.producers.append(k.producer)
    return out


def group_of(txn: Txn, key: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "group_id")) -> GroupRow:
    """The open group `actor` acts on: 404 if none was opened under `key`, or it is another key's (alike)."""
    row = txn.rollouts.get(key)
    unknown = NotFound(f"no group {key!r} was opened", loc=loc)
    if row is None:
        raise unknown
    actor.check(rg.OpenGroup.of(row.record).owner, "open_group", unknown)
    return row


def check_rows(tokens: list[int], masks: list[int], logprobs: list[float] | None) -> None:
    """One mask, and one logprob if sent, per token (422 naming the field)."""
    if len(masks) != len(tokens):
        raise InvalidData(("body", "masks"), "one mask per token")
    if logprobs is not None and len(logprobs) != len(tokens):
        raise InvalidData(("body", "inference_logprobs"), "one logprob per token")


def check_holder(txn: Txn, g: rg.OpenGroup, slot: int, producer: str, *, missing: bool = False) -> None:
    """A slot not yet acknowledged takes turns (and a final post after them) from its holder only (409 naming
    `producer_id`): a producer its lease passed from would mix its rollout with the next holder's. Once the slot is
    in, a post is judged by its content, as any post. `missing`: the caller knows the slot is not in."""
    if (holds := tn.holder(g, slot)) != producer and (missing or txn.rollouts.slot(g.key, slot) is None):
        raise Conflict(
            f"slot {slot} is held by producer {holds!r}, not this one: a slot's turns are its holder's (its lease "
            "may have passed on: stop this rollout)",
            loc=("body", "producer_id"),
        )
