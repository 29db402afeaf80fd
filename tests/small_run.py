"""A small run through the HTTP API whose every counter is known in advance: the metrics, dashboard and W&B
tests replay it against the in-process app and against real server processes, then compare."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import env, group, registration

LENGTH = 8
GROUP = 4
TOKENS = GROUP * LENGTH
MAX_ENV_QUEUE_GROUPS = 2
"""The servers under test run with this `max_env_queue_groups`, so the run meets backpressure once."""


@dataclass
class Expected:
    step: int = 3
    batches: int = 3
    received: dict[str, int] = field(default_factory=lambda: {"math_0": 7, "code_0": 3})
    dropped: dict[tuple[str, str], int] = field(
        default_factory=lambda: {("code_0", "zero_variance"): 1, ("code_0", "stale"): 1}
    )
    backpressure: dict[str, int] = field(default_factory=lambda: {"math_0": 1, "code_0": 0})
    queue_groups: dict[str, int] = field(default_factory=lambda: {"math_0": 2, "code_0": 0})
    queue_tokens: dict[str, int] = field(default_factory=lambda: {"math_0": 2 * TOKENS, "code_0": 0})
    served_groups: dict[str, int] = field(default_factory=lambda: {"math_0": 5, "code_0": 1})
    staleness: dict[int, int] = field(default_factory=lambda: {0: 4, 1: 2})
    scored_requests: int = 12
    """POST /scored_data requests, the refused ones included."""


async def _submit(c: httpx.AsyncClient, env_id: int, seed: int, policy_step: int, **kw: object) -> httpx.Response:
    return await c.post("/scored_data", json=group(GROUP, LENGTH, env_id, seed=seed, policy_step=policy_step, **kw))


async def _batch(c: httpx.AsyncClient) -> dict[str, object]:
    r = await c.get("/batch")
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


async def small_run(c: httpx.AsyncClient) -> Expected:
    """Three batches from two envs, two drops (zero variance, stale), one 503 and one 422; weights announced, one
    producer heartbeating."""
    (
        await c.post("/register", json=registration(batch_size=8, max_staleness=1, drop_zero_variance=True))
    ).raise_for_status()
    assert (await _batch(c))["batch"] is None  # the trainer's first poll: envs may register from now on
    math = (await c.post("/register-env", json=env("math", GROUP, weight=2.0))).json()
    code = (await c.post("/register-env", json=env("code", GROUP, weight=1.0))).json()
    assert (math["env_id"], code["env_id"]) == (0, 1)
    # step 0: two math groups -> batch 0, staleness 0
    for seed in (1, 2):
        (await _submit(c, 0, seed, 0)).raise_for_status()
    assert len((await _batch(c))["batch"]) == 2  # type: ignore[arg-type]
    # step 1: a code group without learning signal (dropped), two math groups from policy 0 -> staleness 1
    (await _submit(c, 1, 3, 0, scores=[1.0] * GROUP)).raise_for_status()
    for seed in (4, 5):
        (await _submit(c, 0, seed, 0)).raise_for_status()
    assert len((await _batch(c))["batch"]) == 2  # type: ignore[arg-type]
    # step 2: a code group from policy 0 is too stale (max_staleness 1) and dropped when batch 2 forms
    (await _submit(c, 1, 6, 0)).raise_for_status()
    (await _submit(c, 1, 7, 2)).raise_for_status()
    (await _submit(c, 0, 8, 2)).raise_for_status()
    assert len((await _batch(c))["batch"]) == 2  # type: ignore[arg-type]
    # a bad group (422), then math's queue fills: the third group meets backpressure (503)
    bad = group(GROUP, LENGTH, 0, seed=9)
    bad["masks"] = bad["masks"][:-1]
    assert (await c.post("/scored_data", json=bad)).status_code == 422
    for seed in (10, 11):
        (await _submit(c, 0, seed, 3)).raise_for_status()
    assert (await _submit(c, 0, 12, 3)).status_code == 503
    # the trainer announces its weights, and math's producer heartbeats
    (await c.post("/weights", json={"step": 2})).raise_for_status()
    beat = {"producer_id": "p0", "host": "h0", "env_ids": [0], "weights_step": 2}
    (await c.post("/producers/heartbeat", json=beat)).raise_for_status()
    return Expected()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, sorted labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include these (over the others: status, pid, ...)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def check_store_metrics(samples: Samples, exp: Expected) -> None:
    """The metrics read from the store: the same whichever process or replica answers."""
    assert value(samples, "rollbuf_step") == exp.step
    assert value(samples, "rollbuf_batches_total") == exp.batches
    for name, n in exp.received.items():
        assert value(samples, "rollbuf_groups_received_total", env=name) == n
    for (name, reason), n in exp.dropped.items():
        assert value(samples, "rollbuf_groups_dropped_total", env=name, reason=reason) == n
    dropped = {k: v for k, v in samples.items() if k[0] == "rollbuf_groups_dropped_total"}
    assert len(dropped) == len(exp.dropped)
    for name, n in exp.backpressure.items():
        assert value(samples, "rollbuf_backpressure_rejections_total", env=name) == n
    for name, n in exp.queue_groups.items():
        assert value(samples, "rollbuf_queue_groups", env=name) == n
    for name, n in exp.queue_tokens.items():
        assert value(samples, "rollbuf_queue_tokens", env=name) == n
    for name, n in exp.served_groups.items():
        assert value(samples, "rollbuf_groups_served_total", env=name) == n
        assert value(samples, "rollbuf_sequences_served_total", env=name) == n * GROUP
    assert value(samples, "rollbuf_staleness_count") == sum(exp.staleness.values())
    assert value(samples, "rollbuf_staleness_sum") == sum(k * n for k, n in exp.staleness.items())
    assert value(samples, "rollbuf_staleness_bucket", le="0.0") == exp.staleness.get(0, 0)
    assert value(samples, "rollbuf_staleness_bucket", le="1.0") == exp.staleness.get(0, 0) + exp.staleness.get(1, 0)
    assert value(samples, "rollbuf_blocked") == 0


def check_process_metrics(after: Samples, before: Samples, exp: Expected) -> None:
    """Timings (this process's, or summed over workers): what the run added between two scrapes."""

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("rollbuf_request_duration_seconds_count", route="/scored_data", method="POST") == exp.scored_requests
    assert grew("rollbuf_request_duration_seconds_sum", route="/scored_data", method="POST") > 0
    assert grew("rollbuf_request_duration_seconds_count", route="/batch", method="GET") == 1 + exp.batches
    assert grew("rollbuf_request_duration_seconds_count", route="/register-env", method="POST") == 2
    assert grew("rollbuf_batch_formation_seconds_count") == exp.batches
    assert grew("rollbuf_batch_formation_seconds_sum") > 0
    # at least one per request that reads the store
    assert grew("rollbuf_store_transaction_seconds_count") >= exp.scored_requests + exp.batches
    assert grew("rollbuf_store_transaction_seconds_sum") > 0
