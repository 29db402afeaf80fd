"""What /scored_data does: `Ingest`, a request's groups validated and stored all-or-nothing (`submit`), the
refusals of a full queue counted in memory and written together, and the side buffers' expired groups swept;
both of those run as its background jobs (`Ingest.jobs`)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from api.errors import InvalidData, Unavailable
from api.ingest import submissions
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import Submission
from api.ingest.submit import VALIDATION_ROUNDS, QueueFull, StaleRun, expire_txn, submit_txn
from api.ledger.recorder import Recorder
from api.ledger.rules import Resumes
from api.logs import request_env
from api.owners import ANYONE, Actor
from api.run import stats
from api.run.blobs import BlobTier, Stored
from api.run.offloop import INLINE_PARSE, off_loop
from api.run.state import RunState, visible_env
from api.scheduler import Periodic
from api.store.base import Store, Txn
from api.wire.records import GroupRecord, decode
from api.wire.schema import ScoredReply

log = logging.getLogger("rollbuf")

REFUSALS_FLUSH_S = 1.0
"""Longest time a refusal's count waits in memory before it is written (with every other one since)."""
LATEST_MAX_BYTES = 4 << 20
"""Largest group (as stored) that GET /latest_example shows; a larger one leaves the previous example."""
REFUSALS, SWEEP, BLOB_SWEEP = "refusals", "side_buffer_sweep", "blob_sweep"
"""The ingest flow's background jobs' names (`Ingest.jobs`)."""


@dataclass(slots=True)
class Ingest:
    """The ingest flow. It validates against the service's remembered run state (`known`) and hands back what
    its transactions saw (`remember`), so the flows share one view of the run without a read of their own."""

    store: Store
    known: Callable[[], RunState | None]
    remember: Callable[[RunState], None]
    books: Callable[[], Recorder]
    """The ledger's recorder for one transaction (`Ledger.recorder`)."""
    changed: Callable[[], None]
    """Called once groups are queued: a long-polling trainer may get a batch (`Wakeups.changed`)."""
    ask: Callable[[str], object]
    """Asks for one of this flow's background jobs by name (`Scheduler.ask`)."""
    fresh: Callable[[], Awaitable[RunState]]
    """The run state read from the store now, and remembered (`Service.run_state`)."""
    limits: QueueLimits = field(default_factory=QueueLimits)
    refusals_flush_s: float = REFUSALS_FLUSH_S
    blobs: BlobTier | None = None
    """The blob tier: a group's large values are written there before its transaction (`BlobTier.store_record`),
    and collected there when nothing refers to them (`BLOB_SWEEP`); None: they stay in the row."""
    _latest: bytes | None = None
    """The stored record of the last group of at most `LATEST_MAX_BYTES` this process queued."""
    _refused: dict[str, int] = field(default_factory=dict)
    """Submissions refused for a full queue, by env name, not written yet (`_count_refused`)."""

    @property
    def jobs(self) -> list[Periodic]:
        """Refusals counted in memory are written together; the side buffers' expired groups are swept, asked by
        a live run's calls (an env whose groups expire may send nothing more)."""
        jobs = [
            Periodic(REFUSALS, self._flush_refused),
            Periodic(SWEEP, self._sweep, lambda: self.limits.side.sweep_every()),
        ]
        if self.blobs is not None:
            every = self.blobs.limits.sweep_every
            jobs.append(Periodic(BLOB_SWEEP, self._collect_blobs, lambda: every, by_clock=True))
        return jobs

    @property
    def latest(self) -> GroupRecord | None:
        """The last group queued by this process, of those of at most `LATEST_MAX_BYTES` (GET /latest_example is
        a debugging aid, not state: a bounded copy of its record, never a view into the request that sent it)."""
        return None if self._latest is None else decode(self._latest)

    @property
    def refused(self) -> dict[str, int]:
        """Refusals counted and not written yet: the views show them all the same."""
        return dict(self._refused)

    def reset(self) -> None:
        """Forget the latest example (the run was reset)."""
        self._latest = None

    async def submit(
        self,
        raw: bytes | bytearray,
        content_type: str | None,
        *,
        many: bool,
        key: str | None = None,
        caller: Actor = ANYONE,
        sealed: bool = False,
        resumes: Resumes | None = None,
    ) -> list[ScoredReply]:
        """Validate a request's groups (`api.ingest.submissions.decode`: JSON or msgpack, one or a list, `key` the
        request's Idempotency-Key as `submissions.request_key`) and store them all-or-nothing. `sealed`: the group is a
        per-rollout group's seal, under its open group's own id; `resumes`: its resumes, from the rollouts flow's own
        lineage (no route passes either: a body cannot claim them).

        They are validated against the run state this process saw last, not a fresh read: one store round trip
        less per request, which is what a shared database charges most for. The transaction checks that what
        validation relied on still holds, and if not (another process changed the run), they are validated
        again against the state it found. A request refused against a remembered state is validated once more
        against a fresh read before the refusal stands (an env registered through another process since)."""
        with self.store.expecting():  # a group commit starting meanwhile may wait for this request's groups
            known = self.known()
            run, remembered = (known, True) if known is not None else (await self.fresh(), False)
            for _ in range(VALIDATION_ROUNDS):
                try:
                    subs = await self._decode(raw, content_type, run, many=many, key=key)
                    if sealed:
                        subs = [replace(s, sealed=True, resumes=resumes) for s in subs]
                except (InvalidData, Unavailable):
                    if not remembered:
                        raise
                    fresh = await self.fresh()
                    if fresh == run:
                        raise
                    run, remembered = fresh, False
                    continue
                for sub in subs:
                    if sub.env_id is not None and visible_env(caller, run, sub.env_id) is None:
                        unknown = f"no environment with env_id {sub.env_id} is registered"
                        raise InvalidData((*sub.loc, "env_id"), unknown)
                try:
                    return await self.store_submissions(subs, run, caller)
                except StaleRun as stale:
                    run, remembered = stale.run, False
            raise Unavailable("the run kept changing while this request was validated; send it again", 0)

    async def _decode(
        self, raw: bytes | bytearray, content_type: str | None, run: RunState, *, many: bool, key: str | None
    ) -> list[Submission]:
        """`submissions.decode` on the event loop for a small body, in a worker thread for a large one (other
        requests go on meanwhile); the env it names is kept for the request's log line either way (on the loop
        it is set in the request's own context, so no copy of it is needed)."""
        if len(raw) <= INLINE_PARSE:
            return submissions.decode(raw, content_type, run, self.limits, many=many, key=key)
        ctx = contextvars.copy_context()
        try:
            return await off_loop(
                len(raw),
                INLINE_PARSE,
                ctx.run,
                partial(submissions.decode, raw, content_type, run, self.limits, many=many, key=key),
            )
        finally:
            request_env.set(ctx.get(request_env))

    async def store_submissions(
        self, subs: Sequence[Submission], run: RunState, caller: Actor = ANYONE
    ) -> list[ScoredReply]:
        """Store groups validated against `run` all-or-nothing (the JSON and binary paths both end here);
        `StaleRun` if the store's run state no longer agrees with `run` on what validation used. `caller`: who
        sent them (the ledger names its key; a group under a task lease must be its holder's)."""
        sent = subs
        tier = self.blobs
        stored: list[Stored] = []
        if tier is not None and any(len(s.payload) >= tier.limits.min_bytes for s in subs):
            stored = await asyncio.to_thread(lambda: [tier.store_record(s.payload, caller.owner) for s in subs])
            subs = [replace(s, payload=st.payload) for s, st in zip(subs, stored, strict=True)]

        def txn_fn(txn: Txn) -> tuple[list[ScoredReply], RunState]:
            if tier is not None and stored:
                tier.check_fresh(stored)
            return submit_txn(txn, subs, run, self.limits, self.books(), caller)

        try:
            replies, after = await self.store.transact(txn_fn, replies=[s.key for s in subs if s.key])
        except StaleRun as stale:
            self.remember(stale.run)
            raise
        except QueueFull:
            names = {run.env_name(s.env_id) for s in subs}
            request_env.set(",".join(sorted(names)))
            self._count_refused(names)
            raise
        self.remember(after)
        if subs:
            kept = [s.payload for s in sent if len(s.payload) <= LATEST_MAX_BYTES]
            if kept:
                self._latest = bytes(kept[-1])
            self.changed()
        return replies

    def _count_refused(self, names: set[str]) -> None:
        """Count a refusal without a write of its own: a handler retrying into a full queue once ran one write
        transaction per 503 (7,671 of them grew the WAL to 959 MB). Refusals add up in memory and are written
        together at most every `REFUSALS_FLUSH_S` (a crash loses at most that much of a counter, never data)."""
        for name in names:
            self._refused[name] = self._refused.get(name, 0) + 1
        self.ask(REFUSALS)

    async def _flush_refused(self) -> bool:
        await asyncio.sleep(self.refusals_flush_s)  # gathering refusals: one write for all of them
        refused, self._refused = self._refused, {}
        try:
            await self.store.transact(lambda txn: txn.add_counts(stats.BACKPRESSURE, refused))
        except Unavailable:
            for name, n in refused.items():  # the store is down: counted with the next flush
                self._refused[name] = self._refused.get(name, 0) + n
        return bool(self._refused)  # more came meanwhile (or the store was down): flushed again

    async def _sweep(self) -> None:
        """Expire held groups of every env (`SideLimits.sweep_every`)."""
        if not await self.store.read(lambda txn: bool(txn.held.counts())):
            return  # the common case: nothing held, nothing written
        n = await self.store.transact(
            lambda txn: expire_txn(txn, time.time(), self.limits.side, self.known(), self.books())
        )
        if n:
            log.info(
                "side buffer: %d held groups expired after %.0f s (counted as dropped: %s)",
                n,
                self.limits.side.ttl,
                "side_buffer_expired",
            )

    async def _collect_blobs(self) -> None:
        """Collect the blobs nothing refers to (`BlobTier.collect`); a failure is logged and tried again later."""
        assert self.blobs is not None
        try:
            await self.blobs.collect(self.store)
        except Unavailable as exc:
            log.warning("blobs: not collected, the store being unavailable: %s", exc)

    async def close(self) -> None:
        """Write what is counted in memory (refusals) before the store closes (after the jobs stopped)."""
        if self._refused:
            refused, self._refused = self._refused, {}
            try:
                await self.store.transact(lambda txn: txn.add_counts(stats.BACKPRESSURE, refused))
            except Unavailable:
                log.warning("refusals not counted at shutdown, the store being unavailable: %s", refused)
