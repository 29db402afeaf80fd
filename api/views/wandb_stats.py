"""The buffer's stats as a Weights & Biases run of its own (docs/observability.md#weights--biases).

On when `wandb` is importable and configured (`WANDB_API_KEY` or `WANDB_MODE` in the environment), off
otherwise. Every `wandb_interval` seconds one process (a lease in the store picks it among workers and
replicas) reads a snapshot of the buffer and logs it to the trainer's registered `wandb_project` /
`wandb_group` with job type "buffer". Everything wandb does runs on one dedicated thread, so a slow or
hanging W&B never blocks the event loop; a failure is logged, never raised.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from api.run.stats import Snapshot
from api.store.base import Store, Txn

log = logging.getLogger("rollbuf")

LEASE_KEY = "wandb_lease"
RUN_NAME = "rollbuf-buffer"
JOB_TYPE = "buffer"
CLOSE_TIMEOUT_S = 30.0
FAILURE_LOG_EVERY_S = 60.0


def configured() -> bool:
    """wandb is installed and the environment says how to use it (an API key, or a mode such as offline)."""
    if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")):
        return False
    return importlib.util.find_spec("wandb") is not None


def take_lease(txn: Txn, owner: str, now: float, ttl: float) -> bool:
    """True when `owner` holds the logging lease (taking it if it is free or expired) until `now + ttl`."""
    raw = txn.get_value(LEASE_KEY)
    lease = None if raw is None else orjson.loads(raw)
    if lease is not None and lease["owner"] != owner and lease["until"] > now:
        return False
    txn.set_value(LEASE_KEY, orjson.dumps({"owner": owner, "until": now + ttl}).decode())
    return True


def release_lease(txn: Txn, owner: str) -> None:
    raw = txn.get_value(LEASE_KEY)
    if raw is not None and orjson.loads(raw)["owner"] == owner:
        txn.set_value(LEASE_KEY, orjson.dumps({"owner": owner, "until": 0.0}).decode())


@dataclass(frozen=True, slots=True)
class Tick:
    """A snapshot and when it was read."""

    at: float
    snap: Snapshot


def buffer_stats(now: Tick, before: Tick | None) -> dict[str, Any]:
    """What one W&B step logs: gauges and counters as they are; rates, the served mix and staleness over the
    interval since `before` (over the whole run on the first tick; absent when nothing was served in it); the
    whole run's mix and staleness histogram. Pure: numbers and one histogram's counts."""
    snap = now.snap
    out: dict[str, Any] = {
        "buffer/step": snap.step,
        "buffer/batches": snap.batches,
        "buffer/blocked": 1 if snap.blocked_reason else 0,
        "buffer/queue_groups": sum(e.queue.groups for e in snap.envs),
        "buffer/queue_tokens": sum(e.queue.tokens for e in snap.envs),
        "buffer/side_buffer_groups": sum(e.held.groups for e in snap.envs),
    }
    prev = {e.name: e for e in before.snap.envs} if before else {}
    dt = now.at - before.at if before else 0.0
    if before and dt > 0:
        out["buffer/batches_per_s"] = max(0, snap.batches - before.snap.batches) / dt
        received = sum(e.received for e in snap.envs) - sum(e.received for e in before.snap.envs)
        out["buffer/groups_received_per_s"] = max(0, received) / dt
    served_now = {e.name: e.served_seqs - (prev[e.name].served_seqs if e.name in prev else 0) for e in snap.envs}
    served_interval = sum(served_now.values())
    served_run = sum(e.served_seqs for e in snap.envs)
    live_weight = sum(max(0.0, e.weight) for e in snap.envs if e.connected)
    for e in snap.envs:
        out[f"queue_groups/{e.name}"] = e.queue.groups
        out[f"queue_tokens/{e.name}"] = e.queue.tokens
        out[f"received/{e.name}"] = e.received
        if before and dt > 0:
            out[f"received_per_s/{e.name}"] = max(0, e.received - (prev[e.name].received if e.name in prev else 0)) / dt
        if served_interval > 0:
            out[f"mix_served/{e.name}"] = served_now[e.name] / served_interval
        if served_run > 0:
            out[f"mix_served_run/{e.name}"] = e.served_seqs / served_run
        if live_weight > 0:
            out[f"mix_weight/{e.name}"] = max(0.0, e.weight) / live_weight if e.connected else 0.0
        out[f"backpressure/{e.name}"] = e.backpressure
        for reason, n in e.dropped.items():
            out[f"dropped/{e.name}/{reason}"] = n
    reasons: dict[str, int] = {}
    for e in snap.envs:
        for reason, n in e.dropped.items():
            reasons[reason] = reasons.get(reason, 0) + n
    for reason, n in reasons.items():
        out[f"dropped/all/{reason}"] = n
    stale_now = dict(snap.staleness)
    if before:
        stale_now = {k: v - before.snap.staleness.get(k, 0) for k, v in snap.staleness.items()}
    served_groups = sum(stale_now.values())
    if served_groups:
        out["staleness/mean"] = sum(k * n for k, n in stale_now.items()) / served_groups
        out["staleness/max"] = max(k for k, n in stale_now.items() if n > 0)
    if snap.staleness:
        top = max(snap.staleness)
        out["staleness/histogram"] = [snap.staleness.get(k, 0) for k in range(top + 1)]
    return out


class BufferStatsLogger:
    """Logs `buffer_stats` every `interval` seconds while this process holds the lease."""

    def __init__(self, store: Store, snapshot: Any, interval: float) -> None:
        self.store = store
        self.snapshot = snapshot
        """`Service.snapshot`: an async callable returning a `Snapshot`."""
        self.interval = interval
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.logged = 0
        """W&B steps logged by this process (tests wait on it)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollbuf-wandb")
        self._run: Any = None
        self._target: tuple[str, str | None] | None = None
        self._before: Tick | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_failure_log = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="rollbuf-wandb")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except Exception as exc:  # W&B or the store failing must never take the service down
                now = time.monotonic()
                if now - self._last_failure_log >= FAILURE_LOG_EVERY_S:
                    self._last_failure_log = now
                    log.warning(
                        "W&B buffer stats: %s: %s (retrying every %g s)", type(exc).__name__, exc, self.interval
                    )

    async def tick(self) -> None:
        now = time.time()
        ttl = max(3 * self.interval, 10.0)
        if not await self.store.transact(lambda txn: take_lease(txn, self.owner, now, ttl)):
            await self._in_thread(self._finish)  # another process logs: this one's run (if any) ends
            return
        snap: Snapshot = await self.snapshot()
        if not snap.registered or not snap.wandb_project:
            await self._in_thread(self._finish)
            self._before = None
            return
        tick = Tick(time.monotonic(), snap)
        stats = buffer_stats(tick, self._before)
        await self._in_thread(self._log, (snap.wandb_project, snap.wandb_group), stats)
        self._before = tick
        self.logged += 1

    async def _in_thread(self, fn: Any, *args: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _log(self, target: tuple[str, str | None], stats: dict[str, Any]) -> None:
        import wandb

        if self._run is not None and target != self._target:
            self._finish()  # the trainer re-registered with another project or group
        if self._run is None:
            project, group = target
            self._run = wandb.init(
                project=project,
                group=group,
                job_type=JOB_TYPE,
                name=RUN_NAME,
                reinit="create_new",
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
            self._target = target
            log.info("W&B buffer stats: logging to project %s, group %s, every %.0f s", project, group, self.interval)
        hist = stats.pop("staleness/histogram", None)
        if hist is not None:
            edges = np.arange(len(hist) + 1) - 0.5  # bins centred on whole steps
            stats["staleness/histogram"] = wandb.Histogram(np_histogram=(np.asarray(hist), edges))
        self._run.log(stats)

    def _finish(self) -> None:
        if self._run is not None:
            run, self._run, self._target = self._run, None, None
            run.finish()

    async def close(self) -> None:
        """Stop logging, end the run (bounded: a hanging W&B does not hold up shutdown), give up the lease."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            await asyncio.wait_for(self._in_thread(self._finish), CLOSE_TIMEOUT_S)
            await self.store.transact(lambda txn: release_lease(txn, self.owner))
        except Exception as exc:  # shutting down: report and go on
            log.warning("W&B buffer stats: closing: %s: %s", type(exc).__name__, exc)
        self._executor.shutdown(wait=False)
