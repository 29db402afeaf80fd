"""The wire schema: the request and reply bodies of the Atropos protocol and rollbuf's extensions to it,
shared by the service and both clients (the common rules in `api.wire.rules`, the producers' heartbeats and weight
syncs in `api.wire.producers`).

Field names, defaults and reply shapes follow the AtroposLib API so that Atropos rollout handlers and
trainers work unchanged; rollbuf's extensions are optional fields that Atropos clients never send.
This module imports only pydantic, so clients can use it without pulling in FastAPI.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator

from api.wire.producers import ProducerView
from api.wire.replay import ReusePolicy
from api.wire.rollouts import OpenGroupsStatus
from api.wire.rules import (
    ENV_NAME_MAX,
    GROUP_ID_MAX,
    INT32_MAX,
    NON_EMPTY,
    PRODUCER_ID_MAX,
    SAFE_INT_MAX,
    MaskValue,
    Message,
    TokenFloat,
    TokenId,
    WeightVersion,
    _Request,
    _Text,
    _Wire,
    integral_floats,
)
from api.wire.tasks import DatasetView

ENV_EXAMPLE: dict[str, Any] = {"max_token_length": 2048, "desired_name": "math", "weight": 1.0, "group_size": 2}
"""An environment that POST /register-env accepts once the trainer polled /batch (GROUP_EXAMPLE's size)."""

GROUP_EXAMPLE: dict[str, Any] = {
    "tokens": [[1, 2, 3, 4], [1, 2, 3, 5]],
    "masks": [[-100, -100, 3, 4], [-100, -100, 3, 5]],
    "scores": [1.0, 0.0],
    "inference_logprobs": [[1.0, 1.0, -0.25, -0.5], [1.0, 1.0, -0.25, -1.5]],
    "group_id": "example-0",
}
"""A group that POST /scored_data accepts once a trainer registered with REGISTRATION_EXAMPLE."""

REGISTRATION_EXAMPLE: dict[str, Any] = {
    "wandb_group": "rollbuf",
    "wandb_project": "example",
    "batch_size": 8,
    "max_token_len": 2048,
    "checkpoint_dir": "checkpoints",
    "save_checkpoint_interval": 10,
    "starting_step": 0,
    "num_steps": 100,
}


# ----------------------------------------------------------------------------------------------- trainer


class Registration(_Request, _Text):
    """POST /register: the trainer's run configuration."""

    integer_fields = frozenset(
        [
            "batch_size",
            "max_token_len",
            "save_checkpoint_interval",
            "starting_step",
            "num_steps",
            "max_batch_tokens",
            "max_staleness",
        ]
    )

    model_config = ConfigDict(json_schema_extra={"examples": [REGISTRATION_EXAMPLE]})

    wandb_group: str
    """wandb group of the run (GET /wandb_info hands it to environments)."""
    wandb_project: str
    """wandb project of the run."""
    batch_size: int = Field(gt=0, le=INT32_MAX)
    """Sequences per batch; with `max_batch_tokens`, the most sequences a batch may hold."""
    max_token_len: int = Field(gt=0, le=INT32_MAX)
    """Longest sequence the trainer accepts; longer ones are rejected at ingest."""
    checkpoint_dir: str
    """Where the trainer saves checkpoints (told to environments at /register-env)."""
    save_checkpoint_interval: int = Field(ge=-SAFE_INT_MAX, le=SAFE_INT_MAX)
    """Steps between checkpoints (told to environments as `checkpoint_interval`)."""
    starting_step: int = Field(ge=0, le=SAFE_INT_MAX)
    """Step the run starts at (a resumed run: its checkpoint's step)."""
    num_steps: int = Field(ge=-SAFE_INT_MAX, le=SAFE_INT_MAX)
    """Steps the run is planned to last (told to environments)."""

    # rollbuf extensions (Atropos clients never send them)
    max_batch_tokens: int | None = Field(default=None, gt=0, le=SAFE_INT_MAX)
    """Token budget per batch: a batch is whole groups whose tokens stay within it."""
    min_batch_fill: float = Field(default=0.9, gt=0.0, le=1.0)
    """With `max_batch_tokens`: release a batch once it holds this share of the budget and no queued
    group fits any more."""
    max_staleness: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """Drop groups generated more than this many steps before the batch they would join."""
    drop_zero_variance: bool = False
    """Drop groups whose scores are all equal (no GRPO learning signal)."""
    min_score: float | None = Field(default=None, allow_inf_nan=False)
    """Drop groups whose mean score is below this."""
    max_score: float | None = Field(default=None, allow_inf_nan=False)
    """Drop groups whose mean score is above this."""
    no_exact_fill: Literal["smaller", "trim", "wait"] = "smaller"
    """Exact mode, when no choice of queued groups adds up to exactly `batch_size` (groups of 63 towards 256), or
    none holds a group passed over for `formation_due_after` batches: "smaller" serves the fullest batch of fewer
    sequences; "trim" serves exactly `batch_size` by cutting the newest group taken to its first sequences (the
    rest are left out); "wait" serves none (the reply's `blocked_reason` says why). docs/batching.md has the
    trade-offs."""
    acknowledge: Literal["next", "commit"] = "next"
    """How served batches are acknowledged (freed). "next" (Atropos): asking for batch N acknowledges every
    batch before it. "commit": `POST /commit` acknowledges them, and batches from the last commit on are served
    again with `?step=N` however far the trainer read ahead (within `max_read_ahead_batches`): for trainers
    that prefetch. Chosen here, before the first batch: a first commit would come too late for batches read
    ahead of it."""
    reuse: ReusePolicy | None = None
    """The run's reuse policy (docs/replay.md): how many times a group may be served, for how many steps, how much
    of a batch reused groups may take and in which order they are drawn. Null (the default): each group is served
    once, as in Atropos. This version serves each group once: a policy with `max_served` above 1 is refused (409
    naming `reuse.max_served`: replay is not served yet) rather than accepted and ignored."""


class CommitRequest(_Request):
    """POST /commit: every batch before `step` is trained and saved (the trainer's checkpoint hook sends it)."""

    integer_fields = frozenset(["step"])

    step: int = Field(ge=0, le=SAFE_INT_MAX)
    """The step training resumes from, as a checkpoint stores it: the batches before it are acknowledged and
    freed. At most the next step to be served; a step at or below the last commit changes nothing."""


class CommitReply(_Wire):
    committed_step: int
    """Every batch before this step is acknowledged (the largest step committed, or asked for in "next" mode)."""
    next_step: int
    """The next batch to be formed: batches `committed_step` to `next_step - 1` are kept for serving again."""
    kept_batches: int
    """Batches kept for serving again."""
    kept_bytes: int
    """What they hold, as stored."""


class RegisterReply(_Wire):
    uuid: int
    """A random 128-bit id for this registration (Atropos clients check that it is an integer)."""


class Info(_Wire):
    batch_size: int
    """The trainer's batch size; -1 before it registers."""
    max_token_len: int
    """The trainer's longest sequence; -1 before it registers."""
    # rollbuf extension
    content_types: list[str] | None = None
    """Encodings of /batch (Accept) and /scored_data(_list) (Content-Type) the server speaks; clients use
    JSON when this is absent (Atropos)."""
    max_read_ahead_batches: int | None = None
    """With `acknowledge: "commit"`: how many served batches may be uncommitted before `/batch` waits for a commit
    (a trainer checks that it commits often enough)."""


class WandbInfo(_Wire):
    group: str | None
    """The trainer's `wandb_group`; null before it registers."""
    project: str | None
    """The trainer's `wandb_project`; null before it registers."""


class EnvDropBias(_Wire):
    """The drop-bias monitor's view of one env over its window (docs/ledger.md, "Drop-bias monitor")."""

    env: str
    """The env's name (as in `dropped` and the metrics' `env` label)."""
    weight_share: float
    """Its weight over the connected envs' weights: the share of sequences the mix aims at."""
    min_share: float
    """Its minimum share (`min_batch_allocation`, scaled as formation scales them)."""
    floor: float
    """max(min_share, half its weight share): below it in `drop_bias_starve_steps` batches in a row, it is starved."""
    share: float | None = None
    """Its mean share of the window's batches (null before any batch)."""
    below_floor_steps: int = 0
    """Consecutive latest batches in which its share was below the floor."""
    trained: int = 0
    """Groups trained (served) in the window."""
    dropped: dict[str, int] = Field(default_factory=dict)
    """Groups dropped in the window, by reason."""
    length_skew: float | None = None
    """Mean tokens per sequence of unintentionally dropped groups (stale, expired) against trained ones, relative
    (+0.5: dropped ones are 50% longer); null until both exist."""
    reward_skew: float | None = None
    """Their mean rewards' difference in pooled standard deviations (null until both exist, or when both are
    constant and differ: see `flags`)."""
    flags: list[str] = Field(default_factory=list)
    """Conditions in force: `starved`, `length_skew`, `reward_skew`."""
    passed_over: int = 0
    """Batches that passed over its oldest group to form an exact fill (newer groups of it taken), over the run, not
    the window (the ledger's step rows do not record it: docs/ledger.md): a group held back this way is trained
    late, like one that took long to generate (docs/batching.md)."""


class Status(_Wire):
    current_step: int
    """Batches handed out so far, counted from the trainer's `starting_step` (0 before it registers)."""
    queue_size: int
    """Queued groups over all environments."""
    # rollbuf extensions
    queued_sequences: int = 0
    """Queued sequences over all environments."""
    queued_tokens: int = 0
    """Queued tokens over all environments."""
    queued_bytes: int = 0
    """Queued bytes over all environments, as stored (metadata included): what `max_queue_bytes` limits."""
    committed_step: int = 0
    """Every batch before this step is acknowledged (committed, or in "next" mode asked past)."""
    kept_batches: int = 0
    """Served batches kept for serving again with `?step=` (not acknowledged yet)."""
    kept_bytes: int = 0
    """Bytes those batches hold, as stored: what `max_read_ahead_bytes` bounds."""
    held_groups: int = 0
    """Groups waiting in side buffers (of another size than their env's `group_size`), not in `queue_size`;
    they count against the queue limits."""
    held_sequences: int = 0
    """Sequences waiting in side buffers."""
    held_tokens: int = 0
    """Tokens waiting in side buffers."""
    held_bytes: int = 0
    """Bytes waiting in side buffers, as stored."""
    blocked_reason: str | None = None
    """Why no batch can be formed other than "not enough data yet", or null."""
    dropped: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Groups dropped per environment name and reason (stale, zero_variance, score_range, side_buffer_expired,
    rollouts_<why>: a per-rollout group that expired, payload_lost: its bytes lost by the store, docs/stores.md)."""
    passed_over: dict[str, int] = Field(default_factory=dict)
    """Per env name: batches that passed over its oldest group (newer ones of it taken; docs/batching.md)."""
    smaller_batches: int = 0
    """Exact-mode batches of fewer than `batch_size` sequences (`no_exact_fill: "smaller"`)."""
    trimmed_batches: int = 0
    """Exact-mode batches that cut sequences off a group to hold exactly `batch_size` (`no_exact_fill: "trim"`)."""
    trimmed_sequences: dict[str, int] = Field(default_factory=dict)
    """Per env name: sequences cut off served groups (`no_exact_fill: "trim"`), left out like failed rollouts."""
    stale_tokens_masked: dict[str, int] = Field(default_factory=dict)
    """Per env name: trained tokens served masked out of the loss (-100) because older weights than the env's
    `max_token_staleness` allows sampled them."""
    min_share_holds: dict[str, float] = Field(default_factory=dict)
    """Per env name: seconds its `min_batch_allocation` has held batches back so far (it queues too little)."""
    min_share_releases: dict[str, int] = Field(default_factory=dict)
    """Per env name: holds released after `quiet_share_seconds` (its minimum applies again once it queues enough)."""
    tasks: list[DatasetView] = Field(default_factory=list)
    """Datasets of tasks leased to producers (docs/tasks.md): each one's cursor and tasks per state; the first
    `views_max_datasets` by name (GET /tasks pages through them all)."""
    tasks_total: int = 0
    """Datasets registered, listed in `tasks` or not."""
    drop_bias: list[EnvDropBias] = Field(default_factory=list)
    """Per env: its share of recent batches against its weight and minimum, and how the groups dropped compare with
    those trained (docs/ledger.md, "Drop-bias monitor"); empty with the ledger off."""
    weights_step: int | None = None
    """The step of the weights last announced live (POST /weights), or null before any."""
    producers: list[ProducerView] = Field(default_factory=list)
    """Producers that heartbeat (POST /producers/heartbeat), live or gone, with their last-seen time: the first
    `views_max_producers`, live ones first (GET /producers pages through them all)."""
    producers_total: int = 0
    """Producers recorded, listed in `producers` or not."""
    stall_reason: str | None = None
    """Why nothing can arrive for a waiting trainer (no live producer for the connected envs, or every live one
    held back waiting for the trainer), or null when something may, or when the run is finished."""
    finished: bool = False
    """The run is over, no batch will come: every dataset feeding it is done, nothing else can arrive (every
    connected env fed by a dataset, or without a live producer) and nothing is queued or held (docs/tasks.md, "The
    end of a dataset"). Always false in a run without datasets: its trainer ends by its own step count."""
    rollouts: OpenGroupsStatus | None = None
    """Per-rollout groups (docs/rollouts.md): open now, their slots done and leased, redispatches, sealed and
    expired. Absent in runs that never opened one."""
    blobs: BlobsStatus | None = None
    """The blob tier (docs/payloads.md): what it holds, its dedup ratio, its writes and collections. Absent on a
    server without the tier."""


class BlobsStatus(_Wire):
    """The blob tier in /status (docs/payloads.md)."""

    objects: int
    """Blobs held, counted at the last collection (and at start)."""
    bytes: int
    """Their bytes."""
    references: int
    """References to them in the stored payloads at the last collection (a blob of 8 siblings counts 8)."""
    dedup_ratio: float
    """References per blob held at the last collection: 1 when no value is stored twice, 0 before any."""
    written: int
    """Blobs this server process wrote since it started."""
    written_bytes: int
    """Their bytes."""
    deduplicated: int
    """Values this process stored whose blob was already there (a sibling's, another group's)."""
    refused: int
    """Submissions this process refused with 503 past `max_blob_bytes` or `max_blob_bytes_per_key`."""
    collected: int
    """Blobs this process collected (nothing referred to them past `blob_grace_s`)."""
    collected_bytes: int
    """Their bytes."""


# ----------------------------------------------------------------------------------------------- envs


class RegisterEnv(_Request, _Text):
    """POST /register-env: a rollout handler announces itself."""

    integer_fields = frozenset(["max_token_length", "group_size", "max_token_staleness"])

    model_config = ConfigDict(json_schema_extra={"examples": [ENV_EXAMPLE]})

    max_token_length: int = Field(gt=0, le=INT32_MAX)
    """Longest sequence this environment produces."""
    desired_name: str = Field(max_length=ENV_NAME_MAX)
    """Name of the environment (at most 200 characters); the reply's `wandb_name` is `<desired_name>_<k>` for
    its k-th registration."""
    weight: float = Field(default=1.0, ge=0.0, le=1e12, allow_inf_nan=False)
    """Share of batches relative to other environments' weights."""
    group_size: int = Field(gt=0, le=INT32_MAX)
    """Sequences per group this environment sends (at most the trainer's `batch_size`: 422 beyond)."""
    min_batch_allocation: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of every batch reserved for this environment (0.0–1.0)."""
    variable_group_size: bool = False
    """rollbuf: this environment's groups may hold fewer (or more) sequences than `group_size` and are complete
    as sent (a group that kept the survivors of failed rollouts): each is queued whole. Without it, a group of
    another size waits in the side buffer until such groups add up to `group_size` (Atropos's rule)."""
    max_token_staleness: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """rollbuf: when a batch is formed at step S, the trained tokens of this env's groups that weights older than
    S - max_token_staleness sampled (by their `token_weight_versions`) are masked out of the loss: served with the
    mask -100, counted in /status `stale_tokens_masked`. Null (the default): no token is masked for its age."""
    reuse: ReusePolicy | None = None
    """rollbuf: this env's reuse policy where it differs from the trainer's `reuse` (docs/replay.md); `{"max_served":
    1}` opts the env out of reuse. Null (the default): the trainer's policy applies. This version serves each group
    once: a policy with `max_served` above 1 is refused (409 naming `reuse.max_served`)."""


class EnvRegistered(_Wire):
    status: Literal["success"] = "success"
    """Registered (see `EnvWait` for the other answer)."""
    env_id: int
    """The environment's id, counted from 0; its groups carry it as `env_id`."""
    wandb_name: str
    """`<desired_name>_<k>`, k counting earlier registrations under that name."""
    checkpoint_dir: str
    """The trainer's `checkpoint_dir`."""
    starting_step: int
    """The trainer's `starting_step`."""
    checkpoint_interval: int
    """The trainer's `save_checkpoint_interval`."""
    num_steps: int
    """The trainer's `num_steps`."""
    warning: str | None = None
    """Set when this environment's group size cannot fill a batch on its own."""


class EnvWait(_Wire):
    """POST /register-env before the trainer's first GET /batch: try again in a second (Atropos's answer)."""

    status: Literal["wait for trainer to start"]
    """Atropos clients sleep a second and register again."""


class EnvIdentifier(_Request):
    integer_fields = frozenset({"env_id"})
    model_config = ConfigDict(json_schema_extra={"examples": [{"env_id": 0}]})

    env_id: int = Field(ge=-SAFE_INT_MAX, le=SAFE_INT_MAX)
    """The id /register-env returned."""


class DisconnectReply(_Wire):
    status: Literal["success", "failure"]
    """"failure" when no environment has this id (Atropos's in-band answer, HTTP 200)."""
    error: str | None = None
    """With "failure": why."""


class EnvStatus(_Wire):
    current_step: int
    """The trainer's current step (how far off-policy this environment's next group will be)."""
    queue_size: int
    """Queued work in units of this env's group size: its own queued sequences plus what other envs have
    beyond their minimum allocations (Atropos's measure, used to stop producing when far ahead)."""
    unallocated_fraction: float
    """1 minus the connected environments' minimum allocations, floored at 0."""
    self_queue_size: int
    """This environment's queued groups."""
    max_group_size: int
    """Largest group size of the connected environments."""
    env_weight: float
    """This env's `max_token_length * weight` over the sum for connected envs, floored at 0.01."""
    # rollbuf extensions
    queue_capacity_groups: int | None = None
    """How many more groups of this env's size the server accepts before answering 503, or null."""
    queued_sequences: int | None = None
    """Sequences queued over all envs, as /status counts them: against `batch_size`, how many the batch being
    formed still lacks, which producers pacing by `max_staleness` never hold back (`queue_size` is in this
    env's group size, rounded down, and leaves out other envs' reserved shares)."""
    blocked_reason: str | None = None
    """Why the server can form no batch from what is queued (the sizes cannot add up under `no_exact_fill:
    "wait"`, a minimum share holds batches back), as /status says; null when batches form or only data is
    missing. The rollout client logs it once and shows it in `health()`."""
    weights_step: int | None = None
    """The step of the weights the trainer last announced live on the inference servers (POST /weights), or null
    before any announcement: producers stamp it on the groups they start from then on."""
    weights_pending: int | None = None
    """The step of a weight sync the trainer has begun (POST /weights/pending) and not yet announced, or null:
    producers of `on_new_weights="drain"` envs start no new group of them and report drained in their heartbeat."""


# ----------------------------------------------------------------------------------------------- data


class ScoredData(_Wire):
    """One scored group: G sequences sampled for one prompt. Every per-token field has one row per sequence,
    each as long as that sequence's tokens; `scores` has one value per sequence (422 otherwise).

    The server validates it strictly, and only when that fails retries with `lenient_group`'s forms, so the
    common case pays nothing for them (`api.http.body.validate`)."""

    integer_fields: ClassVar[frozenset[str]] = frozenset(
        ["tokens", "masks", "env_id", "distill_token_ids", "policy_step", "token_weight_versions"]
    )

    model_config = ConfigDict(json_schema_extra={"examples": [GROUP_EXAMPLE]})

    tokens: Annotated[list[Annotated[list[TokenId], NON_EMPTY]], NON_EMPTY]
    """Token ids per sequence (prompt and completion), each from 0 to 2^31 - 1 (int32, as stored); at least
    one sequence, none empty, none longer than the trainer's `max_token_len`."""
    masks: Annotated[list[Annotated[list[MaskValue], NON_EMPTY]], NON_EMPTY]
    """Any int32, one per token, stored and served as sent. Atropos's convention (its `BaseEnv`, and
    `trainer_client`'s `trained`): -100 at positions not trained on, else the token id."""
    scores: Annotated[list[float], NON_EMPTY]
    """One finite score per sequence."""
    advantages: list[list[TokenFloat]] | None = None
    """Per-token advantages, when the environment computes them (finite float32)."""
    ref_logprobs: list[list[TokenFloat]] | None = None
    """Per-token log-probabilities under a reference model (finite float32)."""
    messages: list[list[Message]] | None = None
    """Each sequence as chat messages; every message has `role` and `content`."""
    generation_params: dict[str, Any] | None = None
    """Sampling parameters of the group (`temperature`, ...), as the handler sent them."""
    inference_logprobs: list[list[TokenFloat]] | None = None
    """Per-token log-probabilities from the inference server, 1.0 at prompt positions (Atropos's sentinel)."""
    overrides: list[dict[str, Any]] | None = None
    """Per-sequence settings for the trainer (e.g. `temperature`), one dict per sequence."""
    group_overrides: dict[str, Any] | None = None
    """Settings for the whole group, as the handler sent them."""
    images: Any = None
    """Images of a multimodal group, in any JSON form; stored and served as sent."""
    env_id: int | None = Field(default=None, ge=-SAFE_INT_MAX, le=SAFE_INT_MAX)
    """The id /register-env returned (422 if no such environment), or null."""
    distill_token_ids: list[list[list[int]]] | None = None
    """Top-K token ids per position for distillation, shaped [sequence][position][K]."""
    distill_logprobs: list[list[list[float]]] | None = None
    """Their log-probabilities, shaped like `distill_token_ids`."""

    # rollbuf extensions
    policy_step: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """Trainer step whose weights generated this group, at most the trainer's current step (422 beyond);
    the server stamps the current step when absent."""
    group_id: str | None = Field(default=None, min_length=1, max_length=GROUP_ID_MAX)
    """Client-chosen id, scoped by env: a resubmission with an id already seen and the same content is
    acknowledged (`duplicate: true`) and not stored twice; with different content it is a 409."""
    producer_id: str | None = Field(default=None, min_length=1, max_length=PRODUCER_ID_MAX)
    """The producer that made it (its heartbeat `producer_id`): kept in the group's ledger row, not served."""
    token_weight_versions: list[list[WeightVersion]] | None = None
    """Per token, the trainer step of the weights that sampled it (an episode that spanned weight syncs has several;
    prompt and tool positions may carry the version of the turn they precede): one row per sequence, each as long as
    its tokens, every value from 0 to the trainer's current step (422 otherwise). Stored and served in /batch beside
    the masks; without it the group is stored and served as before."""

    @field_validator("messages")
    @classmethod
    def _messages_have_role_and_content(cls, v: list[list[dict[str, Any]]] | None) -> Any:
        for conversation in v or ():
            for msg in conversation:
                if "role" not in msg or "content" not in msg:
                    raise ValueError("every message must have 'role' and 'content'")
        return v


def lenient_group(data: Any) -> Any:
    """A scored group (or a list of them) with the forms strict validation refuses but rollbuf accepts:
    integral floats in integer fields (`8.0`, an integer in JSON Schema) and booleans in `masks` as 1/0
    (verl's Atropos recipe sends boolean masks; Atropos's lax validation takes them)."""
    if isinstance(data, list):
        return [lenient_group(g) for g in data]
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name in ScoredData.integer_fields:
        if name in out:
            out[name] = integral_floats(out[name])
    masks = out.get("masks")
    if isinstance(masks, list):
        out["masks"] = [[int(x) if type(x) is bool else x for x in r] if isinstance(r, list) else r for r in masks]
    return out


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


class ScoredReply(_Wire):
    status: Literal["received", "buffered"]
    """"received": queued; "buffered": held until this env's groups add up to its `group_size`."""
    buffer_size: int | None = None
    """With "buffered": sequences held in this env's side buffer."""
    duplicate: bool | None = None
    """True when the group id was seen before and nothing was stored again."""


class ScoredListReply(_Wire):
    status: Literal["received"] = "received"
    """Every group of the list was accepted (one invalid group rejects the whole list)."""
    groups_processed: int
    """Groups in the list."""
    buffered: int | None = None
    """How many went to their env's side buffer, when any did."""
    last_buffer_size: int | None = None
    """Sequences in the side buffer after the last buffered group."""
    duplicates: int | None = None
    """How many were retries of groups already stored (same group id, same content)."""
    # rollbuf extensions
    duplicate_at: list[int] | None = None
    """When some were duplicates: their indexes in the list, in order (what /scored_data says of each with
    `duplicate`), so that a client that sends its groups in lists counts each as /scored_data would."""


class BatchGroup(_Wire):
    """A group as GET /batch serves it: all 14 ScoredData keys (null when not sent), numbers as sent."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None
    ref_logprobs: list[list[float]] | None
    messages: list[list[dict[str, Any]]] | None
    generation_params: dict[str, Any] | None
    inference_logprobs: list[list[float]] | None
    overrides: list[dict[str, Any]] | None
    group_overrides: dict[str, Any] | None
    images: Any
    env_id: int | None
    distill_token_ids: list[list[list[int]]] | None
    distill_logprobs: list[list[list[float]]] | None
    # rollbuf extensions
    policy_step: int | None = None
    """Trainer step whose weights generated the group."""
    group_id: str | None = None
    """The handler's group id, or null."""
    group_scores: list[float] | None = None
    """With `?rank=`: the whole group's scores when this share holds only some of its sequences."""
    token_weight_versions: list[list[int]] | None = None
    """Per token, the trainer step of the weights that sampled it, when the handler sent them (the key is absent
    otherwise)."""


class BatchReply(_Wire):
    """GET /batch (JSON): a batch, `{"batch": null}` when none is ready, or Atropos's in-band error before
    a trainer registered (`status`, `message`, `"batch": []`)."""

    batch: list[BatchGroup] | None
    """The batch's groups; null when none can be formed yet (poll again, or use `?wait=`)."""
    step: int | None = None
    """With `?rank=`: the batch's step."""
    blocked_reason: str | None = None
    """With a null batch: why no batch can be formed, when it is something other than data still coming."""
    stall_reason: str | None = None
    """With a null batch: why no data can arrive (no live producer for the connected envs, or every live one held
    back waiting for the trainer); null when some may. Atropos clients ignore it."""
    finished: bool = False
    """With a null batch: the run is over, no batch will come: every dataset feeding it is done (each task trained,
    dropped or failed), nothing else can arrive and nothing is queued (docs/tasks.md, "The end of a dataset").
    Sent only when true; never in a run without datasets. Atropos clients ignore it."""
    status: Literal["error"] | None = None
    """"error" before a trainer registered (Atropos's answer, HTTP 200)."""
    message: str | None = None
    """With "error": what to do."""


class ErrorItem(_Wire):
    loc: list[str | int]
    """Where: `body`, `query` or `header`, then the field's path (list positions as integers); empty when
    the error is about no one field."""
    msg: str
    """The rule that was broken, or what went wrong, in words."""
    type: str
    """The rule's name (pydantic's error type, or the reply's `code`)."""


class ErrorBody(_Wire):
    """Every error reply, 4xx and 5xx, whoever raised it (docs/api.md, "Errors")."""

    code: str
    """What kind of error: invalid (422), bad_request, bad_encoding, unauthorized, not_found,
    method_not_allowed, conflict, gone, payload_too_large, unavailable, internal."""
    message: str
    """The errors in one line, `loc: msg; ...`, for logs."""
    errors: list[ErrorItem]
    """Each error with where it is and the rule."""
    detail: str | list[ErrorItem]
    """As FastAPI (and so Atropos) writes it: the list of errors for a 422, a string otherwise."""
