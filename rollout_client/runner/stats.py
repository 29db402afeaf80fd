"""What a runner reports: `RunnerStats`, its running counts, and `RunnerHealth`, the snapshot a trainer
checks between steps. Plain data, apart from the runner so that a handle or a dashboard can use it without
the runner's machinery."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_client.workers.pool import WorkerPool


@dataclass
class RunnerStats:
    """What the runner did. `accepted` counts groups the server acknowledged and stored."""

    dispatched: int = 0
    produced: int = 0
    """Groups fully rolled out and scored."""
    accepted: int = 0
    duplicates: int = 0
    """Acknowledged as already stored (a retry of something the server had): never stored twice."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Groups not submitted or not stored, by reason: prompt_too_long, stale, stopped, unsent, rejected,
    pause_timeout, quarantined, lease_lost (its task's lease was lost: another producer may have the task)."""
    failed: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """Groups that failed, per env name and reason (turn_timeout, rollout_timeout, inference_error,
    worker_died, env_error): dropped, never submitted."""
    rollouts_failed: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """Rollouts that failed, per env name and reason (the reasons of `failed`), in groups kept with their
    survivors (`min_group_size`) and in groups that failed."""
    partial_groups: int = 0
    """Groups produced with fewer than `group_size` sequences: the survivors of failed rollouts."""
    retried: int = 0
    """Failed groups run again because their environment allows it (`Environment.group_retries`)."""
    quarantined: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Env name -> ids of tasks that failed `quarantine_after` times in a row: never dispatched again."""
    last_error: dict[str, str] = field(default_factory=dict)
    """Env name -> the last failure, as `Type: message`."""
    error_rate: float = 0.0
    """Failed share of the last `error_window` finished groups."""
    accepted_by_env: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    """Rollouts running now."""
    max_in_flight: int = 0
    """Most rollouts that ever ran at once."""
    paused: dict[str, str] = field(default_factory=dict)
    """Env name -> why it is held back now (queue_full, ahead_of_trainer)."""
    trainer_step: int = 0
    policy_step: int = 0
    worker_deaths: int = 0
    workers_alive: int = 0
    mean_score: dict[str, float] = field(default_factory=dict)
    workers_recycled: Counter[str] = field(default_factory=Counter)
    """Workers replaced on purpose, by reason: memory_error, max_groups, rss, stuck (a group past its
    deadline)."""
    inference_reachable: bool = True
    """The inference circuit breaker is closed (while open, no group is dispatched)."""
    inference_outages: int = 0
    """Times the inference server became unreachable (one per outage, however many groups it touched)."""
    server_reachable: bool = True
    """The rollbuf server answers this runner's heartbeats: False once one failed, or went unanswered past
    `Timeouts.server_reply`, until one is answered (production goes on meanwhile; submits retry)."""
    release_timeouts: int = 0
    """Resource releases abandoned after `release_timeout`."""
    reregistered: int = 0
    """Times an env registered again because the server lost its registration (reset, restart)."""
    stalled: str | None = None
    """Why production is stalled (held ahead_of_trainer with no `resume()`), or None."""
    server_blocked: str | None = None
    """Why the server can form no batch from what is queued (its /status-env `blocked_reason`), or None."""
    rollouts_posted: int = 0
    """Rollouts posted one by one (`Environment.posts_each_rollout`) and acknowledged, its own and siblings'."""
    sibling_rollouts: int = 0
    """Of those, slots of other producers' groups (leased once their producer stopped heartbeating)."""
    slots_resumed: int = 0
    """Of those, slots continued from the turns their producer had acknowledged (docs/episodes.md)."""
    slots_restarted: int = 0
    """Sibling slots with acknowledged turns rolled out again from the prompt (their env cannot resume them)."""
    tokens_resumed: int = 0
    """Tokens the resumed slots took from those turns instead of generating them again."""
    rollouts_redone: int = 0
    """Rollouts posted for a slot another producer had acknowledged first: dropped, the first kept."""

    @property
    def failed_total(self) -> int:
        return sum(sum(c.values()) for c in self.failed.values())

    def count_workers(self, pool: WorkerPool | None) -> None:
        """Take in the worker pool's counts (the one place they are copied): alive now, deaths, recycled."""
        self.workers_alive = 0 if pool is None else len(pool.workers)
        if pool is not None:
            self.worker_deaths = pool.deaths
            self.workers_recycled = Counter(pool.recycled)

    def hold(self, names: Sequence[str], held: Sequence[str | None]) -> None:
        """`paused` from why each env (by name) waits now, or None where it does not."""
        for name, reason in zip(names, held, strict=True):
            if reason is None:
                self.paused.pop(name, None)
            else:
                self.paused[name] = reason

    def health(self, *, running: bool, paused: bool, policy_step: int, error: str | None) -> RunnerHealth:
        """The snapshot of these counts a trainer checks, with what only the runner knows."""
        return RunnerHealth(
            running=running,
            paused=paused,
            workers_alive=self.workers_alive,
            in_flight=self.in_flight,
            accepted=self.accepted,
            failed={env: dict(c) for env, c in self.failed.items()},
            failed_total=self.failed_total,
            error_rate=self.error_rate,
            skipped=dict(self.skipped),
            held_back=dict(self.paused),
            trainer_step=self.trainer_step,
            policy_step=policy_step,
            lag=max(0, self.trainer_step - policy_step),
            error=error,
            inference_reachable=self.inference_reachable,
            inference_outages=self.inference_outages,
            workers_recycled=dict(self.workers_recycled),
            stalled=self.stalled,
            rollouts_failed={env: dict(c) for env, c in self.rollouts_failed.items()},
            partial_groups=self.partial_groups,
            server_blocked=self.server_blocked,
            server_reachable=self.server_reachable,
        )


@dataclass(frozen=True)
class RunnerHealth:
    """A snapshot for a trainer deciding whether rollouts keep up: `lag` is how many steps the weights
    generating now are behind the trainer."""

    running: bool
    paused: bool
    """Generation is paused (between `pause()` and `resume()`)."""
    workers_alive: int
    in_flight: int
    accepted: int
    failed: dict[str, dict[str, int]]
    failed_total: int
    error_rate: float
    skipped: dict[str, int]
    held_back: dict[str, str]
    """Env name -> why it is held back now (queue_full, ahead_of_trainer)."""
    trainer_step: int
    policy_step: int
    lag: int
    error: str | None
    """Why the run ended, once it ended with an error."""
    inference_reachable: bool = True
    """The inference circuit breaker is closed; while it is open, dispatch holds."""
    inference_outages: int = 0
    workers_recycled: dict[str, int] = field(default_factory=dict)
    stalled: str | None = None
    """Set when production is stalled for a reason only the caller can fix (see `RunnerStats.stalled`)."""
    rollouts_failed: dict[str, dict[str, int]] = field(default_factory=dict)
    """Env name -> failed rollouts by reason (see `RunnerStats.rollouts_failed`)."""
    partial_groups: int = 0
    """Groups submitted with the survivors of failed rollouts (`min_group_size`)."""
    server_blocked: str | None = None
    """Why the server can form no batch from what is queued (group sizes that cannot add up under its trainer's
    `no_exact_fill: "wait"`, a minimum share holding batches back), as it says; None while batches form."""
    server_reachable: bool = True
    """The rollbuf server answers this runner's heartbeats (see `RunnerStats.server_reachable`)."""
