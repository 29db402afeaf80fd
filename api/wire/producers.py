"""The producers' side of the wire (rollbuf extensions, no Atropos counterpart): weights announced live, the
two-phase weight sync, and the heartbeats by which producers are seen live (docs/api.md). Imports only pydantic."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from api.wire.rollouts import ENVS_MAX
from api.wire.rules import ENV_NAME_MAX, PRODUCER_ID_MAX, SAFE_INT_MAX, _Request, _Text, _Wire

HELD_REASON_MAX = 64
"""Longest reason in a heartbeat's `held` (a word: `ahead_of_trainer`, `queue_full`, `draining`)."""
WANDB_NAME_MAX = ENV_NAME_MAX + 24
"""Longest env name as views show it (its W&B name: `desired_name` and `_N`), the keys of `held`."""


class WeightsAnnounce(_Request):
    """POST /weights: the weights of trainer step `step` are live on the inference servers."""

    integer_fields = frozenset(["step"])

    step: int = Field(ge=0, le=SAFE_INT_MAX)
    """The trainer step whose weights now generate (at most the trainer's current step: 422 beyond). A step at or
    below the one announced last changes nothing, so a retry is safe."""


class WeightsReply(_Wire):
    weights_step: int | None
    """The step of the weights announced live last, or null before any announcement."""


class WeightSyncReply(_Wire):
    """A weight sync begun and not yet announced (POST/GET /weights/pending): who the trainer still waits for."""

    weights_step: int | None
    """The step of the weights announced live last, or null."""
    pending_step: int | None
    """The step of the sync begun and not yet announced (null: none pending)."""
    waiting_on: list[str]
    """The live producers of drain envs (`on_new_weights="drain"`) not yet drained for `pending_step`, as
    "producer_id on host"; producers gone (`producer_gone_after`) are not waited for."""
    drained: bool
    """A sync is pending and no live producer is waited for: push the weights, then POST /weights."""


class Heartbeat(_Request, _Text):
    """POST /producers/heartbeat: a producer says it is alive and what it does."""

    integer_fields = frozenset(["in_flight", "accepted", "failures", "weights_step", "drained_for", "trainer_step"])

    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """Chosen by the producer once per process (a restart is a new producer)."""
    host: str = Field(default="", max_length=255)
    """Where it runs, as it names itself."""
    env_ids: list[int] = Field(default_factory=list, max_length=1024)
    """The envs it produces for (ids from /register-env)."""
    in_flight: int = Field(default=0, ge=0, le=SAFE_INT_MAX)
    """Rollouts in flight."""
    groups_per_s: float = Field(default=0.0, ge=0.0, le=1e9, allow_inf_nan=False)
    """Groups accepted per second lately."""
    accepted: int = Field(default=0, ge=0, le=SAFE_INT_MAX)
    """Groups accepted since it started."""
    failures: int = Field(default=0, ge=0, le=SAFE_INT_MAX)
    """Groups failed since it started."""
    weights_step: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """The step of the weights it generates with now."""
    held: dict[Annotated[str, Field(max_length=WANDB_NAME_MAX)], Annotated[str, Field(max_length=HELD_REASON_MAX)]] = (
        Field(default_factory=dict, max_length=1024)
    )
    """Env name -> why it starts no group of it now (`ahead_of_trainer`, `queue_full`, ...), for the envs of
    `env_ids`: entries naming another env are not kept."""
    sibling_envs: list[Annotated[str, Field(max_length=ENV_NAME_MAX)]] | None = Field(default=None, max_length=ENVS_MAX)
    """The env names (`desired_name`) whose missing slots it takes from other producers' per-rollout groups
    (`POST /rollouts/lease`'s `envs`): the reply says when there are some to take (`siblings_due_in`), so that
    it leases only then instead of polling."""
    trainer_step: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """The trainer step its `held` verdicts were judged at (its last read of it, from /status-env). A waiting
    trainer's `stall_reason` counts a producer held back for the trainer only on verdicts judged at the trainer's
    current step, with no weights announced since; without it, the step when the heartbeat is recorded."""
    waiting_for: str | None = Field(default=None, max_length=1000)
    """What it waits for, in words."""
    drains: bool = False
    """It produces for an env whose `on_new_weights` is "drain": a pending weight sync waits for it."""
    drained_for: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """The pending sync's step once its drain envs have no episode in flight and start none (null otherwise)."""


class HeartbeatReply(_Wire):
    weights_step: int | None
    """The weights announced live last (as `GET /weights`)."""
    weights_pending: int | None = None
    """The step of a weight sync begun and not yet announced, or null (as `/status-env`)."""
    gone_after: float
    """Seconds without a heartbeat after which the server counts a producer gone: beat well within it."""
    siblings_due_in: float | None = None
    """With `sibling_envs`: seconds until missing slots of open groups of those envs may be leased (`POST
    /rollouts/lease`): 0 when some may now, `gone_after` when none may before then (null without
    `sibling_envs`). The soonest of at most 16 groups: a producer whose lease comes back full leases again."""


class ProducerView(_Wire):
    """A producer as the server last heard of it (GET /producers, /status)."""

    producer_id: str
    """Its id (one per process)."""
    host: str
    """Where it runs, as it names itself."""
    envs: list[str]
    """The names of the envs it produces for."""
    live: bool
    """Heard of within `producer_gone_after` s."""
    last_seen: float
    """Unix time of its last heartbeat."""
    last_seen_s: float
    """Seconds since then."""
    in_flight: int
    """Rollouts in flight, as of its last heartbeat."""
    groups_per_s: float
    """Groups accepted per second lately."""
    accepted: int
    """Groups accepted since it started."""
    failures: int
    """Groups failed since it started."""
    weights_step: int | None
    """The step of the weights it generates with."""
    held: dict[str, str]
    """Env name -> why it starts no group of it now."""
    waiting_for: str | None
    """What it says it waits for, or null."""
    drains: bool = False
    """It produces for a drain env (`on_new_weights="drain"`): a pending weight sync waits for it."""
    drained_for: int | None = None
    """The pending sync's step it has drained for, or null."""
