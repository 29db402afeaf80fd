"""What the rollout routes do (docs/rollouts.md): `Rollouts`, one operation a route, each one store transaction
over api/rollouts/groups.py; a sealed group is ingested through the ingest flow (`Ingest.submit`), under
the group's id, so filters, limits, the ledger and a task lease's fate apply unchanged, and a seal interrupted
between its ingest and its mark is ingested again as a duplicate, never twice."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from api.config.groups import setting
from api.config.settings import Settings
from api.errors import RollbufError, Unavailable
from api.ingest.queue_limits import QueueLimits
from api.ledger.recorder import Recorder
from api.ledger.rules import Resumes
from api.owners import Actor
from api.rollouts.rows import COUNTS, group_of, readable, view
from api.rollouts.turn_txns import turn_txn, turns_txn
from api.rollouts.txns import (
    OpenBytesFull,
    drop_lapsed,
    heartbeat_txn,
    lease_txn,
    mark_txn,
    open_groups_txn,
    open_txn,
    post_txn,
    prune_txn,
    seal_txn,
    sealed_group,
    sweep_txn,
    totals_txn,
    unlease_txn,
)
from api.run.state import RunState
from api.scheduler import Periodic
from api.store.base import Store
from api.wire.rollouts import (
    GroupView,
    OpenGroupsStatus,
    OpenRequest,
    PostReply,
    RolloutHeartbeat,
    RolloutPost,
    SealRequest,
    SlotLease,
    SlotLeaseRequest,
    SlotPrefix,
    TurnPost,
    TurnReply,
)

log = logging.getLogger("rollbuf")


@dataclass(frozen=True, slots=True)
class SweepSettings:
    """The background sweep of open groups (`Rollouts.job`)."""

    every: float = setting("rollout_sweep_every_s")
    limit: int = setting("rollout_sweep_limit")
    keep: float = setting("rollout_keep_s")


PRUNE_EVERY_S = 60.0
"""Most seconds between two looks for decided groups past `rollout_keep_s` (fewer if `rollout_keep_s` is short):
a look that pruned `rollout_sweep_limit` groups looks again at the next sweep. On PostgreSQL a look scans the
groups' table (`OpenGroupTxn.decided`), so it is not paid every sweep."""


SWEEP_JOB = "rollout_sweep"
"""The sweep's name among the background jobs (its log lines name it)."""


@dataclass(slots=True)
class Rollouts:
    """The per-rollout groups' flow: each route's one operation, each in its own store transaction, and the
    background sweep (`job`) with the state it keeps between its runs. A sealed group enters the queue through
    the ingest flow (`ingest`), as any group does."""

    store: Store
    ingest: Callable[[bytes, Resumes | None], Awaitable[object]]
    """Ingest a sealed group's body (one msgpack group record, api/rollouts/assembly.py, on behalf of no key: its
    posts were checked) with its resumes for its ledger row (from its lineage, `sealed_group`)."""
    books: Callable[[], Recorder]
    """The ledger's recorder for one transaction, as the service's ledger settings make it now."""
    limits: QueueLimits = field(default_factory=QueueLimits)
    known: Callable[[], RunState | None] = lambda: None
    """The run state this process saw last: what a rollout is checked against without a read of its own."""
    sweeping: SweepSettings = field(default_factory=SweepSettings)
    """How often, and over how many groups, the sweep seals or expires open groups past their deadline."""
    lapse_cursor: tuple[float, str] = (-math.inf, "")
    """Where the sweep's walk over lapsed groups stands (`unlease`): (lapse, key)."""
    prune_at: float = 0.0
    """When (monotonic) the sweep next looks for decided groups past `rollout_keep_s` (`prune`)."""
    unfinished: set[str] = field(default_factory=set)
    """Open groups this process's sweep could not finish (a record it cannot read, a bug): logged and counted once,
    then skipped by its sweeps (`sweep`)."""
    refused: int = 0
    """Posts refused past `rollout_max_open_bytes` and not counted in the store yet: written by the next sweep
    (one transaction for all of them, not one more per refusal while the env is full)."""
    seen: bool = False
    """Whether this process has seen per-rollout groups in use: a rollout route called, a view that found groups
    open, or live or decided groups in the store when it started. Until then the sweep reads nothing: a run without
    them pays no store read a second (a waiting long-poll's process stays without transactions)."""

    @property
    def job(self) -> Periodic:
        """The sweep, by the clock: open groups past their deadline are sealed though no request comes (every
        producer of a group may be dead), once per-rollout groups are in use."""
        return Periodic(SWEEP_JOB, self.sweep_all, lambda: self.sweeping.every if self.seen else None, by_clock=True)

    async def start(self) -> None:
        """Sweep from the start if the store holds live or decided groups (a restart), else from the first sign of
        per-rollout groups (`in_use`)."""
        try:
            live = await self.store.read(
                lambda txn: bool(txn.rollouts.due(math.inf, 1) or txn.rollouts.decided(math.inf, 1))
            )
        except Unavailable:
            live = True  # unknown: sweep, one read a sweep while nothing is due
        self.seen = self.seen or live

    def in_use(self, open_now: int = 1) -> None:
        """Per-rollout groups are in use (a rollout route was called, or a view found `open_now` groups open):
        the background sweep runs from now on."""
        if open_now > 0:
            self.seen = True

    async def open(self, body: OpenRequest, settings: Settings, actor: Actor) -> GroupView:
        self.in_use()
        now, limits, known = time.time(), self.limits, self.known()
        return await self.store.transact(
            lambda txn: open_txn(txn, body, now, settings, actor, limits=limits, known=known)
        )

    async def post(self, body: RolloutPost, settings: Settings, actor: Actor) -> PostReply:
        self.in_use()
        now, books, limits, known = time.time(), self.books(), self.limits, self.known()
        try:
            reply, sealing = await self.store.transact(
                lambda txn: post_txn(txn, body, now, settings, books, actor, limits=limits, known_run=known)
            )
        except OpenBytesFull:
            self.refused += 1
            raise
        if sealing:
            await self.finish(body.group_id)
            reply = reply.model_copy(update={"group": await self.group(body.group_id, actor, lean=True)})
        return reply

    async def turn(self, body: TurnPost, settings: Settings, actor: Actor) -> TurnReply:
        self.in_use()
        limits, known = self.limits, self.known()
        return await self.store.transact(
            lambda txn: turn_txn(txn, body, settings, actor, limits=limits, known_run=known)
        )

    async def turns(
        self, key: str, slot: int, start: int, settings: Settings, actor: Actor, loc: tuple[str | int, ...]
    ) -> SlotPrefix:
        budget = settings.rollout_max_prefix_reply_bytes
        return await self.store.read(lambda txn: turns_txn(txn, key, slot, start, budget, actor, loc))

    async def seal(self, body: SealRequest, actor: Actor) -> GroupView:
        self.in_use()
        now = time.time()
        if await self.store.transact(lambda txn: seal_txn(txn, body, now, actor)):
            await self.finish(body.group_id)
        return await self.group(body.group_id, actor)

    async def lease(self, body: SlotLeaseRequest, settings: Settings, actor: Actor) -> list[SlotLease]:
        self.in_use()
        await self.sweep(settings.rollout_sweep_limit)
        now = time.time()
        n = min(body.n, settings.rollout_sweep_limit)
        return await self.store.transact(
            lambda txn: lease_txn(txn, body.producer_id, n, now, settings, body.envs, actor)
        )

    async def heartbeat(self, body: RolloutHeartbeat, lease_s: float, actor: Actor) -> dict[str, float | None]:
        self.in_use()
        now = time.time()
        return await self.store.transact(
            lambda txn: heartbeat_txn(txn, body.producer_id, body.group_ids, now, lease_s, actor)
        )

    async def totals(self) -> dict[str, int]:
        return await self.store.read(totals_txn)

    async def group(
        self, key: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "group_id"), *, lean: bool = False
    ) -> GroupView:
        return await self.store.read(lambda txn: view(txn, group_of(txn, key, actor, loc), lean=lean))

    async def open_groups(self) -> OpenGroupsStatus | None:
        """The per-rollout groups' block of the views (None in runs without them)."""
        block = await self.store.read(open_groups_txn)
        if block is not None:
            self.in_use(block.open)
        return block

    async def sweep_all(self) -> bool:
        """Seal or expire the open groups past their deadline, drop lapsed sibling leases, and prune the decided
        groups past their retention; again at once when any found as many as its limit."""
        limit = self.sweeping.limit
        await self.count_refused()
        more = await self.sweep(limit)
        more = await self.unlease(limit) or more
        return await self.prune(self.sweeping.keep, limit) or more

    async def count_refused(self) -> None:
        """Write the posts refused since the last sweep into the `refused` counter (kept for the next sweep while
        the store cannot be reached)."""
        n, self.refused = self.refused, 0
        if not n:
            return
        try:
            await self.store.transact(lambda txn: txn.add_counts(COUNTS, {"refused": n}))
        except Unavailable:
            self.refused += n  # the store is down: the sweep that follows meets it too

    async def finish(self, key: str) -> None:
        """Ingest a `sealing` group and mark it: a refusal of the data (422) expires it, with why; a refusal to wait
        (503: a full queue) leaves it `sealing`, for the next sweep."""
        sealed = await self.store.read(lambda txn: sealed_group(txn, key))
        if sealed is None:
            return
        refused = None
        try:
            await self.ingest(*sealed)  # its posts were checked
        except Unavailable:
            log.info("rollouts: group %r is sealed but its ingest must wait; retried by the next sweep", key)
            return
        except RollbufError as exc:
            refused = f"refused: {exc.detail}"[:500]
        now, books = time.time(), self.books()
        await self.store.transact(lambda txn: mark_txn(txn, key, refused, now, books))

    async def sweep(self, limit: int) -> bool:
        """Seal or expire what is due and finish interrupted seals (from POST /rollouts/lease and the service's
        background job, so that a group whose producers all died is sealed at its deadline); whether it decided on
        `limit` open groups (more may be due). Nothing due: one read, no write. A group it cannot read or finish (a
        record of another release, a bug) is logged and counted once and skipped from then on, never in the way of the
        groups behind it; a store that cannot be reached stops the sweep, for the next one."""
        now = time.time()
        skip = frozenset(self.unfinished)
        due = await self.store.read(lambda txn: txn.rollouts.due(now, len(skip) + 1))
        if all(row.key in skip for row in due):
            return False
        books = self.books()
        swept = await self.store.transact(lambda txn: sweep_txn(txn, now, limit, books, skip))
        for key, why in swept.unreadable.items():
            await self._unfinished(key, why)
        for key in swept.sealing:
            try:
                await self.finish(key)
            except RollbufError:
                raise  # the store is unavailable (a refusal of the group's data expires it in `finish`)
            except Exception as exc:
                await self._unfinished(key, f"{type(exc).__name__}: {exc}", exc)
        return swept.decided >= limit

    async def _unfinished(self, key: str, why: str, exc: BaseException | None = None) -> None:
        """A group this process cannot finish: logged (with the traceback of a failure) and counted (`unfinished`) once,
        then skipped by its sweeps. It stays as it is in the store, for a release that can read it."""
        if key in self.unfinished:
            return
        self.unfinished.add(key)
        log.error(
            "rollouts: the sweep cannot finish group %r (%s): left as it is and skipped by this server from now on",
            key,
            why,
            exc_info=exc,
        )
        await self.store.transact(lambda txn: txn.add_counts(COUNTS, {"unfinished": 1}))

    async def unlease(self, limit: int) -> bool:
        """Walk the open groups whose next check passed since this process last looked (its cursor, by lapse), up to
        `limit`, and drop their lapsed sibling leases (the background job's, after its sweep); whether it walked
        `limit` (more may have lapsed). Nothing lapsed: one indexed read, no write. A group walked with no lease to
        drop (its holder lapsed, its slots wait for a taker) is not walked again until it changes."""
        now, after = time.time(), self.lapse_cursor
        rows = await self.store.read(lambda txn: txn.rollouts.lapsed_since(after, now, limit))
        if not rows:
            return False
        keys = [r.key for r in rows if (g := readable(r)) is not None and drop_lapsed(g, now)]  # on a copy
        if keys:
            await self.store.transact(lambda txn: unlease_txn(txn, keys, now))
        self.lapse_cursor = (rows[-1].expires_at, rows[-1].key)
        return len(rows) >= limit

    async def prune(self, keep: float, limit: int) -> bool:
        """Delete up to `limit` groups decided more than `keep` seconds ago (the background job's, after its sweep;
        at most every `PRUNE_EVERY_S`, or `keep` / 4 if shorter, unless the last look pruned `limit`); whether it
        pruned `limit` (more may be due). Nothing to prune: one read, no write."""
        now = time.monotonic()
        if now < self.prune_at:
            return False
        before = time.time() - keep
        if not await self.store.read(lambda txn: txn.rollouts.decided(before, 1)):
            self.prune_at = now + min(PRUNE_EVERY_S, keep / 4)
            return False
        pruned = await self.store.transact(lambda txn: prune_txn(txn, before, limit))
        more = pruned >= limit
        self.prune_at = now if more else now + min(PRUNE_EVERY_S, keep / 4)
        return more
