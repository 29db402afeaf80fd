"""How each group a runner dispatched is counted once it ends: failed (by reason, its task perhaps
quarantined), skipped, produced, rejected by the server or stored (accepted or a duplicate, its mean score).
The runner does the I/O and acts on what these return (the reason the run must end); this keeps
`RunnerStats` and the failure policy in step, so that it can be tested alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from api.wire.schema import ScoredData
from rollout_client.errors import failure_reason
from rollout_client.group import GroupOutcome, failures_of
from rollout_client.runner.failures import Failed, FailurePolicy, Refused, Stored
from rollout_client.runner.stats import RunnerStats

log = logging.getLogger("rollout_client.runner")

SCORE_WINDOW = 64
"""`stats.mean_score` of an env is over its last this many stored groups."""


class Tally:
    """Counts into `stats` for the envs named `names` (by index), consulting `failures`."""

    def __init__(self, names: Sequence[str], stats: RunnerStats, failures: FailurePolicy) -> None:
        self.names = list(names)
        self.stats = stats
        self.failures = failures
        self._scores: list[list[float]] = [[] for _ in self.names]

    def failed(self, i: int, task_id: str, group_id: str, exc: BaseException) -> str | None:
        """A group of env `i` failed with `exc`: count it, quarantine its task if it keeps failing. Returns
        why the run must end (past the error rate), or None."""
        env = self.names[i]
        reason = failure_reason(exc)
        self.rollouts_failed(i, failures_of(exc))
        self.stats.failed[env][reason] += 1
        self.stats.last_error[env] = f"{type(exc).__name__}: {exc}"
        log.warning("group %s of %s failed (%s): %s: %s", group_id, env, reason, type(exc).__name__, exc)
        if reason == "inference_unreachable":
            return None  # the outage is counted once (inference_outages); neither the task nor the rate is to blame
        verdict = self.failures.record(Failed(i, task_id))
        self.stats.error_rate = self.failures.error_rate
        if verdict.quarantined:
            self.stats.quarantined[env].add(task_id)
            log.error("task %s of %s failed %d times in a row: quarantined", task_id, env, verdict.failures)
        if verdict.stop is None:
            return None
        return f"{verdict.stop}; failed so far: {self.failed_counts()}"

    def finished(self, i: int, outcome: GroupOutcome, group_size: int) -> ScoredData | None:
        """A group of env `i` ran to its end: count what it left out; returns the group to submit, or None
        when it is skipped (and counted so)."""
        self.stats.release_timeouts += outcome.release_timeouts
        self.rollouts_failed(i, outcome.rollout_failures)
        if outcome.group is None:
            self.stats.skipped[outcome.skipped or "skipped"] += 1
            return None
        self.stats.produced += 1
        if len(outcome.group.tokens) < group_size:
            self.stats.partial_groups += 1
        return outcome.group

    def rejected(self, i: int, group_id: str, exc: BaseException) -> str | None:
        """The server rejected a group of env `i`: count it; why the run must end (too many in a row), or None."""
        self.stats.skipped["rejected"] += 1
        log.error("group %s of %s rejected by the server: %s", group_id, self.names[i], exc)
        return self.failures.record(Refused()).stop

    def stored(self, i: int, task_id: str, group: ScoredData, duplicate: bool) -> float:
        """The server acknowledged a group of env `i` (stored now, or already: `duplicate`); returns its mean
        score, for the task source."""
        env = self.names[i]
        self.failures.record(Stored(i, task_id))
        self.stats.error_rate = self.failures.error_rate
        if duplicate:
            self.stats.duplicates += 1
        else:
            self.stats.accepted += 1
            self.stats.accepted_by_env[env] += 1
        mean = sum(group.scores) / len(group.scores)
        self._scores[i] = [*self._scores[i][1 - SCORE_WINDOW :], mean]
        self.stats.mean_score[env] = sum(self._scores[i]) / len(self._scores[i])
        return mean

    def rollouts_failed(self, i: int, failures: dict[str, int]) -> None:
        for reason, n in failures.items():
            self.stats.rollouts_failed[self.names[i]][reason] += n

    def failed_counts(self) -> dict[str, dict[str, int]]:
        return {env: dict(c) for env, c in self.stats.failed.items()}
