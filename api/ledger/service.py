"""The ledger's flow (docs/ledger.md): its reads (a step, the groups sent under a name), its retention (the
prune job) and the drop-bias monitor fed from it (the watch job). The transactions that write the ledger report
to it through `api.ledger.recorder`; this is what the ledger does on its own."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from api.errors import NotFound
from api.ledger import rules as ledger
from api.ledger.drop_bias import Report
from api.ledger.drop_bias_watch import BiasWatch
from api.ledger.recorder import Recorder, recorder
from api.run.blobs import BlobTier
from api.run.offloop import INLINE_PARSE, off_loop
from api.scheduler import Periodic
from api.store.base import Store

log = logging.getLogger("rollbuf")

PRUNE, WATCH = "ledger_prune", "drop_bias_watch"
"""The ledger's background jobs' names (`Ledger.jobs`)."""


@dataclass(slots=True)
class Ledger:
    store: Store
    settings: ledger.LedgerSettings = field(default_factory=ledger.LedgerSettings)
    """Whether the ledger is written, how long it and retained payloads are kept (docs/ledger.md)."""
    bias: BiasWatch = field(default_factory=BiasWatch)
    blobs: BlobTier | None = None
    """The blob tier: a retained payload's blobs are put back before it is shown (`?data=true`)."""
    """The drop-bias monitor, fed from the ledger (`api.ledger.drop_bias_watch`)."""

    def recorder(self) -> Recorder:
        """What one transaction reports to (nothing when the ledger is off)."""
        return recorder(self.settings)

    @property
    def jobs(self) -> list[Periodic]:
        """The ledger pruned in transactions of bounded size (`ledger.PRUNE_CHUNK`), so ingest waits for one no
        longer than for a batch's formation; the drop-bias monitor refreshed when a batch is formed (asked by
        the batches flow), so that an episode is logged even when nobody looks at the views."""
        return [
            Periodic(PRUNE, self._prune, lambda: self.settings.prune_every if self.settings.enabled else None),
            Periodic(WATCH, self._watch, self._watch_every),
        ]

    async def step(self, step: int, *, data: bool = False) -> dict[str, object]:
        """Step `step`'s ledger row and its groups' (GET /ledger/steps/{step}); 404 if there is none."""
        found = await self.store.read(lambda txn: ledger.read_step(txn, step, data))
        if found is None:
            raise NotFound(
                f"the ledger has no batch {step}: not formed yet, pruned (ledger_max_steps), or the ledger is off",
                loc=("path", "step"),
            )
        found = await self._inlined(found)
        return await off_loop(sum(len(p) for p in found.payloads.values()), INLINE_PARSE, ledger.step_view, found)

    async def named(self, group_id: str, *, data: bool = False) -> list[dict[str, object]]:
        """The ledger rows of groups sent under `group_id` (GET /ledger/groups/{group_id}); 404 if none."""
        found = await self.store.read(lambda txn: ledger.read_named(txn, group_id, data))
        if not found.groups:
            raise NotFound(f"the ledger has no group with group_id {group_id!r}", loc=("path", "group_id"))
        found = await self._inlined(found)
        size = sum(len(p) for p in found.payloads.values())
        return await off_loop(size, INLINE_PARSE, lambda: [ledger.group_view(g, found) for g in found.groups])

    async def _inlined(self, found: ledger.Found) -> ledger.Found:
        """The retained payloads found, with their blobs' bytes back: the groups as they were sent. One whose blob
        is gone (it cannot be while the payload is retained) is shown as lost."""
        tier = self.blobs
        if tier is None or not any(tier.holds_refs(p) for p in found.payloads.values()):
            return found

        def inline() -> ledger.Found:
            assert tier is not None
            payloads, lost = {}, set(found.lost)
            for i, p in found.payloads.items():
                try:
                    payloads[i] = bytes(tier.inline(p, array=False))
                except KeyError:
                    lost.add(i)
            return replace(found, payloads=payloads, lost=frozenset(lost))

        return await asyncio.to_thread(inline)

    async def _prune(self) -> None:
        payloads, rows = await self.prune()
        if payloads or rows:
            log.debug("ledger: pruned %d retained payloads and %d rows", payloads, rows)

    async def prune(self) -> tuple[int, int]:
        """One prune now (tests, and the background `PRUNE` job): (retained payloads, ledger rows) forgotten."""
        return await self.store.transact(lambda txn: ledger.prune_txn(txn, self.settings))

    def _watch_every(self) -> float | None:
        return 0.0 if self.settings.enabled and self.bias.due(time.monotonic()) else None

    async def _watch(self) -> None:
        await self.bias.refresh(self.store)

    async def drop_bias(self) -> Report | None:
        """The drop-bias monitor's report, refreshed if it is older than `REFRESH_S`; None without the ledger."""
        if not self.settings.enabled:
            return None
        if self.bias.report is not None and not self.bias.due(time.monotonic()):
            return self.bias.report  # a view polled often (10,000 envs' /status) reads and recomputes nothing
        return await self.bias.refresh(self.store)
