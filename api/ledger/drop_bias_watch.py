"""The drop-bias monitor fed from the ledger (`api.ledger.drop_bias` decides; this reads and logs).

Each refresh is one read transaction costing what was decided since the last one: the step rows formed since
(`ledger.steps`), the groups they served (`ledger.groups`) and the groups dropped meanwhile
(`ledger.dropped`); the monitor's windows keep the rest, and its report is recomputed only when something new
was read. A view refreshes when it is asked (/metrics, /status, /dashboard/data); a trainer's `/batch` calls
refresh it in the background at most every `REFRESH_S`, so that episodes are logged when nobody looks.

An episode (a condition starting, then ending) is logged once for the whole run, not once per process or per
poll: the conditions in force are kept in the store (`EPISODES_KEY`), and only the process whose transaction
changes them writes the log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import orjson

from api.ledger.drop_bias import (
    Decision,
    DropBias,
    EnvTarget,
    Episodes,
    Report,
    StepMix,
    Thresholds,
    describe,
    describe_end,
)
from api.run import state
from api.run.state import RunState, scale_shares
from api.store.base import LedgerGroup, LedgerStep, Store, Txn

log = logging.getLogger("rollbuf")

REFRESH_S = 1.0
"""Shortest time between two background refreshes (from `/batch` calls); a view refreshes when it is asked."""
EPISODES_KEY = "drop_bias:episodes"
"""The conditions in force, as the last process to log one saw them: `[[env, condition], ...]`."""
MAX_DROPPED = 10_000
"""Most dropped rows one refresh reads (the monitor keeps `window_groups` per env anyway)."""


def targets_of(run: RunState) -> list[EnvTarget]:
    """What formation aims at for each registered env: its weight, and its minimum share scaled as formation
    scales it (over the connected envs)."""
    shares = scale_shares({e.env_id: e.min_batch_allocation for e in run.envs if e.connected})
    return [EnvTarget(e.wandb_name, e.weight, shares.get(e.env_id, 0.0), e.connected) for e in run.envs]


def decision(row: LedgerGroup, env: str) -> Decision:
    latency = None if row.decided_at is None else max(0.0, row.decided_at - row.acked_at)
    return Decision(env, row.reason is None, row.reason, row.seqs, row.tokens, row.score_mean, latency)


@dataclass(frozen=True, slots=True)
class Fresh:
    """What was decided since the last refresh, read in one transaction."""

    run: RunState
    steps: list[LedgerStep]
    served: list[LedgerGroup]
    dropped: list[LedgerGroup]


def read_fresh(txn: Txn, first: int, window: int, known: RunState | None = None) -> Fresh:
    """Steps from `first` (or the window's start, if later) to the last one formed, with the groups they served
    and those dropped while they were the next to form. `known`: the run state read last, so that only envs
    changed since are read (re-reading and parsing 10,000 envs was most of a refresh, #35)."""
    run = state.load(txn, known)
    first = max(first, run.step - window)
    if first >= run.step:
        return Fresh(run, [], [], [])
    steps = txn.ledger.steps(first, run.step - 1)
    served = txn.ledger.groups([i for s in steps for i in s.group_ids])
    dropped = txn.ledger.dropped(first, run.step - 1, MAX_DROPPED)
    return Fresh(run, steps, served, dropped)


def record_episodes(txn: Txn, active: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Store the conditions in force; (started, ended) relative to what the store held: empty when another
    process has recorded (and logged) the same change already."""
    raw = txn.get_value(EPISODES_KEY)
    before = {(env, cond) for env, cond in (orjson.loads(raw) if raw else [])}
    now = set(active)
    if now != before:
        txn.set_value(EPISODES_KEY, orjson.dumps(sorted(now)).decode())
    return sorted(now - before), sorted(before - now)


@dataclass(slots=True)
class BiasWatch:
    """One process's monitor, its cursor in the ledger, and the report it last made."""

    thresholds: Thresholds = field(default_factory=Thresholds)
    monitor: DropBias = field(init=False)
    episodes: Episodes = field(default_factory=Episodes)
    next_step: int = 0
    """The first step this monitor has not seen."""
    report: Report | None = None
    refreshed_at: float = float("-inf")
    _targets: list[EnvTarget] = field(default_factory=list)
    _run: RunState | None = None
    """The run state the last refresh read (its envs are those `_targets` were made of)."""
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.monitor = DropBias(self.thresholds)

    def due(self, now: float) -> bool:
        return now - self.refreshed_at >= REFRESH_S

    async def refresh(self, store: Store) -> Report:
        """Read what was decided since the last refresh (one read transaction, nothing when nothing was), report
        (recomputed only when something was read or the envs changed), and log the episodes that started or
        ended."""
        async with self._lock:
            self.refreshed_at = time.monotonic()
            window = self.thresholds.window_steps
            known = self._run
            fresh = await store.read(lambda txn: read_fresh(txn, self.next_step, window, known))
            if fresh.run.step < self.next_step:  # the run was reset: a new monitor
                self.monitor, self.episodes, self.next_step = DropBias(self.thresholds), Episodes(), 0
                fresh = await store.read(lambda txn: read_fresh(txn, 0, window, known))
            unchanged = known is not None and fresh.run.envs is known.envs  # `state.load` kept them: none changed
            targets = self._targets if unchanged else targets_of(fresh.run)
            if self.report is not None and not (fresh.steps or fresh.dropped) and targets == self._targets:
                self._run = fresh.run
                return self.report
            names = fresh.run.env_name
            for step in fresh.steps:
                self.monitor.observe_step(StepMix(step.step, step.seqs_by_env))
            for row in fresh.served:
                self.monitor.observe(decision(row, names(row.env_id)))
            for row in fresh.dropped:
                self.monitor.observe(decision(row, names(row.env_id)))
            self.next_step = max(self.next_step, fresh.run.step)
            self._targets, self._run = targets, fresh.run
            report = self.report = self.monitor.report(targets)
            started, ended = self.episodes.update(report)
            if started or ended:
                await self._log(store, report)
            return report

    async def _log(self, store: Store, report: Report) -> None:
        active = sorted(self.episodes.active)
        started, ended = await store.transact(lambda txn: record_episodes(txn, active))
        by_name = {e.env: e for e in report.envs}
        for env, cond in started:
            log.warning("drop bias: %s", describe(by_name[env], cond, report.thresholds))
        for key in ended:
            log.info("drop bias: %s", describe_end(key))
