"""This process's own meters (docs/observability.md): the timings and gauges each server process keeps
(request duration, batch formation, store transactions, waiting long-polls, the key file's health, memory
and CPU), in one registry that /metrics renders beside the run's counters (`api.views.metrics`).

With `--workers N` they use prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by
`rollbuf serve`), so one scrape sums every worker of the replica. They sit low in the house (`api/layers.py`):
the HTTP edge, the key file and the flows observe into them without reaching the views that read the store.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from api.owners import REFUSALS
from api.store.base import Store, Txn

T = TypeVar("T")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

disable_created_metrics()  # type: ignore[no-untyped-call]  # `*_created` series: noise, and absent in multiprocess mode anyway

PROCESS = CollectorRegistry(auto_describe=True)
"""This process's timings (in multiprocess mode their values live in files shared by the workers)."""

FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

REQUEST_SECONDS = Histogram(
    "rollbuf_request_duration_seconds",
    "HTTP request time from first byte in to last byte out, by route template and status (long-polls included).",
    ["route", "method", "status"],
    buckets=REQUEST_BUCKETS,
    registry=PROCESS,
)
FORMATION_SECONDS = Histogram(
    "rollbuf_batch_formation_seconds",
    "Time to form a batch inside its store transaction (windows, plan, pops).",
    buckets=FAST_BUCKETS,
    registry=PROCESS,
)
STORE_SECONDS = Histogram(
    "rollbuf_store_transaction_seconds",
    "Time of one store transaction, waiting for the store included.",
    buckets=FAST_BUCKETS,
    registry=PROCESS,
)

WAITING_LONG_POLLS = Gauge(
    "rollbuf_waiting_long_polls",
    "GET /batch?wait= long-polls waiting for a batch (they cost nothing until a change wakes one).",
    registry=PROCESS,
    multiprocess_mode="livesum",
)


KEY_FILE_STALE = Gauge(
    "rollbuf_key_file_stale",
    "1 while api_keys_file cannot be used (gone, unparsable, no key) and the last good keys stay in use.",
    registry=PROCESS,
    multiprocess_mode="max",
)
FOREIGN_REFUSED = Counter(
    "rollbuf_foreign_refused",
    "Requests of a key that named another key's resource, answered as if it did not exist (docs/security.md).",
    ["key", "resource"],
    registry=PROCESS,
)
REFUSALS.listen(lambda key, kind: FOREIGN_REFUSED.labels(key, kind).inc())
PROCESS_RSS = Gauge(
    "rollbuf_process_resident_memory_bytes",
    "Resident memory of this server process (with --workers N, one series per live worker: label pid).",
    registry=PROCESS,
    multiprocess_mode="liveall",
)
PROCESS_CPU = Gauge(
    "rollbuf_process_cpu_seconds",
    "CPU time this server process has used, user and system (with --workers N, one series per live worker).",
    registry=PROCESS,
    multiprocess_mode="liveall",
)
SAMPLE_PROCESS_S = 1.0
"""How often a process refreshes its memory and CPU series (on a request, or on a scrape it answers)."""
_sampled_at = float("-inf")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def sample_process(now: float) -> None:
    """Refresh this process's memory and CPU series, at most every SAMPLE_PROCESS_S: prometheus-client's own
    process collector does not work with --workers N (multiprocess mode), where each worker writes its own."""
    global _sampled_at
    if now - _sampled_at < SAMPLE_PROCESS_S:
        return
    _sampled_at = now
    usage = resource.getrusage(resource.RUSAGE_SELF)
    PROCESS_CPU.set(usage.ru_utime + usage.ru_stime)
    try:
        with open("/proc/self/statm", "rb") as f:
            PROCESS_RSS.set(int(f.read().split()[1]) * _PAGE)
    except OSError:  # not Linux: the peak, which is what the platform reports
        PROCESS_RSS.set(usage.ru_maxrss * 1024)


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class TimedStore(Store):
    """A store whose transactions are timed into `rollbuf_store_transaction_seconds`."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        start = time.perf_counter()
        try:
            return await self.inner.transact(fn, replies=replies)
        finally:
            STORE_SECONDS.observe(time.perf_counter() - start)

    async def read(self, fn: Callable[[Txn], T]) -> T:
        start = time.perf_counter()
        try:
            return await self.inner.read(fn)
        finally:
            STORE_SECONDS.observe(time.perf_counter() - start)

    def expecting(self) -> AbstractContextManager[None]:
        return self.inner.expecting()

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.inner.subscribe(callback)

    def not_ready(self) -> str | None:
        return self.inner.not_ready()

    async def close(self) -> None:
        await self.inner.close()
