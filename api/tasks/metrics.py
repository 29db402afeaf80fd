"""The task cursor's Prometheus families (docs/tasks.md), appended to /metrics' exposition."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.tasks.records import EVENTS
from api.tasks.states import STATES
from api.wire.tasks import DatasetView

OTHER_DATASETS = "(other datasets)"
"""The `dataset` label of the series summing the datasets past `views_max_datasets`."""


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
            for state in STATES:
                tasks.add_metric([v.name, state], v.counts.get(state, 0))
            for event in EVENTS:
                events.add_metric([v.name, event], v.counts.get(event, 0))
            epoch.add_metric([v.name], v.epoch)
            position.add_metric([v.name], v.position)
        yield from (tasks, events, epoch, position)


def itemised(views: Sequence[DatasetView], cap: int) -> list[DatasetView]:
    """The first `cap` datasets (by name, so series do not come and go between scrapes) and the rest summed into
    one `OTHER_DATASETS`: tallies and events added, the cursor (epoch, position) at 0."""
    if len(views) <= cap:
        return list(views)
    counts: dict[str, int] = {}
    for v in views[cap:]:
        for name, n in v.counts.items():
            counts[name] = counts.get(name, 0) + n
    size = sum(v.size for v in views[cap:])
    other = DatasetView(
        name=OTHER_DATASETS,
        env=None,
        size=size,
        sealed=False,
        epochs=None,
        order="",
        seed=0,
        max_retries=0,
        epoch=0,
        position=0,
        counts=counts,
        done=False,
    )
    return [*views[:cap], other]


def render(views: Sequence[DatasetView], max_datasets: int) -> bytes:
    """The families (nothing at all without a dataset), per dataset for at most `max_datasets`
    (`views_max_datasets`): 5,000 datasets made a 6.45 MB scrape."""
    if not views:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TasksCollector(itemised(views, max_datasets)))
    return generate_latest(registry)
