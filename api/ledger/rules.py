"""The ledger's decisions, apart from any store: what a group's row says when it is acknowledged, what a formed
batch's row says, and which retained payloads and ledger rows retention lets go (docs/ledger.md).

The rows are written by the transaction that makes the decision they record (`api/ingest/submit.py`,
`api/batches/formation.py`, `api/batches/acknowledge.py`), through the recorder (`api/ledger/recorder.py`);
pruning runs in the background (`Service.jobs`), in transactions of bounded size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.config.groups import setting
from api.ledger.replies import GROUP_FIELDS
from api.run import state
from api.store.base import ANON_ENV, SERVED, KeptPayload, LedgerGroup, LedgerStep, PayloadLost, Txn
from api.store.ledger_contract import GROUP_RECORD
from api.wire.records import GroupRecord, decode, to_atropos

log = logging.getLogger("rollbuf.ledger")

RETAINED = "retained"
"""Counter kind of the retained payloads: `groups` and `bytes` (what the byte budget is checked against)."""
PRUNE_CHUNK = 10_000
"""Most ledger rows or retained payloads one pruning transaction forgets: a prune never holds the store long."""


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """Whether the ledger is written, how much of it is kept, and which payloads are retained past their fate."""

    enabled: bool = setting("ledger")
    max_groups: int | None = setting("ledger_max_groups")
    """Group rows kept: those of groups acknowledged before the last `max_groups` are pruned once their fate is
    final (queued and side-buffered rows are never pruned). None: all."""
    max_steps: int | None = setting("ledger_max_steps")
    """Step rows kept: those of the last `max_steps` steps. None: all."""
    retain_steps: int | None = setting("retain_steps")
    """Retain served and dropped groups' payloads for this many steps after their fate (None: no step bound)."""
    retain_bytes: int | None = setting("retain_bytes")
    """Retain served and dropped groups' payloads while they hold at most this many bytes (None: no byte bound)."""
    prune_every: float = 10.0
    """Seconds between two background prunes (each bounded by PRUNE_CHUNK)."""

    @property
    def retaining(self) -> bool:
        """Payloads are retained: a bound in steps or bytes is set (neither: none are, today's cost)."""
        return self.enabled and (self.retain_steps is not None or self.retain_bytes is not None)


OFF = LedgerSettings(enabled=False)


@dataclass(frozen=True, slots=True)
class Resumes:
    """What a sealed per-rollout group's row says of its resumes (`LedgerGroup.resumed`, `tokens_saved`): made by
    the rollouts flow from the group's own lineage (`api.rollouts.lineage.resumes`) and handed to ingest beside the
    body, never read from one, so a group posted whole cannot claim any."""

    slots: tuple[int, ...]
    """The slots resumed, ascending (never empty: a group without resumes has none of this)."""
    tokens: int
    """The tokens their resumes carried over, summed."""


def group_row(
    item_id: int,
    env_id: int,
    rec: GroupRecord,
    size: int,
    handler: str | None,
    fate: str,
    now: float,
    resumes: Resumes | None = None,
) -> LedgerGroup:
    """A newly acknowledged group's row (its fate as decided at ingest; `resumes`: a sealed per-rollout group's)."""
    mean, lo, hi, std = score_summary(rec.scores.tolist())
    return LedgerGroup(
        id=item_id,
        env_id=env_id,
        group_id=rec.group_id,
        handler=handler,
        acked_at=now,
        policy_step=rec.policy_step,
        seqs=rec.seqs,
        tokens=rec.n_tokens,
        bytes=size,
        score_mean=mean,
        score_min=lo,
        score_max=hi,
        score_std=std,
        fate=fate,
        producer_id=rec.producer_id,
        resumed=None if resumes is None else resumes.slots,
        tokens_saved=None if resumes is None else resumes.tokens,
    )


def score_summary(scores: list[float]) -> tuple[float, float, float, float]:
    """Mean, min, max and population standard deviation (zeros for no scores), finite for any finite scores
    (scaled by the largest, so no sum overflows). Plain Python: a group holds a few scores, where numpy's
    per-call cost is most of ingest's share of the ledger."""
    n = len(scores)
    if not n:
        return 0.0, 0.0, 0.0, 0.0
    lo, hi = min(scores), max(scores)
    scale = max(-lo, hi)
    if scale == 0.0:
        return 0.0, lo, hi, 0.0
    unit = [x / scale for x in scores]  # in [-1, 1]: neither the sums nor the differences can overflow
    m = math.fsum(unit) / n
    var = math.fsum((u - m) ** 2 for u in unit) / n
    return scale * m, lo, hi, scale * min(1.0, math.sqrt(var))  # std <= (hi - lo) / 2 <= scale


def step_row(
    step: int,
    now: float,
    seconds: float,
    order: Sequence[int],
    seqs: int,
    tokens: int,
    groups_by_env: Mapping[str, int],
    seqs_by_env: Mapping[str, int],
    staleness: Mapping[int, int],
    *,
    committed: bool,
) -> LedgerStep:
    """A formed batch's row; `committed` when nothing acknowledges it later (Atropos's `/batch` without `step`)."""
    return LedgerStep(
        step,
        now,
        seconds,
        tuple(order),
        seqs,
        tokens,
        dict(groups_by_env),
        dict(seqs_by_env),
        dict(staleness),
        now if committed else None,
    )


def count_retained(txn: Txn, groups: int, size: int) -> None:
    """Count payloads retained (or, negative, pruned) against the byte budget."""
    if groups:
        txn.add_counts(RETAINED, {"groups": groups, "bytes": size})


def payloads_to_prune(
    kept: Sequence[KeptPayload], retained_bytes: int, step: int, committed: int, settings: LedgerSettings
) -> list[int]:
    """Which of the oldest retained payloads (`kept`, oldest step first) retention lets go: those decided more
    than `retain_steps` steps before `step`, then the oldest while the rest holds more than `retain_bytes`.
    Never one of a batch still kept for serving again (`step >= committed`): it is part of that batch."""
    out: list[int] = []
    left = retained_bytes
    for k in kept:
        if k.step >= committed:
            break
        too_old = settings.retain_steps is not None and k.step < step - settings.retain_steps
        too_big = settings.retain_bytes is not None and left > settings.retain_bytes
        if not (too_old or too_big):
            break
        out.append(k.id)
        left -= k.bytes
    return out


def ledger_bounds(next_id: int, first_id: int, step: int, settings: LedgerSettings) -> tuple[int, int]:
    """(below_id, below_step) for `txn.ledger.prune`: rows past `max_groups` / `max_steps`, at most PRUNE_CHUNK
    ids past the oldest row (`first_id`) per prune."""
    below_id = -1 if settings.max_groups is None else min(next_id - settings.max_groups, first_id + PRUNE_CHUNK)
    below_step = -1 if settings.max_steps is None else step - settings.max_steps
    return below_id, below_step


def prune_txn(txn: Txn, settings: LedgerSettings) -> tuple[int, int]:
    """One background prune: retained payloads past their bound (all of them, of batches no longer kept, once
    retention is off), then ledger rows past theirs, each at most PRUNE_CHUNK; (payloads, rows) forgotten."""
    run = state.load(txn)
    if run.registration is None:
        return 0, 0
    pruned = 0
    kept = txn.ledger.kept_oldest(PRUNE_CHUNK)  # retention turned off: what it retained goes too
    if kept:
        rule = settings if settings.retaining else LedgerSettings(retain_steps=0)
        committed = state.load_kept(txn, run).committed
        total = txn.get_counts(RETAINED).get("bytes", 0)
        ids = payloads_to_prune(kept, total, run.step, committed, rule)
        if ids:
            txn.ledger.prune_payloads(ids)
            size = {k.id: k.bytes for k in kept}
            count_retained(txn, -len(ids), -sum(size[i] for i in ids))
            pruned = len(ids)
    if settings.max_groups is None and settings.max_steps is None:
        return pruned, 0
    first = txn.ledger.scan(-1, 1)
    next_id = txn.next_item_id() if first else 0
    below_id, below_step = ledger_bounds(next_id, first[0].id if first else 0, run.step, settings)
    return pruned, txn.ledger.prune(below_id, below_step)


# ------------------------------------------------------------------------------------------ reading it back


@dataclass(frozen=True, slots=True)
class Found:
    """What one read of the ledger found: rows, their envs' names, which served steps are committed, and
    the retained payloads asked for (`view` turns them into replies, outside the transaction)."""

    groups: list[LedgerGroup]
    env_names: dict[int, str]
    committed: dict[int, bool]
    payloads: dict[int, bytes]
    step: LedgerStep | None = None
    lost: frozenset[int] = frozenset()
    """Retained payloads asked for whose bytes the store lost (`readable_payloads`)."""


def readable_payloads(txn: Txn, ids: Sequence[int]) -> tuple[dict[int, bytes], frozenset[int]]:
    """The retained payloads of `ids` that read back, and the ids of those whose bytes the store lost (a SQLite
    payload segment after a power loss, docs/stores.md): a lost one is logged and left out, so the rows beside
    it are still answered (GET /ledger's `data_lost`, the export's rows without sequences), never a 500."""
    try:
        return txn.ledger.kept_payloads(ids), frozenset()
    except PayloadLost as exc:
        lost = frozenset(exc.item_ids)
        log.warning("retained payloads of ledger ids %s were lost, left out: %s", sorted(lost), exc)
        return txn.ledger.kept_payloads([i for i in ids if i not in lost]), lost


def _found(txn: Txn, groups: list[LedgerGroup], data: bool, step: LedgerStep | None = None) -> Found:
    run = state.load(txn)
    names = {g.env_id: run.env_name(g.env_id) for g in groups}
    served = sorted({g.step for g in groups if g.fate == SERVED and g.step is not None})
    committed: dict[int, bool] = {}
    if step is not None:
        committed[step.step] = step.committed_at is not None
    else:
        for n in served:  # the rows of one group id: a few steps
            rows = txn.ledger.steps(n, n)
            committed[n] = bool(rows) and rows[0].committed_at is not None
    payloads, lost = readable_payloads(txn, [g.id for g in groups if g.kept]) if data else ({}, frozenset())
    return Found(groups, names, committed, payloads, step, lost)


def read_step(txn: Txn, n: int, data: bool) -> Found | None:
    """Step `n`'s row and its groups' rows (None: no such row, never formed or pruned)."""
    rows = txn.ledger.steps(n, n)
    if not rows:
        return None
    return _found(txn, txn.ledger.groups(rows[0].group_ids), data, rows[0])


def read_named(txn: Txn, group_id: str, data: bool) -> Found:
    """The rows of every group sent under `group_id`."""
    return _found(txn, txn.ledger.named(group_id), data)


_COPIED = tuple(c.name for c in GROUP_RECORD if c.reply is not None)
"""The ledger's columns a reply copies as they are (the declaration's `Column.reply`)."""


def group_view(g: LedgerGroup, found: Found) -> dict[str, Any]:
    """A row as GET /ledger answers it (`LedgerGroupReply`, whose order it keeps)."""
    payload = found.payloads.get(g.id)
    values: dict[str, Any] = {name: getattr(g, name) for name in _COPIED}
    values.update(
        env_id=None if g.env_id == ANON_ENV else g.env_id,
        env=found.env_names.get(g.env_id, str(g.env_id)),
        fate=g.fate,
        committed=found.committed.get(g.step) if g.fate == SERVED and g.step is not None else None,
        data=None if payload is None else to_atropos(decode(payload)),
        data_lost=True if g.id in found.lost else None,
    )
    return {name: values[name] for name in GROUP_FIELDS}


def step_view(found: Found) -> dict[str, Any]:
    """A step as GET /ledger/steps/{step} answers it (`LedgerStepReply`)."""
    s = found.step
    assert s is not None
    return {
        "step": s.step,
        "formed_at": s.formed_at,
        "formation_s": s.formation_s,
        "committed_at": s.committed_at,
        "seqs": s.seqs,
        "tokens": s.tokens,
        "groups_by_env": s.groups_by_env,
        "seqs_by_env": s.seqs_by_env,
        "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
        "groups": [group_view(g, found) for g in found.groups],
    }
