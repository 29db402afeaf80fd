"""What /dashboard/data answers: the buffer's snapshot with per-env detail capped as /metrics caps it.

10,000 envs made each poll 0.2-0.5 s of the event loop and a 9 MB body, every second, for a table no one
reads past its first screens. The first `max_envs` envs (registration order, so rows do not come and go
between polls) keep their rows and the rest are summed into one `(other envs)` row: the page's totals (queued,
received, drops, 503s) stay whole. The drop-bias table keeps flagged envs first, as /metrics does; both
say how many envs there are in all. Runs that lease tasks (docs/tasks.md) get their datasets' fates in aggregate
(`tasks`: the cursor and the tallies per state, as GET /tasks; never per task), capped at `views_max_datasets`,
and the producers at `views_max_producers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from api.config.groups import SERVER
from api.ledger.drop_bias import Report
from api.producers.stored import ProducerReport, shown_producers
from api.run.stats import Snapshot
from api.wire.rollouts import OpenGroupsStatus
from api.wire.tasks import DatasetView

_BIAS: dict[int, tuple[Report, dict[str, object]]] = {}
"""The last drop-bias report as capped JSON, by the cap: a report changes at most once a second, and
converting 10,000 envs' entries was 0.17 s of a poll."""


def capped_bias(report: Report | None, max_envs: int) -> dict[str, object] | None:
    """The drop-bias report as JSON with at most `max_envs` envs, in registration order; past the cap, the
    flagged ones first (in registration order within each, so rows stay put); `envs_total`: how many in all."""
    if report is None:
        return None
    cached = _BIAS.get(max_envs)
    if cached is not None and cached[0] is report:
        return cached[1]
    envs = report.envs
    if len(envs) > max_envs:  # the flagged ones first, so that none is left out
        envs = sorted(envs, key=lambda e: not e.flags)[:max_envs]
    out = dataclasses.replace(report, envs=envs).to_json()
    out["envs_total"] = len(report.envs)
    _BIAS.clear()
    _BIAS[max_envs] = (report, out)
    return out


def body(
    snap: Snapshot,
    bias: Report | None,
    seen: ProducerReport,
    max_envs: int,
    tasks: list[DatasetView] | None = None,
    rollouts: OpenGroupsStatus | None = None,
    *,
    max_datasets: int = SERVER.views_max_datasets,
    max_producers: int = SERVER.views_max_producers,
) -> dict[str, Any]:
    """The dashboard's poll from a snapshot read with `max_envs` (`Service.snapshot`): at most `max_envs` env
    rows plus one summing the rest (its `envs_total` counts them all); the first `max_datasets` datasets' tallies
    (`tasks_total` counts them all; no datasets: an empty list, and the page shows no task panel) and
    `max_producers` producers (live ones first; `producers_total`); `rollouts` (the per-rollout groups' block, as
    /status's) only in runs that opened one."""
    out = snap.to_json()
    out["tasks"] = [v.model_dump() for v in (tasks or [])[:max_datasets]]
    out["tasks_total"] = len(tasks or [])
    out["drop_bias"] = capped_bias(bias, max_envs)
    out["weights_step"] = seen.weights_step
    out["stall_reason"] = seen.stall_reason
    out["producers"] = [p.model_dump() for p in shown_producers(seen.producers, max_producers)]
    out["producers_total"] = len(seen.producers)
    if rollouts is not None:
        out["rollouts"] = rollouts.model_dump()
    return out
