"""Prometheus metrics (docs/observability.md): what /metrics serves.

Two kinds, so that the numbers are right with `--workers N` and with replicas on a shared store:
- the buffer's state and its counters (step, queues, received, dropped, served, backpressure, staleness)
  are read from the store at scrape time (`api.run.stats`): every process and replica reports the run's
  values, whichever one is scraped;
- timings (request duration, batch formation, store transactions) are this process's histograms, declared
  in `api.meters`; with `--workers N` they use prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`,
  set by `rollbuf serve`), so one scrape sums every worker of the replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from api.config.groups import SERVER
from api.ledger.drop_bias import CONDITIONS, Report
from api.meters import PROCESS, STALENESS_BUCKETS, multiprocess, sample_process
from api.producers.stored import ProducerReport, shown_producers
from api.run.stats import OTHER_ENVS, EnvSnapshot, Snapshot
from api.store.base import QueueCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MAX_ENVS = SERVER.metrics_max_envs
MAX_PRODUCERS = SERVER.views_max_producers


def itemised(envs: Sequence[EnvSnapshot], cap: int) -> list[EnvSnapshot]:
    """The first `cap` envs (in registration order, so series do not come and go between scrapes) and the rest
    summed into one `OTHER_ENVS`: 10,000 envs made a 12.9 MB scrape."""
    if len(envs) <= cap:
        return list(envs)
    rest = envs[cap:]
    dropped: dict[str, int] = {}
    queue = held = QueueCounts()
    for e in rest:
        for reason, n in e.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        queue, held = queue + e.queue, held + e.held
    other = EnvSnapshot(
        OTHER_ENVS,
        sum(e.weight for e in rest),
        0,
        any(e.connected for e in rest),
        None,
        queue,
        sum(e.received for e in rest),
        sum(e.served_groups for e in rest),
        sum(e.served_seqs for e in rest),
        sum(e.backpressure for e in rest),
        dropped,
        held,
    )
    return [*envs[:cap], other]


class SnapshotCollector(Collector):
    """The run's state and counters, as one store transaction read them; per env for the first `max_envs`."""

    def __init__(self, snap: Snapshot, max_envs: int = MAX_ENVS) -> None:
        self.snap = snap
        self.max_envs = max_envs

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        yield GaugeMetricFamily(
            "rollbuf_envs",
            'Envs registered; past metrics_max_envs, the per-env series sum the rest under env="(other envs)".',
            len(snap.envs),
        )
        yield GaugeMetricFamily("rollbuf_step", "The next batch's step (0 before a trainer registers).", snap.step)
        yield GaugeMetricFamily(
            "rollbuf_committed_step", "Every batch before this step is acknowledged (committed).", snap.committed
        )
        yield GaugeMetricFamily(
            "rollbuf_kept_batches", "Served batches kept for serving again (not acknowledged).", snap.kept_batches
        )
        yield GaugeMetricFamily(
            "rollbuf_kept_batch_bytes", "Bytes of the batches kept for serving again.", snap.kept_bytes
        )
        yield CounterMetricFamily("rollbuf_batches", "Batches formed.", snap.batches)
        blocked = GaugeMetricFamily(
            "rollbuf_blocked", "1 while no batch can be formed for a reason more data alone will not fix."
        )
        blocked.add_metric([], 1 if snap.blocked_reason else 0)
        yield blocked
        holding = GaugeMetricFamily(
            "rollbuf_batch_blocked_seconds",
            "Seconds an env's min_batch_allocation has held batches back (it queues too little), this episode.",
            labels=["env"],
        )
        released = CounterMetricFamily(
            "rollbuf_min_share_releases",
            "Holds of an env's min_batch_allocation released after quiet_share_seconds.",
            labels=["env"],
        )
        passed = CounterMetricFamily(
            "rollbuf_batches_passed_over", "Batches that passed over an env's oldest group.", labels=["env"]
        )
        trimmed = CounterMetricFamily(
            "rollbuf_sequences_trimmed",
            'Sequences cut off served groups and left out (no_exact_fill "trim").',
            labels=["env"],
        )
        stale = CounterMetricFamily(
            "rollbuf_tokens_stale_masked",
            "Trained tokens served masked out of the loss: weights older than its max_token_staleness sampled them.",
            labels=["env"],
        )
        for e in snap.envs:
            trimmed.add_metric([e.name], e.trimmed)
            stale.add_metric([e.name], e.stale_masked)
            holding.add_metric([e.name], e.holding_seconds)
            released.add_metric([e.name], e.released_shares)
            passed.add_metric([e.name], e.passed_over)
        yield holding
        yield released
        yield passed
        yield trimmed
        yield stale

        received = CounterMetricFamily(
            "rollbuf_groups_received", "Groups acknowledged (not duplicates).", labels=["env"]
        )
        dropped = CounterMetricFamily(
            "rollbuf_groups_dropped", "Groups dropped instead of served, by reason.", labels=["env", "reason"]
        )
        backpressure = CounterMetricFamily(
            "rollbuf_backpressure_rejections", "Submissions refused with 503 because a queue was full.", labels=["env"]
        )
        served = CounterMetricFamily("rollbuf_groups_served", "Groups served in batches.", labels=["env"])
        served_seqs = CounterMetricFamily("rollbuf_sequences_served", "Sequences served in batches.", labels=["env"])
        queue_groups = GaugeMetricFamily("rollbuf_queue_groups", "Groups queued.", labels=["env"])
        queue_tokens = GaugeMetricFamily("rollbuf_queue_tokens", "Tokens queued.", labels=["env"])
        queue_bytes = GaugeMetricFamily("rollbuf_queue_bytes", "Bytes queued, as stored.", labels=["env"])
        held_groups = GaugeMetricFamily(
            "rollbuf_side_buffer_groups",
            "Groups held in the side buffer (another size than group_size).",
            labels=["env"],
        )
        held_bytes = GaugeMetricFamily("rollbuf_side_buffer_bytes", "Bytes held in the side buffer.", labels=["env"])
        weight = GaugeMetricFamily("rollbuf_env_weight", "The env's registered weight.", labels=["env"])
        for env in itemised(snap.envs, self.max_envs):
            received.add_metric([env.name], env.received)
            for reason, n in sorted(env.dropped.items()):
                dropped.add_metric([env.name, reason], n)
            backpressure.add_metric([env.name], env.backpressure)
            served.add_metric([env.name], env.served_groups)
            served_seqs.add_metric([env.name], env.served_seqs)
            queue_groups.add_metric([env.name], env.queue.groups)
            queue_tokens.add_metric([env.name], env.queue.tokens)
            queue_bytes.add_metric([env.name], env.queue.bytes)
            held_groups.add_metric([env.name], env.held.groups)
            held_bytes.add_metric([env.name], env.held.bytes)
            weight.add_metric([env.name], env.weight)
        yield from (
            received,
            dropped,
            backpressure,
            served,
            served_seqs,
            queue_groups,
            queue_tokens,
            queue_bytes,
            held_groups,
            held_bytes,
            weight,
        )

        buckets: list[tuple[str, float]] = []
        for le in STALENESS_BUCKETS:
            buckets.append((str(float(le)), sum(n for s, n in snap.staleness.items() if s <= le)))
        buckets.append(("+Inf", sum(snap.staleness.values())))
        yield HistogramMetricFamily(
            "rollbuf_staleness",
            "Served groups by staleness: the batch's step minus the group's policy step.",
            buckets=buckets,
            sum_value=sum(s * n for s, n in snap.staleness.items()),
        )


class DropBiasCollector(Collector):
    """The drop-bias monitor's report (docs/ledger.md, "Drop-bias monitor"): per env over its window."""

    def __init__(self, report: Report, max_envs: int = MAX_ENVS) -> None:
        self.report = report
        self.max_envs = max_envs

    def collect(self) -> Iterator[Metric]:
        share = GaugeMetricFamily(
            "rollbuf_drop_bias_share", "Mean share of the window's batches' sequences, by env.", labels=["env"]
        )
        weight = GaugeMetricFamily(
            "rollbuf_drop_bias_weight_share", "Share of sequences the env's weight asks for.", labels=["env"]
        )
        floor = GaugeMetricFamily(
            "rollbuf_drop_bias_floor_share",
            "max(minimum share, half the weight share): the share below which a batch counts towards starvation.",
            labels=["env"],
        )
        below = GaugeMetricFamily(
            "rollbuf_drop_bias_below_floor_steps", "Latest consecutive batches below the floor.", labels=["env"]
        )
        length = GaugeMetricFamily(
            "rollbuf_drop_bias_length_skew",
            "Mean length of unintentionally dropped groups against trained ones, relative (NaN until both exist).",
            labels=["env"],
        )
        reward = GaugeMetricFamily(
            "rollbuf_drop_bias_reward_skew",
            "Mean reward of unintentionally dropped groups minus trained ones, in pooled standard deviations.",
            labels=["env"],
        )
        means = GaugeMetricFamily(
            "rollbuf_drop_bias_mean",
            "Mean length (tokens per sequence), reward and latency (seconds, acknowledged to decided) of the "
            "window's groups, trained or unintentionally dropped.",
            labels=["env", "quantity", "fate"],
        )
        flag = GaugeMetricFamily(
            "rollbuf_drop_bias_condition",
            "1 while a condition holds (starved, length_skew, reward_skew), by env.",
            labels=["env", "condition"],
        )
        flagged_first = sorted(self.report.envs, key=lambda e: not e.flags)  # stable: an env flagged is shown
        for e in flagged_first[: self.max_envs]:
            if e.share is not None:
                share.add_metric([e.env], e.share)
            weight.add_metric([e.env], e.weight_share)
            floor.add_metric([e.env], e.floor)
            below.add_metric([e.env], e.below_floor_steps)
            length.add_metric([e.env], math.nan if e.length_skew is None else e.length_skew)
            reward.add_metric([e.env], math.nan if e.reward_skew is None else e.reward_skew)
            for quantity, trained, dropped in (
                ("length", e.length_trained, e.length_dropped),
                ("reward", e.reward_trained, e.reward_dropped),
                ("latency", e.latency_trained, e.latency_dropped),
            ):
                for fate, dist in (("trained", trained), ("dropped", dropped)):
                    if dist.mean is not None:
                        means.add_metric([e.env, quantity, fate], dist.mean)
            for condition in CONDITIONS:
                flag.add_metric([e.env, condition], 1 if condition in e.flags else 0)
        yield from (share, weight, floor, below, length, reward, means, flag)


class ProducersCollector(Collector):
    """Producers per env (live, gone), each producer's last-seen age, and the weights step announced."""

    def __init__(self, report: ProducerReport, max_envs: int = MAX_ENVS, max_producers: int = MAX_PRODUCERS) -> None:
        self.report = report
        self.max_envs = max_envs
        self.max_producers = max_producers

    def collect(self) -> Iterator[Metric]:
        r = self.report
        if r.weights_step is not None:
            yield GaugeMetricFamily(
                "rollbuf_weights_step", "The step of the weights announced live (POST /weights).", r.weights_step
            )
        per_env = GaugeMetricFamily("rollbuf_producers", "Producers per env, live or gone.", labels=["env", "state"])
        counts: dict[tuple[str, str], int] = {}
        for p in r.producers:
            for env in p.envs:
                key = (env, "live" if p.live else "gone")
                counts[key] = counts.get(key, 0) + 1
        named = sorted({env for env, _ in counts})[: self.max_envs]  # past the cap, summed as the other series are
        capped: dict[tuple[str, str], int] = {}
        for (env, state), n in counts.items():
            key = (env if env in named else OTHER_ENVS, state)
            capped[key] = capped.get(key, 0) + n
        for (env, state), n in sorted(capped.items()):
            per_env.add_metric([env, state], n)
        seen = GaugeMetricFamily(
            "rollbuf_producer_last_seen_seconds",
            "Seconds since a producer's last heartbeat (at most views_max_producers of them, live ones first).",
            labels=["producer", "host"],
        )
        for p in shown_producers(r.producers, self.max_producers):
            seen.add_metric([p.producer_id, p.host], p.last_seen_s)
        stalled = GaugeMetricFamily(
            "rollbuf_stalled",
            "1 while nothing can arrive for a waiting trainer (/status stall_reason), else 0.",
            1 if r.stall_reason else 0,
        )
        yield from (per_env, seen, stalled)


class _Process(Collector):
    def collect(self) -> Iterator[Metric]:
        yield from PROCESS.collect()


def render(
    snap: Snapshot,
    bias: Report | None = None,
    producers: ProducerReport | None = None,
    max_envs: int = MAX_ENVS,
    max_producers: int = MAX_PRODUCERS,
) -> bytes:
    """The exposition text for one scrape (with the drop-bias monitor's report, when the ledger is on, and the
    producers), per env for at most `max_envs` envs (`metrics_max_envs`), per producer for at most
    `max_producers` (`views_max_producers`, live ones first)."""
    sample_process(time.monotonic())
    registry = CollectorRegistry(auto_describe=False)
    if multiprocess():
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry.register(_Process())
    registry.register(SnapshotCollector(snap, max_envs))
    if bias is not None:
        registry.register(DropBiasCollector(bias, max_envs))
    if producers is not None:
        registry.register(ProducersCollector(producers, max_envs, max_producers))
    return generate_latest(registry)
