"""The wire schema: every request and reply body, shared by the service and both clients.

Field names, defaults and reply shapes follow the AtroposLib API so that Atropos rollout handlers and
trainers work unchanged; rollbuf's extensions are optional fields that Atropos clients never send.
This module imports only pydantic, so clients can use it without pulling in FastAPI.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Token ids and masks travel as int32 on the binary path and in the store.
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
MASK_IGNORE = -100
"""Mask value of a position the trainer does not train on (the prompt)."""


class _Wire(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="ignore")


# ----------------------------------------------------------------------------------------------- trainer


class Registration(_Wire):
    """POST /register: the trainer's run configuration."""

    wandb_group: str
    wandb_project: str
    batch_size: int = Field(gt=0)
    """Sequences per batch; with `max_batch_tokens`, the most sequences a batch may hold."""
    max_token_len: int = Field(gt=0)
    """Longest sequence the trainer accepts; longer ones are rejected at ingest."""
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int = Field(ge=0)
    num_steps: int

    # rollbuf extensions (Atropos clients never send them)
    max_batch_tokens: int | None = Field(default=None, gt=0)
    """Token budget per batch: a batch is whole groups whose tokens stay within it."""
    min_batch_fill: float = Field(default=0.9, gt=0.0, le=1.0)
    """With `max_batch_tokens`: release a batch once it holds this share of the budget and no queued
    group fits any more."""
    max_staleness: int | None = Field(default=None, ge=0)
    """Drop groups generated more than this many steps before the batch they would join."""
    drop_zero_variance: bool = False
    """Drop groups whose scores are all equal (no GRPO learning signal)."""
    min_score: float | None = Field(default=None, allow_inf_nan=False)
    """Drop groups whose mean score is below this."""
    max_score: float | None = Field(default=None, allow_inf_nan=False)
    """Drop groups whose mean score is above this."""


class RegisterReply(_Wire):
    uuid: int


class Info(_Wire):
    batch_size: int
    max_token_len: int
    # rollbuf extension
    content_types: list[str] | None = None
    """Encodings of /batch (Accept) and /scored_data(_list) (Content-Type) the server speaks; clients use
    JSON when this is absent (Atropos)."""


class WandbInfo(_Wire):
    group: str | None
    project: str | None


class Status(_Wire):
    current_step: int
    queue_size: int
    """Queued groups over all environments."""
    # rollbuf extensions
    queued_sequences: int = 0
    queued_tokens: int = 0
    blocked_reason: str | None = None
    """Why no batch can be formed other than "not enough data yet", or null."""
    dropped: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Groups dropped per environment name and reason (stale, zero_variance, score_range)."""


# ----------------------------------------------------------------------------------------------- envs


class RegisterEnv(_Wire):
    """POST /register-env: a rollout handler announces itself."""

    max_token_length: int = Field(gt=0)
    desired_name: str
    weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    """Share of batches relative to other environments' weights."""
    group_size: int = Field(gt=0)
    min_batch_allocation: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of every batch reserved for this environment (0.0–1.0)."""


class EnvRegistered(_Wire):
    status: Literal["success"] = "success"
    env_id: int
    wandb_name: str
    checkpoint_dir: str
    starting_step: int
    checkpoint_interval: int
    num_steps: int
    warning: str | None = None
    """Set when this environment's group size cannot fill a batch on its own."""


class EnvIdentifier(_Wire):
    env_id: int


class EnvStatus(_Wire):
    current_step: int
    queue_size: int
    unallocated_fraction: float
    self_queue_size: int
    max_group_size: int
    env_weight: float
    # rollbuf extensions
    queue_capacity_groups: int | None = None
    """How many more groups of this env's size the server accepts before answering 503, or null."""


# ----------------------------------------------------------------------------------------------- data


class ScoredData(_Wire):
    """One scored group: G sequences sampled for one prompt."""

    tokens: list[list[int]]
    """Token ids per sequence, each from 0 to 2^31 - 1 (int32, as stored)."""
    masks: list[list[int]]
    """Any int32, one per token, stored and served as sent. Atropos's convention (its `BaseEnv`, and
    `trainer_client`'s `trained`): -100 at positions not trained on, else the token id."""
    scores: list[float]
    """One finite score per sequence."""
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None

    # rollbuf extensions
    policy_step: int | None = Field(default=None, ge=0)
    """Trainer step whose weights generated this group, at most the trainer's current step (422 beyond);
    the server stamps the current step when absent."""
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    """Client-chosen id, scoped by env: a resubmission with an id already seen and the same content is
    acknowledged (`duplicate: true`) and not stored twice; with different content it is a 409."""

    @field_validator("messages")
    @classmethod
    def _messages_have_role_and_content(cls, v: list[list[dict[str, Any]]] | None) -> Any:
        for conversation in v or ():
            for msg in conversation:
                if "role" not in msg or "content" not in msg:
                    raise ValueError("every message must have 'role' and 'content'")
        return v


SCORED_DATA_KEYS = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)
"""The keys every group in a /batch reply carries (Atropos trainers index them directly)."""

PER_TOKEN_FLOAT_FIELDS = ("advantages", "ref_logprobs", "inference_logprobs")
"""Per-token float fields: stored as float32 where that is exact for the field's values, else as float64;
served as sent."""


class ScoredReply(_Wire):
    status: Literal["received", "buffered"]
    buffer_size: int | None = None
    """With "buffered": sequences held in this env's side buffer."""
    duplicate: bool | None = None
    """True when the group id was seen before and nothing was stored again."""


class ScoredListReply(_Wire):
    status: Literal["received"] = "received"
    groups_processed: int
    buffered: int | None = None
    last_buffer_size: int | None = None
    duplicates: int | None = None


class ErrorBody(_Wire):
    detail: Any
    code: str | None = None
