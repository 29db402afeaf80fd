"""The `RolloutRunner` keywords replaced by `timeouts=`, `failures=` and `recycle=`: still accepted for one
release, each with a DeprecationWarning that names its new form. Delete this module with them."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from rollout_client.runner.failures import FailurePolicy
from rollout_client.runner.timeouts import Timeouts
from rollout_client.workers.recycling import RecyclePolicy

TIMEOUTS = {
    "turn_timeout": "turn",
    "rollout_timeout": "rollout",
    "group_timeout": "group",
    "release_timeout": "release",
    "pause_timeout": "pause",
    "shutdown_timeout": "shutdown",
    "inference_outage_timeout": "inference_outage",
}
"""Old keyword -> its `Timeouts` field."""
FAILURES = {"max_error_rate": "max_error_rate", "error_window": "error_window", "quarantine_after": "quarantine_after"}
"""Old keyword -> its `FailurePolicy` keyword."""
RECYCLE = {"recycle_after_groups": "max_groups", "max_worker_rss_bytes": "max_rss_bytes"}
"""Old keyword -> its `RecyclePolicy` field."""


def _pick(legacy: Mapping[str, Any], names: Mapping[str, str], given: object, new: str, build: str) -> dict[str, Any]:
    """The old keywords of one group, as the new object's fields; each one warned about."""
    picked = {names[k]: v for k, v in legacy.items() if k in names}
    if picked and given is not None:
        raise TypeError(f"RolloutRunner: give {new}= or the old {', '.join(k for k in legacy if k in names)}, not both")
    for old, field in ((k, names[k]) for k in legacy if k in names):
        warnings.warn(
            f"RolloutRunner({old}=...) is deprecated and goes in the next release: pass {new}={build}({field}=...)",
            DeprecationWarning,
            stacklevel=4,
        )
    return picked


def resolve(
    timeouts: Timeouts | None,
    failures: FailurePolicy | None,
    recycle: RecyclePolicy | None,
    legacy: Mapping[str, Any],
) -> tuple[Timeouts, FailurePolicy, RecyclePolicy]:
    """The runner's three policy objects from the new keywords and any old ones (a TypeError for a keyword
    that never existed, or an old one given beside its new form)."""
    unknown = sorted(set(legacy) - set(TIMEOUTS) - set(FAILURES) - set(RECYCLE))
    if unknown:
        raise TypeError(f"RolloutRunner() got unexpected keyword arguments: {', '.join(unknown)}")
    t = _pick(legacy, TIMEOUTS, timeouts, "timeouts", "Timeouts")
    f = _pick(legacy, FAILURES, failures, "failures", "FailurePolicy")
    r = _pick(legacy, RECYCLE, recycle, "recycle", "RecyclePolicy")
    return (
        dataclasses.replace(Timeouts(), **t) if t else timeouts or Timeouts(),
        failures or FailurePolicy(**f),
        recycle or RecyclePolicy(**r),
    )
