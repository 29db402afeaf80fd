"""Counters kept in the store, and the one snapshot of the buffer that /metrics, /dashboard and W&B read.

They live in the store, written by the transactions that cause them, because every server process
(`--workers N`) and every replica on a shared store sees the same store: a counter kept there is the
run's, not one process's, and survives restarts like the queue it describes. `GET /reset_data` clears
them with everything else (Prometheus reads that as a counter reset).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import orjson

from api.run import state
from api.store.base import ANON_ENV, QueueCounts, Txn

RECEIVED = "received"
BACKPRESSURE = "backpressure"
SERVED_GROUPS = "served_groups"
SERVED_SEQS = "served_seqs"
PASSED_OVER = "passed_over"
"""Counter kinds (`Txn.add_counts`), by env name: a request adds to its env's counters, never reads the others'."""
SMALLER = "smaller_batches"
"""Counter kind: exact-mode batches of fewer than `batch_size` sequences (`no_exact_fill: "smaller"`), under ""."""
TRIMMED = "trimmed_sequences"
"""Counter kind: sequences cut off served groups (`no_exact_fill: "trim"`), left out, by env name; under
`TRIMMED_BATCHES`' "" the batches that cut any."""
TRIMMED_BATCHES = "trimmed_batches"
STALE_MASKED = "stale_tokens_masked"
"""Counter kind: trained tokens served masked because older weights than the env's `max_token_staleness` allows
sampled them, by env name."""
RELEASED_SHARES = "quiet_shares"
"""Counter kind (`api.batches.formation.QUIET_SHARES`): holds of a minimum allocation released, by env name."""
SERVED_KEY = "stats:served"
"""The batch count and the staleness histogram (bounded by STALENESS_CAP)."""
OTHER_ENVS = "(other envs)"
"""The name of the envs past a view's cap, summed (env names end in `_<n>`: no env has it)."""
STALENESS_CAP = 1024
"""Staleness is counted exactly up to here; anything beyond is counted here (no unbounded key set)."""


@dataclass(slots=True)
class Stats:
    """Cumulative counters of the run, by env name (the name /status uses)."""

    received: dict[str, int] = field(default_factory=dict)
    """Groups acknowledged (not duplicates), whether queued, side-buffered or dropped by a filter."""
    backpressure: dict[str, int] = field(default_factory=dict)
    """Submissions refused with 503 because a queue limit was reached."""
    served_groups: dict[str, int] = field(default_factory=dict)
    served_seqs: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    """Served groups by staleness (the batch's step minus the group's policy step)."""


def _get(txn: Txn, key: str) -> dict[str, Any]:
    raw = txn.get_value(key)
    return {} if raw is None else orjson.loads(raw)


def _put(txn: Txn, key: str, value: dict[str, Any]) -> None:
    txn.set_value(key, orjson.dumps(value).decode())


def load(txn: Txn) -> Stats:
    served = _get(txn, SERVED_KEY)
    return Stats(
        received=txn.get_counts(RECEIVED),
        backpressure=txn.get_counts(BACKPRESSURE),
        served_groups=txn.get_counts(SERVED_GROUPS),
        served_seqs=txn.get_counts(SERVED_SEQS),
        batches=served.get("batches", 0),
        staleness={int(k): v for k, v in served.get("staleness", {}).items()},
    )


def count_received(txn: Txn, per_env: dict[str, int]) -> None:
    txn.add_counts(RECEIVED, per_env)


def count_passed_over(txn: Txn, per_env: dict[str, int], *, smaller: bool) -> None:
    """A batch passed over the oldest item of these envs (newer ones taken), or held fewer than batch_size."""
    if per_env:
        txn.add_counts(PASSED_OVER, per_env)
    if smaller:
        txn.add_counts(SMALLER, {"": 1})


def count_trimmed(txn: Txn, per_env: dict[str, int]) -> None:
    """A batch cut these many sequences off its groups, per env: left out, never served."""
    txn.add_counts(TRIMMED, per_env)
    txn.add_counts(TRIMMED_BATCHES, {"": 1})


def count_stale_masked(txn: Txn, per_env: dict[str, int]) -> None:
    """A batch masked these many trained tokens out of the loss for their age, per env."""
    txn.add_counts(STALE_MASKED, per_env)


def holds(txn: Txn, run: state.RunState, now: float) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds each env's minimum allocation has held batches back so far (this episode), and holds released."""
    held = {run.env_name(e): now - since for e, (since, _) in state.load_quiet(txn).items()}
    return held, txn.get_counts(RELEASED_SHARES)


def count_batch(txn: Txn, groups: dict[str, int], seqs: dict[str, int], staleness: dict[int, int]) -> None:
    txn.add_counts(SERVED_GROUPS, groups)
    txn.add_counts(SERVED_SEQS, seqs)
    served = _get(txn, SERVED_KEY)
    served["batches"] = served.get("batches", 0) + 1
    hist = served.setdefault("staleness", {})
    for age, n in staleness.items():
        key = str(min(max(age, 0), STALENESS_CAP))
        hist[key] = hist.get(key, 0) + n
    _put(txn, SERVED_KEY, served)


@dataclass(frozen=True, slots=True)
class EnvSnapshot:
    name: str
    weight: float
    group_size: int
    connected: bool
    min_batch_allocation: float | None
    queue: QueueCounts
    received: int
    served_groups: int
    served_seqs: int
    backpressure: int
    dropped: dict[str, int]
    held: QueueCounts = QueueCounts()
    """What its side buffer holds (groups of another size than its group_size)."""
    passed_over: int = 0
    """Batches that passed over its oldest group (took newer ones of it)."""
    holding_seconds: float = 0.0
    """How long its minimum allocation has held batches back (this episode; 0 when it does not)."""
    released_shares: int = 0
    """Episodes in which its minimum held batches back past `quiet_share_seconds` and was released."""
    trimmed: int = 0
    """Sequences cut off its served groups and left out (`no_exact_fill: "trim"`)."""
    stale_masked: int = 0
    """Trained tokens of its served groups masked out of the loss for their age (`max_token_staleness`)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The buffer as one transaction saw it."""

    registered: bool
    step: int
    batches: int
    batch_size: int | None
    blocked_reason: str | None
    staleness: dict[int, int]
    envs: list[EnvSnapshot]
    wandb_project: str | None = None
    wandb_group: str | None = None
    committed: int = 0
    """Every batch before this step is acknowledged."""
    kept_batches: int = 0
    kept_bytes: int = 0
    """Served batches kept for serving again, and their bytes."""
    acknowledge: str = "next"
    envs_total: int = 0
    """Envs in all: those in `envs` and those summed into its `OTHER_ENVS` entry."""

    def to_json(self) -> dict[str, Any]:
        return {
            "registered": self.registered,
            "step": self.step,
            "batches": self.batches,
            "batch_size": self.batch_size,
            "blocked_reason": self.blocked_reason,
            "committed": self.committed,
            "kept_batches": self.kept_batches,
            "kept_bytes": self.kept_bytes,
            "acknowledge": self.acknowledge,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "envs_total": self.envs_total,
            "envs": [
                {
                    "name": e.name,
                    "weight": e.weight,
                    "group_size": e.group_size,
                    "connected": e.connected,
                    "min_batch_allocation": e.min_batch_allocation,
                    "queue_groups": e.queue.groups,
                    "queue_seqs": e.queue.seqs,
                    "queue_tokens": e.queue.tokens,
                    "held_groups": e.held.groups,
                    "held_tokens": e.held.tokens,
                    "received": e.received,
                    "served_groups": e.served_groups,
                    "served_seqs": e.served_seqs,
                    "backpressure": e.backpressure,
                    "dropped": e.dropped,
                    "passed_over": e.passed_over,
                    "holding_seconds": e.holding_seconds,
                    "released_shares": e.released_shares,
                }
                for e in self.envs
            ],
        }


def snapshot(
    txn: Txn,
    anon_name: str,
    unwritten_backpressure: dict[str, int] | None = None,
    known: state.RunState | None = None,
    max_envs: int | None = None,
) -> Snapshot:
    """Read everything the operator's views show, in one transaction (so the numbers agree), plus refusals this
    process counted and has not written yet. `known`: the run state this process read last, so that only envs
    changed since are read (`state.load`: every env re-read and parsed made /dashboard/data 0.2 s longer with
    10,000 envs). `max_envs`: the first envs each get an entry and the rest are summed into one `OTHER_ENVS`
    (building 10,000 entries was most of the dashboard's poll)."""

    run = state.load(txn, known)
    stats = load(txn)
    for name, n in (unwritten_backpressure or {}).items():
        stats.backpressure[name] = stats.backpressure.get(name, 0) + n
    dropped = state.load_dropped(txn)
    passed = txn.get_counts(PASSED_OVER)
    trimmed = txn.get_counts(TRIMMED)
    stale_masked = txn.get_counts(STALE_MASKED)
    holding, released = holds(txn, run, time.time())
    counts = txn.counts()
    held = txn.held.counts()
    envs: list[tuple[int, str, float, int, bool, float | None]] = [
        (e.env_id, e.wandb_name, e.weight, e.group_size, e.connected, e.min_batch_allocation) for e in run.envs
    ]
    anon_seen = counts.get(ANON_ENV, QueueCounts()).items or anon_name in stats.received or anon_name in dropped
    if anon_seen:
        envs.append((ANON_ENV, anon_name, 1.0, 0, True, None))
    rest = envs[max_envs:] if max_envs is not None else []
    shown = envs[: len(envs) - len(rest)]
    reg = run.registration
    kept = state.load_kept(txn, run)
    return Snapshot(
        registered=reg is not None,
        step=run.step if reg else 0,
        batches=stats.batches,
        batch_size=reg.batch_size if reg else None,
        blocked_reason=state.load_blocked(txn),
        staleness=stats.staleness,
        envs=[
            EnvSnapshot(
                name=name,
                weight=weight,
                group_size=group_size,
                connected=connected,
                min_batch_allocation=share,
                queue=counts.get(env_id, QueueCounts()),
                held=held.get(env_id, QueueCounts()),
                received=stats.received.get(name, 0),
                served_groups=stats.served_groups.get(name, 0),
                served_seqs=stats.served_seqs.get(name, 0),
                backpressure=stats.backpressure.get(name, 0),
                dropped=dropped.get(name, {}),
                passed_over=passed.get(name, 0),
                holding_seconds=holding.get(name, 0.0),
                released_shares=released.get(name, 0),
                trimmed=trimmed.get(name, 0),
                stale_masked=stale_masked.get(name, 0),
            )
            for env_id, name, weight, group_size, connected, share in shown
        ]
        + ([_summed(rest, counts, held, stats, dropped, passed, released, trimmed, stale_masked)] if rest else []),
        wandb_project=reg.wandb_project if reg else None,
        wandb_group=reg.wandb_group if reg else None,
        committed=kept.committed if reg else 0,
        kept_batches=len(kept.sizes),
        kept_bytes=kept.bytes,
        acknowledge=reg.acknowledge if reg else "next",
        envs_total=len(envs),
    )


def _summed(
    envs: list[tuple[int, str, float, int, bool, float | None]],
    counts: dict[int, QueueCounts],
    held: dict[int, QueueCounts],
    stats: Stats,
    dropped: dict[str, dict[str, int]],
    passed: dict[str, int],
    released: dict[str, int],
    trimmed: dict[str, int],
    stale_masked: dict[str, int],
) -> EnvSnapshot:
    """These envs as one `OTHER_ENVS` entry: counts summed, weight summed, connected if any is."""
    ids = [e[0] for e in envs]
    names = [e[1] for e in envs]

    def total(by_name: dict[str, int]) -> int:
        return sum(map(by_name.get, names, repeat(0)))

    def queues(by_id: dict[int, QueueCounts]) -> QueueCounts:
        found = [c for c in map(by_id.get, ids) if c is not None]
        return QueueCounts(
            sum(c.items for c in found),
            sum(c.groups for c in found),
            sum(c.seqs for c in found),
            sum(c.tokens for c in found),
            sum(c.bytes for c in found),
        )

    reasons: dict[str, int] = {}
    for by_reason in filter(None, map(dropped.get, names)):
        for reason, n in by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + n
    return EnvSnapshot(
        name=OTHER_ENVS,
        weight=sum(e[2] for e in envs),
        group_size=0,
        connected=any(e[4] for e in envs),
        min_batch_allocation=None,
        queue=queues(counts),
        held=queues(held),
        received=total(stats.received),
        served_groups=total(stats.served_groups),
        served_seqs=total(stats.served_seqs),
        backpressure=total(stats.backpressure),
        dropped=reasons,
        passed_over=total(passed),
        released_shares=total(released),
        trimmed=total(trimmed),
        stale_masked=total(stale_masked),
    )
