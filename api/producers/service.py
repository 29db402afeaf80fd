"""The producers' flow (docs/training.md, "Producers"): heartbeats, the weights producers follow, and who is
producing as the views and a waiting trainer read it. Each operation is one store transaction over
`api.producers.stored`."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from api.owners import ANYONE, Actor
from api.producers.live import NOTHING_YET
from api.producers.stored import (
    ProducerReport,
    ProducerSettings,
    announce_txn,
    begin_txn,
    heartbeat_txn,
    load_weights,
    report_txn,
    sync_txn,
)
from api.run.state import RunState
from api.store.base import Store, Txn
from api.wire.producers import Heartbeat, HeartbeatReply, WeightsReply, WeightSyncReply

SiblingsDue = Callable[[Txn, Collection[str], float, float, Actor, RunState | None], float]
"""(txn, env names, now, horizon, caller, known run) -> seconds until a sibling slot of them may be leased."""


@dataclass(slots=True)
class Producers:
    store: Store
    settings: ProducerSettings = field(default_factory=ProducerSettings)
    """When a producer that stops heartbeating counts as gone, and how many are kept (`api.producers.live`)."""
    known: Callable[[], RunState | None] = lambda: None
    """The run state this process saw last (a report reads the envs past it only as far as they changed)."""
    siblings_due: SiblingsDue | None = None
    """When a slot of another producer's group of the named envs may be leased (`api.rollouts.txns
    .siblings_due_txn`, given by the service: the rollouts flow sits above this one), for a heartbeat that names
    `sibling_envs`."""
    _nothing_since: float | None = None
    """Since when (Unix time) this process has seen a registered run that no env or producer joined."""

    async def announce_weights(self, step: int) -> WeightsReply:
        """POST /weights: the weights of `step` are live; producers read it in /status-env and heartbeats."""
        return WeightsReply(weights_step=await self.store.transact(lambda txn: announce_txn(txn, step)))

    async def weights(self) -> WeightsReply:
        return WeightsReply(weights_step=await self.store.read(load_weights))

    async def begin_weights(self, step: int) -> WeightSyncReply:
        """POST /weights/pending: a sync to `step` begins; drain envs' producers stop and report drained."""
        now = time.time()
        return await self.store.transact(lambda txn: begin_txn(txn, step, now, self.settings))

    async def weight_sync(self) -> WeightSyncReply:
        """GET /weights/pending: the pending sync and who it waits for."""
        now = time.time()
        return await self.store.read(lambda txn: sync_txn(txn, now, self.settings))

    async def heartbeat(self, beat: Heartbeat, caller: Actor = ANYONE) -> HeartbeatReply:
        """Record a producer's heartbeat (one small write; wakes no long-poll in this process). With `sibling_envs`,
        when slots of other producers' groups of them may be leased (an indexed read of a few open groups)."""
        now, gone_after, known = time.time(), self.settings.gone_after, self.known()
        siblings_due = self.siblings_due

        def txn_fn(txn: Txn) -> tuple[tuple[int | None, int | None], float | None]:
            weights = heartbeat_txn(txn, beat, now, self.settings, caller)
            if beat.sibling_envs is None or siblings_due is None:
                return weights, None
            return weights, siblings_due(txn, beat.sibling_envs, now, gone_after, caller, known)

        (weights, pending), due = await self.store.transact(txn_fn)
        return HeartbeatReply(weights_step=weights, weights_pending=pending, gone_after=gone_after, siblings_due_in=due)

    async def report(self) -> ProducerReport:
        """Producers (live and gone), the weights step, and why a waiting trainer can get nothing (or None). A run
        nothing has joined yet is a stall only once that has lasted `gone_after` s (as seen by this process)."""
        now = time.time()
        known = self.known()
        return self.graced(await self.store.read(lambda txn: report_txn(txn, now, self.settings, known)), now)

    def graced(self, report: ProducerReport, now: float) -> ProducerReport:
        """`report` as this process shows it: a run nothing has joined yet is no stall until that has lasted
        `gone_after` s (since this process first saw it so)."""
        if report.stall_reason is None or not report.stall_reason.startswith(NOTHING_YET):
            self._nothing_since = None
            return report
        if self._nothing_since is None:
            self._nothing_since = now
        if now - self._nothing_since < self.settings.gone_after:
            return replace(report, stall_reason=None)
        return report
