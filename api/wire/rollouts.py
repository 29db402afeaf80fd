"""Groups whose rollouts arrive one by one, on the wire (docs/rollouts.md, rollbuf extensions): a group opened,
its rollouts posted as they end, its missing slots leased to siblings, its seal. Imports only pydantic and the
wire's rules: clients import it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from api.wire.rules import (
    ENV_NAME_MAX,
    GROUP_ID_MAX,
    INT32_MAX,
    INT32_MIN,
    PRODUCER_ID_MAX,
    SAFE_INT_MAX,
    TokenFloat,
    TokenId,
    WeightVersion,
    _Request,
    _Text,
    _Wire,
)

ENVS_MAX = 64
"""Most env names a sibling lease request may name (a producer names the envs it runs; a list past this is refused
with 422, and one of long names whose escaped JSON passes the route's body bound with 413)."""
SLOTS_MAX = 4096
"""Largest G of an open group."""
Slot = Annotated[int, Field(ge=0, lt=SLOTS_MAX)]


class OpenRequest(_Request, _Text):
    """POST /rollouts/open: open a group of `group_size` rollouts for one task."""

    integer_fields = frozenset(["env_id", "group_size", "min_group_size"])

    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX)
    """The group's id: its sealed group is ingested under it (a task lease token makes it the task's
    submission). Opening it again with the same spec is a no-op."""
    env_id: int | None = Field(default=None, ge=-SAFE_INT_MAX, le=SAFE_INT_MAX)
    """The env it belongs to, as for POST /scored_data."""
    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """Who holds its missing slots while it heartbeats (POST /rollouts/heartbeat)."""
    group_size: int = Field(ge=1, le=SLOTS_MAX)
    """G: its slots are 0 .. G - 1."""
    min_group_size: int | None = Field(default=None, ge=1, le=SLOTS_MAX)
    """Sealed at the deadline with at least this many (default: G, so only whole groups)."""
    deadline_s: float = Field(gt=0)
    """Seconds from now to its deadline (at most `rollout_max_deadline_s`)."""
    scores_at_seal: bool = False
    """Scored as a group: the producer seals it with the scores (POST /rollouts/seal); never sealed alone."""
    task: Any = None
    """What a sibling needs to redo a slot (a prompt, a task): handed out with each sibling lease."""


RolloutMask = Annotated[int, WithJsonSchema({"type": "integer", "minimum": INT32_MIN, "maximum": INT32_MAX})]
"""A mask value of a post (an integer: a post is read strictly, where a group's masks may also be booleans)."""


class RolloutPost(_Request, _Text):
    """POST /rollouts/post: one rollout of an open group, acknowledged durably."""

    integer_fields = frozenset(["slot", "tokens", "masks", "policy_step", "token_weight_versions"])

    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX)
    """The open group it belongs to."""
    slot: Slot
    """Its slot in the group, 0 .. G - 1: the first rollout acknowledged for a slot is kept."""
    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """The producer that rolled it out."""
    tokens: list[TokenId]
    """Its token ids, prompt and completion: at least one (422 naming it). With `after_turns`, those after its
    turns' (the last turn's own or the end of the rollout), none if the turns are the whole rollout: a slot whose
    turns were acknowledged is always completed by its score alone, whatever the group's token budget holds."""
    masks: list[RolloutMask]
    """As a group's row: -100 where not trained on, else the token id."""
    inference_logprobs: list[TokenFloat] | None = None
    """The sampler's logprob of each token, as a group's row."""
    score: float | None = None
    """Its score, when each rollout is scored alone; null: scored at the seal."""
    policy_step: int | None = Field(default=None, ge=0, le=SAFE_INT_MAX)
    """The step of the weights it was generated with. The sealed group's `policy_step` is the oldest of its
    rollouts' (staleness counts from it); null for all: the group has none, as a group sent without one."""
    overrides: dict[str, Any] | None = None
    """Its record (turns, timings, truncation...): the sealed group's `overrides` entry for it."""
    token_weight_versions: list[WeightVersion] | None = None
    """Per token, the trainer step of the weights that sampled it, as a group's row (one per token, each at most the
    trainer's current step: 409 beyond)."""
    after_turns: bool = False
    """True: the rollout is its slot's acknowledged turns (POST /rollouts/turn) followed by what this post carries:
    its tokens, masks, logprobs and versions are the turns' concatenated with this post's (which may add none), and
    the slot stores the whole rollout. False: this post is the whole rollout."""


SNAPSHOT_URI_MAX = 2048
"""Longest `snapshot.uri` of a turn."""
TOOL_RESULTS_MAX = 256
"""Most entries of a turn's `tool_results`."""


BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""Base64 with its padding (RFC 4648), as the schema states it."""


class InlineSnapshot(_Request, _Text):
    """An env state sent inline: its bytes, base64."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", strict=True)

    data: str = Field(pattern=BASE64)
    """The state's bytes, base64 (at most `rollout_max_snapshot_bytes` decoded)."""


class SnapshotByUri(_Request, _Text):
    """An env state kept elsewhere: where (rollbuf never reads it)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", strict=True)

    uri: str = Field(min_length=1, max_length=SNAPSHOT_URI_MAX)
    """Where the state is kept, for a state too large to send."""


class TurnSnapshot(_Wire):
    """A turn's env state as a reply carries it: inline (`data`, base64) or by reference (`uri`)."""

    data: str | None = None
    """The env's state as the turn posted it (base64), when it was sent inline."""
    uri: str | None = None
    """Where the env keeps its state (a sandbox image, a volume), when it was sent by reference."""


class TurnPost(_Request, _Text):
    """POST /rollouts/turn: one turn of a slot's rollout, acknowledged durably as it ends (docs/rollouts.md, Turns)."""

    integer_fields = frozenset(["slot", "turn", "tokens", "masks", "token_weight_versions"])

    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX)
    """The open group."""
    slot: Slot
    """The slot whose rollout this turn is of."""
    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """The producer holding the slot: the group's opener while no sibling leased it, else the sibling."""
    turn: int = Field(ge=0, le=SAFE_INT_MAX)
    """0, 1, ...: the slot's next turn (a gap is a 409 naming the one expected)."""
    tokens: list[TokenId] = Field(min_length=1)
    """The token ids this turn appends to the rollout (one at least)."""
    masks: list[RolloutMask] = Field(min_length=1)
    """One per token, as a post's."""
    inference_logprobs: list[TokenFloat] | None = None
    """One per token, as a post's (every turn of a slot sends them, or none does)."""
    token_weight_versions: list[WeightVersion] | None = None
    """One per token, as a post's (every turn of a slot sends them, or none does)."""
    tool_results: list[Any] | None = Field(default=None, max_length=TOOL_RESULTS_MAX)
    """What the env's tools answered in this turn (JSON), handed back with the slot's lease."""
    snapshot: InlineSnapshot | SnapshotByUri | None = None
    """The env's state after this turn, opaque to rollbuf (`{"data": base64}` or `{"uri": ...}`): the lease hands
    the last one to the producer that continues."""


class TurnReply(_Wire):
    status: Literal["accepted", "duplicate"]
    """`duplicate`: this turn was acknowledged before with the same content."""
    turns: int
    """The slot's acknowledged turns now (the next turn to post)."""
    tokens: int
    """The tokens of those turns."""


class TurnView(_Wire):
    """One acknowledged turn, as a slot's prefix carries it."""

    turn: int
    """Its number in the slot: 0, 1, ..."""
    producer: str
    """Who posted it."""
    tokens: list[int]
    """The token ids it appended to the rollout."""
    masks: list[int]
    """One per token, as posted."""
    inference_logprobs: list[float] | None
    """One per token, as posted (none if the turn sent none)."""
    token_weight_versions: list[int] | None
    """One per token: the trainer step of the weights that sampled it (none if the turn sent none)."""
    tool_results: list[Any] | None
    """The tool results the turn recorded, as posted (none if it sent none)."""


class SlotPrefix(_Wire):
    """A slot's acknowledged turns: what a producer that takes its lease continues from (at turn `len(turns)`)."""

    turns: int
    """How many turns are acknowledged: the next turn to post."""
    tokens: int
    """Their tokens."""
    complete: bool
    """False: the turns hold more than `rollout_max_prefix_reply_bytes` and are left out here (`items` empty):
    read them from GET /rollouts/turns."""
    items: list[TurnView]
    """The turns, in order (when `complete`)."""
    snapshot: TurnSnapshot | None
    """The last snapshot a turn carried (when `complete`), or none."""


class SealRequest(_Request, _Text):
    """POST /rollouts/seal: the producer seals its group now, with the group's scores if scored as a group."""

    group_id: str = Field(min_length=1, max_length=GROUP_ID_MAX)
    """The open group to seal."""
    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """The producer that opened it."""
    scores: dict[str, float] | None = None
    """Slot (as text) -> score, for every slot acknowledged; null: the scores posted with the rollouts."""


class SlotLeaseRequest(_Request, _Text):
    """POST /rollouts/lease: up to `n` missing slots of groups whose producer stopped heartbeating."""

    integer_fields = frozenset(["n"])

    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """Who takes the slots (and heartbeats them)."""
    n: int = Field(default=1, ge=1, le=SAFE_INT_MAX)
    """Most slots to take."""
    envs: list[Annotated[str, Field(max_length=ENV_NAME_MAX)]] | None = Field(default=None, max_length=ENVS_MAX)
    """Slots of groups of the envs registered under these names (`desired_name`) only: the envs the producer
    runs, so that it never takes a slot it cannot roll out. None: of any env."""


class SlotLease(_Wire):
    group_id: str
    """The group the slot belongs to."""
    slot: int
    """The missing slot to roll out."""
    env_id: int | None
    """The group's env."""
    group_size: int
    """The group's G."""
    task: Any
    """The group's task, as opened."""
    expires_at: float
    """Post the slot's rollout (or heartbeat the group) before."""
    prefix: SlotPrefix | None = None
    """The slot's turns acknowledged so far (POST /rollouts/turn): continue at turn `prefix.turns`, then post the
    rest with `after_turns`. None: no turn is in."""


class SlotLeaseReply(_Wire):
    leases: list[SlotLease]
    """The slots taken (none when no group is missing any)."""


class RolloutHeartbeat(_Request, _Text):
    """POST /rollouts/heartbeat: extend what this producer holds of these groups."""

    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """The producer that holds them."""
    group_ids: list[str] = Field(max_length=10_000)
    """The open groups it holds (or holds slots of)."""


class RolloutHeartbeatReply(_Wire):
    expires_at: dict[str, float | None]
    """Per group, the new end of what this producer holds of it; null where it holds nothing any more (sealed,
    expired, its slots leased to others): finish only what it already started, if anything."""


class SlotTurns(_Wire):
    n: int
    """Turns acknowledged."""
    producers: list[str]
    """Who posted them, each once, in the order they first posted."""


class TurnRun(_Wire):
    """Turns of a slot one producer generated in a row, and their tokens' range in the slot's rollout."""

    producer: str
    """Who posted them."""
    turns: int
    """How many."""
    start: int
    """Their first token's index in the rollout (its turns' tokens, in order)."""
    end: int
    """One past their last token's."""


class SlotLineage(_Wire):
    """Where a slot's rollout came from: its leases to other producers and its turns' producers."""

    resumes: int = 0
    """Leases that carried its acknowledged turns to another producer, which continued from them."""
    restarts: int = 0
    """Leases that carried no turn: another producer started it again from the prompt."""
    tokens_saved: int = 0
    """Tokens its resumes carried: generated once, not again."""
    turns: list[TurnRun] = Field(default_factory=list)
    """Its acknowledged turns by producer, in order (kept with the group once its turns are freed)."""


class GroupView(_Wire):
    group_id: str
    """The group's id."""
    env_id: int | None
    """Its env."""
    state: Literal["open", "sealing", "sealed", "expired"]
    """Open (slots arriving), sealing, sealed (queued whole) or expired."""
    group_size: int
    """G."""
    min_group_size: int
    """Sealed at the deadline with at least this many slots."""
    producer: str
    """The producer that opened it."""
    deadline: float
    """Unix time of its deadline."""
    expires_at: float
    """When its holder's (or the soonest sibling's) lease lapses unless heartbeated."""
    done: list[int] | None
    """Slots acknowledged; null in a post's reply (it costs a read of every slot in: GET /rollouts/group lists
    them), which says how many (`slots_done`)."""
    slots_done: int = 0
    """How many slots are acknowledged."""
    leased: dict[str, str] | None
    """Missing slots leased to siblings -> their producer; null in a post's reply, as `done`."""
    redispatched: int
    """Slots leased to siblings so far."""
    left_out: dict[str, str]
    """Sealed: slots not in it -> why. Expired: `group` -> why."""
    turns: dict[str, SlotTurns] | None = Field(default_factory=dict)
    """Slots with acknowledged turns (open groups: turns are freed with the decision) -> how many and who posted;
    null in a post's reply, as `done`."""
    lineage: dict[str, SlotLineage] | None = Field(default_factory=dict)
    """Slots resumed, restarted or with turns -> their lineage, in any state (a decided group keeps it); null in a
    post's reply, as `done`."""


class OpenGroupsStatus(_Wire):
    """Per-rollout groups at a glance (/status, the dashboard): present only once the run has opened one."""

    open: int
    """Groups open now (slots arriving, or their seal under way)."""
    slots_done: int
    """Rollouts acknowledged in the groups open now."""
    slots_leased: int
    """Missing slots of open groups leased to a sibling producer and not in yet (a lapsed lease counts until its
    slot is handed out again)."""
    redispatched: int
    """Slots handed to siblings so far (their holder stopped heartbeating)."""
    sealed: int
    """Groups sealed so far (queued whole, at their G-th rollout, their producer's seal or their deadline)."""
    expired: int
    """Groups expired so far (too few rollouts by their deadline, or refused at ingest: the ledger says why)."""
    resumed: int = 0
    """Slots handed to siblings with their acknowledged turns, continued from them (`redispatched` counts them)."""
    restarted: int = 0
    """Slots handed to siblings with no turn to continue from: started again from the prompt."""
    tokens_saved: int = 0
    """Tokens the resumed slots carried: not generated again."""


class PostReply(_Wire):
    status: Literal["accepted", "duplicate", "redone"]
    """`redone`: the slot was already acknowledged from another producer: the first is kept."""
    group: GroupView
    """The group as it stands after this rollout, without the lists that grow with its slots (`done`, `leased`,
    `turns`, `lineage`: null), so that a post at slot 4,000 costs what one at slot 1 does; GET /rollouts/group
    has them."""
