"""The blob tier's Prometheus families (docs/payloads.md), appended to /metrics' exposition: nothing at all on a
server without the tier, or whose tier never held a blob. The files are counted at each collection; the writes,
dedup hits, refusals and collections are this process's since it started (summed over workers by the scraper)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.run.blobs import BlobStats


class BlobsCollector(Collector):
    def __init__(self, stats: BlobStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily(
            "rollbuf_blob_objects", "Blobs the tier holds (at its last collection)", s.usage.objects
        )
        yield GaugeMetricFamily("rollbuf_blob_bytes", "Bytes of the blobs the tier holds", s.usage.bytes)
        yield GaugeMetricFamily(
            "rollbuf_blob_dedup_ratio",
            "References in stored payloads per blob held (1: nothing stored twice)",
            s.dedup_ratio,
        )
        events = CounterMetricFamily(
            "rollbuf_blob_events",
            "This process's blob writes (written) and their bytes (written_bytes), values whose blob was there "
            "(deduplicated), submissions refused past a budget (refused), blobs collected and their bytes",
            labels=["event"],
        )
        for event, n in (
            ("written", s.written_objects),
            ("written_bytes", s.written_bytes),
            ("deduplicated", s.deduplicated),
            ("refused", s.refused),
            ("collected", s.collected_objects),
            ("collected_bytes", s.collected_bytes),
        ):
            events.add_metric([event], n)
        yield events


def render(stats: BlobStats | None) -> bytes:
    """Nothing on a server without the tier, or whose tier never held a blob (as the per-rollout families)."""
    if stats is None or not (stats.usage.objects or stats.written_objects or stats.deduplicated or stats.refused):
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BlobsCollector(stats))
    return generate_latest(registry)
