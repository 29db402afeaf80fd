"""What the trainer's batch routes do: `Batches`, forming the next batch (`next_batch`), acknowledging batches
(`commit`), and GET /batch's long-poll (`poll`), which waits for a change a batch may be formed from and hands
a change it did not use on to the next waiter (`api.batches.wakeups`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from api.batches import lost
from api.batches.acknowledge import commit_txn
from api.batches.formation import FormationRules, batch_txn
from api.batches.outcomes import BatchWaiting, FormedBatch
from api.batches.wakeups import Wakeups
from api.http.auth import Unauthorized
from api.ledger.recorder import Recorder
from api.ledger.service import WATCH
from api.logs import RateLimiter
from api.meters import FORMATION_SECONDS, WAITING_LONG_POLLS
from api.producers.service import Producers
from api.producers.stored import ProducerReport, report_txn
from api.run.blobs import BlobTier
from api.run.kept import ReadAhead, ReadAheadFull
from api.run.state import RunState
from api.scheduler import Scheduler
from api.store.base import Store, Txn
from api.wire.schema import CommitReply

log = logging.getLogger("rollbuf")

STALL_WARN_S = 30.0
STALLS = RateLimiter(interval=STALL_WARN_S, burst=1)
"""A long-poll that has waited this long without a batch logs a warning with the reason (then every 30 s)."""

NOT_REGISTERED: dict[str, object] = {
    "status": "error",
    "message": "Trainer not registered. Call /register first.",
    "batch": [],
}
"""GET /batch's reply before a trainer registered (Atropos's, in-band)."""


@dataclass(slots=True)
class Batches:
    """The batches' flow: one transaction forms a batch or says why not; one acknowledges batches. The run state
    it validates against is the service's remembered one (`known`), and a commit hands back what it saw
    (`remember`), so the flows share one view of the run without a read of their own."""

    store: Store
    known: Callable[[], RunState | None]
    remember: Callable[[RunState], None]
    books: Callable[[], Recorder]
    """The ledger's recorder for one transaction (`Ledger.recorder`)."""
    producers: Producers
    """Who is producing: a waiting trainer is told why nothing can arrive (`stall_reason`)."""
    jobs: Scheduler
    each_try: tuple[str, ...] = ()
    """The background jobs every batch attempt asks for (the side-buffer sweep, the ledger's pruning)."""
    read_ahead: ReadAhead = field(default_factory=ReadAhead)
    rules: FormationRules = field(default_factory=FormationRules)
    wakeups: Wakeups = field(default_factory=Wakeups)
    stall_reason: str | None = None
    blobs: BlobTier | None = None
    """The blob tier, whose blobs are put back into each batch served (`BlobTier.inline`); None: no tier."""
    """Why nothing can arrive for a waiting trainer, as this process's last batch attempt that found no batch
    read it (in the same transaction: a waiting long-poll costs no read of its own)."""

    async def next_batch(self, step: int | None = None, *, as_json: bool = False) -> FormedBatch | BatchWaiting:
        """Batch `step`, forming it if it is the next one; without `step`, form the next batch (Atropos).

        With `step`, batch N stays available until batch N+1 is asked for, so a trainer that retries or
        restarts gets the same batch again: nothing skipped, nothing trained twice. The first call of either
        kind marks the run as started (environments may register from then on).
        """
        for job in self.each_try:
            self.jobs.ask(job)
        now = time.time()

        def txn_fn(txn: Txn) -> tuple[FormedBatch | BatchWaiting, ProducerReport | None]:
            gone_after = self.producers.settings.gone_after
            result = batch_txn(
                txn,
                step,
                self.known(),
                as_json=as_json,
                read_ahead=self.read_ahead,
                books=self.books(),
                rules=self.rules,
                gone_after=gone_after,
            )
            if isinstance(result, FormedBatch) and self.blobs is not None:
                self.blobs.check_present(result.records)  # else nothing is taken
            waiting = isinstance(result, BatchWaiting) and not result.not_registered
            return result, report_txn(txn, now, self.producers.settings, self.known()) if waiting else None

        result, report = await lost.dropping_lost(self.store, txn_fn, self.known(), self.books())
        if isinstance(result, FormedBatch) and self.blobs is not None and self.blobs.holds_refs(result.records):
            result = await asyncio.to_thread(_inlined, self.blobs, result)
        self.stall_reason = None if report is None else self.producers.graced(report, now).stall_reason
        if isinstance(result, FormedBatch) and result.formation is not None:
            self.jobs.ask(WATCH)  # a batch formed: what the monitor reads changed (a waiting poll costs no read)
            formed = result.formation
            FORMATION_SECONDS.observe(formed.seconds)
            mix = " ".join(f"{name}={n}" for name, n in formed.seqs_by_env.items())
            log.info(
                "batch step=%d groups=%d sequences=%d tokens=%d mix=[%s] formation_ms=%.2f",
                result.step,
                result.n_groups,
                result.seqs,
                result.tokens,
                mix,
                formed.seconds * 1000,
            )
        return result

    async def commit(self, step: int) -> CommitReply:
        """Acknowledge every batch before `step` (POST /commit); wakes a trainer waiting at its read-ahead bound."""
        reply, run = await self.store.transact(lambda txn: commit_txn(txn, step, self.known(), self.books()))
        self.remember(run)
        self.wakeups.changed()
        return reply

    async def poll(
        self,
        step: int | None,
        *,
        as_json: bool,
        wait: float,
        gone: Callable[[], Awaitable[bool]],
        admitted: Callable[[], bool],
        retry_after: float,
    ) -> FormedBatch | dict[str, object]:
        """GET /batch: a formed batch, or the reply that says why none (`_no_batch`), after waiting up to `wait`
        seconds for one. `gone` says whether the client has disconnected, `admitted` whether its key still
        admits it: both are asked before each try after the first, since a batch formed for a client that
        cannot take it would be lost to it (without ?step=). Raises `ReadAheadFull` (a 503 after `retry_after`
        s) when a commit-mode trainer is at its read-ahead bound at the deadline, `Unauthorized` for a key
        revoked while it waited."""
        started = time.monotonic()
        deadline = started + wait
        warn_at = started + STALL_WARN_S
        wakeups = self.wakeups
        tried_at = wakeups.count
        result = await self.next_batch(step, as_json=as_json)
        recheck_at = _recheck_at(result)
        while True:
            if isinstance(result, FormedBatch):
                wakeups.pass_on()  # another waiter may find a batch too
                return result
            if result.not_registered:
                return dict(NOT_REGISTERED)
            now = time.monotonic()
            if now >= warn_at:
                warn_at = now + STALL_WARN_S
                held = STALLS.allow(("stall",))  # one line for all the waiters: 2,000 of them are one stall
                if held is not None:
                    which = "the next batch" if step is None else f"batch {step}"
                    more = f" ({held} similar lines held back)" if held else ""
                    why = result.reason or self.stall_reason or "no data"
                    log.warning("stall: a trainer has waited %.0f s for %s: %s%s", now - started, which, why, more)
            remaining = deadline - now
            if remaining <= 0 or wakeups.closed or result.finished:  # the deadline, the server stopping, the run's end
                if wakeups.count != tried_at:
                    wakeups.pass_on()  # a change since its last try or its wait ended: the next waiter tries it
                if result.read_ahead:  # not now: a commit ends it (clients retry a 503; a 4xx they would not)
                    raise ReadAheadFull(result.reason, retry_after)
                return _no_batch(result, self.stall_reason)
            # Nothing changed since the last try: wait, at no cost, to be woken. Changes while waiting without
            # being woken were another waiter's to try (it found no batch, or it took one and woke the next): a
            # deadline passes on nothing, so 2,000 polls expiring together run no formation.
            if wakeups.count == tried_at:
                with WAITING_LONG_POLLS.track_inprogress():
                    seen = await wakeups.wait(min(remaining, warn_at - now, max(0.0, recheck_at - now)))
                if wakeups.closed:
                    continue  # answered above, with what the last try found
                if seen is not None:  # not woken: the changes it slept through woke another waiter, theirs to try
                    tried_at = seen
                    if time.monotonic() < recheck_at:
                        continue  # the deadline or the stall warning
            # Checked before forming again: a batch formed for a client that has gone would be lost (without ?step=).
            if await gone():
                wakeups.pass_on()
                log.info("GET /batch: client went away after %.1f s of long-poll", time.monotonic() - started)
                return _no_batch(result)
            if not admitted():
                wakeups.pass_on()  # a key revoked while it waited takes no batch (it would be lost to it)
                raise Unauthorized("the key of this request was revoked or rotated while it waited")
            tried_at = wakeups.count
            result = await self.next_batch(step, as_json=as_json)
            recheck_at = _recheck_at(result)


def _inlined(blobs: BlobTier, batch: FormedBatch) -> FormedBatch:
    """The batch with its blobs' bytes back in place of their references: the batch as its groups were sent."""
    records = blobs.inline(batch.records, array=True)
    return replace(batch, stored=b"".join([memoryview(batch.stored)[: batch.offset], records]))


def _recheck_at(result: FormedBatch | BatchWaiting) -> float:
    """When (monotonic) to form again though nothing changed: a minimum share's hold runs out then."""
    recheck = result.recheck_in if isinstance(result, BatchWaiting) else None
    return math.inf if recheck is None else time.monotonic() + recheck + 0.05


def _no_batch(result: BatchWaiting, stall: str | None = None) -> dict[str, object]:
    """`{"batch": null}`, with why no batch can be formed and why no data can arrive, when known; `finished` once
    the run is over (then no stall: nothing is awaited)."""
    out: dict[str, object] = {"batch": None}
    if result.blocked:
        out["blocked_reason"] = result.reason
    if result.finished:
        out["finished"] = True
    elif stall is not None:
        out["stall_reason"] = stall
    return out
