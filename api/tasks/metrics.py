"""The task cursor's Prometheus families (docs/tasks.md), appended to /metrics' exposition."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.tasks.frontier import SERVED
from api.tasks.leases import EVENTS, STATES
from api.wire.tasks import DatasetView


class TasksCollector(Collector):
    def __init__(self, views: Sequence[DatasetView]) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        tasks = GaugeMetricFamily(
            "rollbuf_tasks", "Tasks handed out, by dataset and state", labels=["dataset", "state"]
        )
        events = CounterMetricFamily(
            "rollbuf_task_events",
            "Task leases expired, tasks retried, groups on lost leases",
            labels=["dataset", "event"],
        )
        epoch = GaugeMetricFamily("rollbuf_task_epoch", "The task cursor's epoch", labels=["dataset"])
        position = GaugeMetricFamily(
            "rollbuf_task_position", "The task cursor's position in its epoch", labels=["dataset"]
        )
        for v in self.views:
            for state in (*STATES, SERVED):  # served: formed into a batch not acknowledged yet
                tasks.add_metric([v.name, state], v.counts.get(state, 0))
            for event in EVENTS:
                events.add_metric([v.name, event], v.counts.get(event, 0))
            epoch.add_metric([v.name], v.epoch)
            position.add_metric([v.name], v.position)
        yield from (tasks, events, epoch, position)


def render(views: Sequence[DatasetView]) -> bytes:
    """The families (nothing at all without a dataset)."""
    if not views:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TasksCollector(views))
    return generate_latest(registry)
