"""The turn routes' transactions (docs/rollouts.md, Turns): a slot's turns acknowledged as they end, read back by
a lease that carries them (`prefix_txn`), by GET /rollouts/turns and by the final post that stands for them
(`after_turns`). Each one store transaction over api/rollouts/turns.py's pure rules."""

from __future__ import annotations

import base64

from api.config.groups import built
from api.config.settings import Settings
from api.errors import Conflict, InvalidData, Unavailable
from api.ingest.queue_limits import QueueLimits, group_limits
from api.owners import ANYONE, Actor
from api.rollouts import checks
from api.rollouts import groups as rg
from api.rollouts import turns as tn
from api.rollouts.rows import COUNTS, TURN_BYTES, check_holder, check_rows, group_of
from api.run import state
from api.run.printable import check_printable
from api.run.state import RunState
from api.store.base import Txn
from api.store.rollouts import TurnRow, TurnSummary
from api.wire.rollouts import (
    InlineSnapshot,
    RolloutPost,
    SlotPrefix,
    SnapshotByUri,
    TurnPost,
    TurnReply,
    TurnSnapshot,
    TurnView,
)


def after_turns(txn: Txn, req: RolloutPost) -> RolloutPost:
    """The whole rollout a final post `after_turns` stands for: its slot's acknowledged turns, then what it
    carries (the same turns and tail again: the same rollout, so a post sent again is a duplicate)."""
    tail = tn.TurnData(req.tokens, req.masks, req.inference_logprobs, req.token_weight_versions)
    pieces = [tn.TurnData.decode(t.data) for t in txn.rollouts.turns(req.group_id, req.slot)]
    whole = tn.concatenate([*pieces, tail])
    return req.model_copy(
        update={
            "tokens": whole.tokens,
            "masks": whole.masks,
            "inference_logprobs": whole.inference_logprobs,
            "token_weight_versions": whole.token_weight_versions,
            "after_turns": False,
        }
    )


def turn_txn(
    txn: Txn,
    req: TurnPost,
    settings: Settings,
    caller: Actor = ANYONE,
    *,
    limits: QueueLimits | None = None,
    known_run: RunState | None = None,
) -> TurnReply:
    """Acknowledge one turn of a slot's rollout (docs/rollouts.md, Turns). Only the slot's holder posts its turns
    (`turns.holder`: 409 for a producer the slot's lease passed from), in order (409 naming the next turn), until its
    final post (409 after); the same turn again is a `duplicate`, another content a 409. The turn is checked against
    every rule the slot's sealed rollout meets (`checks.check_rollout`: 422 naming the field), its tokens with the
    slot's turns before it within the trainer's `max_token_len`, and with every slot's acknowledged content (slots in
    and other slots' turns) within its `max_batch_tokens`: a final post `after_turns` is never refused for what was
    acknowledged. Its bytes within `rollout_max_turn_bytes` (422), the env's and key's turn bytes within their
    bounds (503). It reads the group's row, the slot's summary (`TurnSummary`) and, for a turn sent again, that
    turn: never the slot's turns, so turn 1,000 costs what turn 1 does."""
    check_rows(req.tokens, req.masks, req.inference_logprobs)
    if req.tool_results is not None:
        try:
            check_printable({"tool_results": req.tool_results})
        except InvalidData as exc:
            raise exc.at("body") from None
    row = group_of(txn, req.group_id, caller)
    g = rg.OpenGroup.of(row.record)
    if req.slot >= g.group_size:
        raise Conflict(f"the group has {g.group_size} slots", loc=("body", "slot"))
    if row.state != "open":
        raise Conflict(f"group {req.group_id!r} is {row.state}: it takes no more turns", loc=("body", "group_id"))
    if txn.rollouts.slot(req.group_id, req.slot) is not None:
        raise Conflict(f"slot {req.slot} is acknowledged: it takes no more turns", loc=("body", "slot"))
    check_holder(txn, g, req.slot, req.producer_id, missing=True)
    if req.token_weight_versions is not None and len(req.token_weight_versions) != len(req.tokens):
        raise InvalidData(("body", "token_weight_versions"), "one weights version per token")
    snapshot = _snapshot(req.snapshot, settings)
    data = tn.TurnData(
        req.tokens, req.masks, req.inference_logprobs, req.token_weight_versions, req.tool_results, snapshot
    )
    blob, d = data.encode(), data.digest()
    summary = txn.rollouts.turn_summary(req.group_id, req.slot) or TurnSummary(0, 0, 0, 0)
    stored = txn.rollouts.turn(req.group_id, req.slot, req.turn) if req.turn < summary.turns else None
    outcome = tn.outcome(summary.turns, None if stored is None else stored.digest, req.turn, d)
    if outcome == tn.DUPLICATE:
        return TurnReply(status="duplicate", turns=summary.turns, tokens=summary.tokens)
    if outcome == tn.CONFLICT:
        raise Conflict(f"turn {req.turn} of slot {req.slot} was acknowledged with other content", loc=("body", "turn"))
    if outcome == tn.GAP:
        raise Conflict(f"the slot's next turn is {summary.turns}", loc=("body", "turn"))
    if summary.turns >= settings.rollout_max_turns_per_slot:
        raise Conflict(
            f"the slot has {summary.turns} turns; the limit is rollout_max_turns_per_slot: post the rest "
            "with its final post",
            loc=("body", "turn"),
        )
    if len(blob) > settings.rollout_max_turn_bytes:
        raise InvalidData(("body",), f"this turn stores {len(blob)} bytes; the limit is rollout_max_turn_bytes")
    fields = tn.joined_fields(summary.fields, data)
    run = state.load(txn, known_run)
    group_limit = group_limits(run, built(QueueLimits, settings) if limits is None else limits)
    if req.tokens or not summary.tokens:  # a turn without tokens after some adds none: nothing of it to check
        post = RolloutPost.model_construct(
            group_id=req.group_id,
            slot=req.slot,
            producer_id=req.producer_id,
            tokens=req.tokens,
            masks=req.masks,
            inference_logprobs=req.inference_logprobs,
            token_weight_versions=req.token_weight_versions,
            score=None,
            policy_step=None,
            overrides=None,
            after_turns=False,
        )
        checks.check_rollout(post, g.env_id, g.key, run.step, group_limit)
    checks.check_rollout_tokens(summary.tokens + len(req.tokens), group_limit)
    if group_limit.max_group_tokens is not None:  # every slot's acknowledged content, and this turn
        checks.check_group_tokens(row.tokens + row.turn_tokens, len(req.tokens), group_limit)
    held = txn.get_counts(TURN_BYTES)
    env_key, key_key = f"env:{g.env_id}", f"key:{g.owner}"
    if held.get(env_key, 0) + len(blob) > settings.rollout_max_turn_bytes_per_env:
        raise Unavailable(
            f"env {g.env_id}'s open groups hold {held.get(env_key, 0)} bytes of turns; the limit is "
            "rollout_max_turn_bytes_per_env; retry later"
        )
    if g.owner is not None and held.get(key_key, 0) + len(blob) > settings.rollout_max_turn_bytes_per_key:
        raise Unavailable(
            f"this key's open groups hold {held.get(key_key, 0)} bytes of turns; the limit is "
            "rollout_max_turn_bytes_per_key; retry later"
        )
    txn.rollouts.add_turn(
        TurnRow(req.group_id, req.slot, req.turn, req.producer_id, d, blob, len(blob), len(req.tokens)), fields
    )
    txn.add_counts(TURN_BYTES, {env_key: len(blob), **({key_key: len(blob)} if g.owner is not None else {})})
    txn.add_counts(COUNTS, {"turns": 1, "turn_bytes": len(blob)})
    return TurnReply(status="accepted", turns=summary.turns + 1, tokens=summary.tokens + len(req.tokens))


def _snapshot(snap: InlineSnapshot | SnapshotByUri | None, settings: Settings) -> dict[str, str] | None:
    """The turn's snapshot as stored: inline bytes within `rollout_max_snapshot_bytes` (422 naming the field), or
    a URI."""
    if snap is None:
        return None
    if isinstance(snap, SnapshotByUri):
        return {"uri": snap.uri}
    size = len(base64.b64decode(snap.data))  # the schema's pattern: padded base64
    if size > settings.rollout_max_snapshot_bytes:
        raise InvalidData(("body", "snapshot", "data"), f"{size} bytes; the limit is rollout_max_snapshot_bytes")
    return {"data": snap.data}


def _turn_view(row: TurnRow, data: tn.TurnData) -> TurnView:
    return TurnView(
        turn=row.turn,
        producer=row.producer,
        tokens=data.tokens,
        masks=data.masks,
        inference_logprobs=data.inference_logprobs,
        token_weight_versions=data.token_weight_versions,
        tool_results=data.tool_results,
    )


def prefix_txn(txn: Txn, key: str, slot: int, budget: int) -> tuple[SlotPrefix | None, int]:
    """The slot's acknowledged turns as a lease carries them (None: none at all), and the bytes it carries: the turns
    themselves if they hold at most `budget` bytes, else none (`complete` false: GET /rollouts/turns reads them).
    The snapshot is the last one any turn carried."""
    rows = txn.rollouts.turns(key, slot)
    if not rows:
        return None, 0
    pieces = [tn.TurnData.decode(t.data) for t in rows]
    tokens = sum(len(p.tokens) for p in pieces)
    size = sum(t.bytes for t in rows)
    if size > budget:
        return SlotPrefix(turns=len(rows), tokens=tokens, complete=False, items=[], snapshot=None), 0
    snap = next((p.snapshot for p in reversed(pieces) if p.snapshot is not None), None)
    prefix = SlotPrefix(
        turns=len(rows),
        tokens=tokens,
        complete=True,
        items=[_turn_view(t, p) for t, p in zip(rows, pieces, strict=True)],
        snapshot=None if snap is None else TurnSnapshot(**snap),
    )
    return prefix, size


def turns_txn(
    txn: Txn, key: str, slot: int, start: int, budget: int, caller: Actor, loc: tuple[str | int, ...]
) -> SlotPrefix:
    """GET /rollouts/turns: the slot's turns from `start`, as many whole turns as fit `budget` bytes (one at least):
    `complete` says whether they reach its last. 404 for a group unknown to the caller."""
    row = group_of(txn, key, caller, loc)
    rows = txn.rollouts.turns(row.key, slot)
    pieces = [tn.TurnData.decode(t.data) for t in rows]
    snap = next((p.snapshot for p in reversed(pieces) if p.snapshot is not None), None)
    items: list[TurnView] = []
    used = 0
    for t, p in list(zip(rows, pieces, strict=True))[start:]:
        if items and used + t.bytes > budget:
            break
        used += t.bytes
        items.append(_turn_view(t, p))
    last = items[-1].turn + 1 if items else start
    return SlotPrefix(
        turns=len(rows),
        tokens=sum(len(p.tokens) for p in pieces),
        complete=last >= len(rows),
        items=items,
        snapshot=None if snap is None else TurnSnapshot(**snap),
    )
