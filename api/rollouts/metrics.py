"""The per-rollout groups' Prometheus families (docs/rollouts.md), appended to /metrics' exposition: nothing at
all in runs that never opened one."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

EVENTS = (
    "opened",
    "sealed",
    "sealed_partial",
    "expired",
    "slots",
    "left_out",
    "redispatched",
    "redone",
    "refused",
    "lease_lapsed",
    "pruned",
    "turns",
    "turn_bytes",
    "resumed",
    "tokens_carried",
    "restarted",
)


class RolloutsCollector(Collector):
    def __init__(self, totals: Mapping[str, int]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "rollbuf_rollout_groups_open", "Per-rollout groups open now", value=self.totals.get("open", 0)
        )
        events = CounterMetricFamily(
            "rollbuf_rollout_events",
            "Per-rollout groups opened, sealed, expired; slots acknowledged, left out, redispatched to siblings, "
            "redone, refused; sibling leases lapsed; decided groups pruned past rollout_keep_s; turns acknowledged "
            "and their bytes; slot leases that carried turns (resumed) and their tokens (tokens_carried), or none "
            "(restarted)",
            labels=["event"],
        )
        for event in EVENTS:
            events.add_metric([event], self.totals.get(event, 0))
        yield events
        slots = GaugeMetricFamily(
            "rollbuf_rollout_open_slots",
            "Slots of the per-rollout groups open now: acknowledged (done), leased to a sibling and not in (leased)",
            labels=["state"],
        )
        slots.add_metric(["done"], self.totals.get("open_slots_done", 0))
        slots.add_metric(["leased"], self.totals.get("open_slots_leased", 0))
        yield slots


def render(totals: Mapping[str, int]) -> bytes:
    if not totals.get("opened"):
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RolloutsCollector(totals))
    return generate_latest(registry)
