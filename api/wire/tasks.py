"""The task cursor's side of the wire (docs/tasks.md, rollbuf extensions): datasets registered, tasks leased,
heartbeated, given up, and their fates. Imports only pydantic and the wire's rules: clients import it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from api.wire.rules import PRODUCER_ID_MAX, SAFE_INT_MAX, _Request, _Text, _Wire

DATASET_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
TOKEN_MAX = 200
"""Longest lease token (a token is a group id: at most GROUP_ID_MAX)."""
REASON_MAX = 500
LEVEL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
MAX_LEVELS = 64
Weight = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]


class DatasetSpec(_Request, _Text):
    """POST /tasks/datasets: a dataset of tasks, handed out as leases."""

    integer_fields = frozenset(["epochs", "seed", "max_retries"])

    name: str = Field(pattern=DATASET_NAME)
    """Unique: a lease token names it."""
    env: str | None = Field(default=None, max_length=200)
    """The env it feeds (shown, not enforced)."""
    epochs: int | None = Field(default=1, ge=1, le=SAFE_INT_MAX)
    """Passes over the dataset; null: forever."""
    seed: int = Field(default=0, ge=0, le=SAFE_INT_MAX)
    """Fixes the shuffled orders."""
    order: Literal["sequential", "shuffled", "weighted"] = "sequential"
    """`shuffled`: a new order each epoch, fixed by (seed, epoch). `weighted`: a curriculum (`levels`): each
    position's level drawn by (seed, epoch, position) in proportion to the weights of the levels with tasks left,
    the task the next of its level's shuffled order; every task still once per epoch. Shuffled and weighted
    orders hand out nothing until the dataset is sealed (the order depends on the final size)."""
    levels: dict[Annotated[str, Field(pattern=LEVEL_NAME)], Weight] | None = Field(default=None, max_length=MAX_LEVELS)
    """Order `weighted` (and only it): each level's weight (> 0). Every task must name one of these levels."""
    level_key: str = Field(default="level", min_length=1, max_length=200)
    """Order `weighted`: the field of each task (a JSON object) that names its level (a string, or a number or
    boolean, matched by its JSON text)."""
    max_retries: int = Field(default=0, ge=0, le=1000)
    """Times a task whose group was dropped (stale, a filter) or that its producer failed is offered again; 0:
    counted and moved on."""
    path: str | None = Field(default=None, max_length=4096)
    """A file under the server's `task_files_dir` (unset: none is read), read a page at a time: JSONL (one task a
    line) or, named `*.parquet`, Parquet (one task a row, an object of its columns). A retry of a registration
    whose file was not read through goes on where it stopped."""
    tasks: list[Any] | None = None
    """The first page of tasks (any JSON values), instead of `path`; more with POST /tasks/pages."""
    last: bool = True
    """With `tasks`: no page follows (the dataset is sealed: the cursor may end an epoch)."""

    @model_validator(mode="after")
    def _levels_with_weighted(self) -> DatasetSpec:
        if (self.order == "weighted") != bool(self.levels):
            raise ValueError("levels are given with order weighted, and only with it")
        return self


class TaskPage(_Request):
    """POST /tasks/pages: the next page of a dataset's tasks."""

    integer_fields = frozenset(["first"])

    dataset: str = Field(pattern=DATASET_NAME)
    """The dataset's name."""
    first: int = Field(ge=0, le=SAFE_INT_MAX)
    """The index of its first task: the number stored so far (a page sent again is a no-op)."""
    tasks: list[Any]
    """Tasks (any JSON values), at most `task_page_size`."""
    last: bool = False
    """No page follows: the dataset is sealed."""


class LeaseRequest(_Request, _Text):
    """POST /tasks/lease: up to `n` tasks for this producer."""

    integer_fields = frozenset(["n"])

    dataset: str = Field(pattern=DATASET_NAME)
    """The dataset's name."""
    producer_id: str = Field(min_length=1, max_length=PRODUCER_ID_MAX)
    """Who holds the leases (its heartbeat id): `task_max_leases_per_producer` bounds what one holds."""
    n: int = Field(default=1, ge=1, le=SAFE_INT_MAX)
    """Most tasks wanted (at most `task_page_size` are given, and of those what fits `task_lease_max_bytes`)."""


class LeasedTask(_Wire):
    token: str
    """Send the task's group with this as its `group_id`: that is its submission (and it makes retries safe)."""
    epoch: int
    """The pass over the dataset it belongs to."""
    index: int
    """Its place in the dataset as registered."""
    task: Any
    """The task as registered."""
    expires_at: float
    """Wall-clock seconds: heartbeat before."""


class LeaseReply(_Wire):
    leases: list[LeasedTask]
    """The tasks leased (possibly none)."""
    done: bool
    """The dataset is finished: every epoch handed out and nothing leased, waiting or submitted. Without leases
    and not done: ask again later (the epoch's last tasks are out, or this producer holds its most)."""


class TaskTokens(_Request):
    """POST /tasks/heartbeat: extend these leases."""

    tokens: list[str] = Field(max_length=100_000)
    """Lease tokens, as leased."""


class TaskHeartbeatReply(_Wire):
    expires_at: dict[str, float | None]
    """Per token, the lease's new end, or null where it is lost (expired and handed out again, or the task
    already submitted): drop that task's work."""


class TaskFailure(_Request, _Text):
    """POST /tasks/fail: the producer ends a lease without a group."""

    token: str = Field(min_length=1, max_length=TOKEN_MAX)
    """The lease token."""
    reason: str | None = Field(default=None, max_length=REASON_MAX)
    """Why it failed (the retry policy applies); null: handed back untried, to the front (not a retry)."""


class TaskFailureReply(_Wire):
    accepted: bool
    """True: the lease ended as asked. False: the lease was already lost."""


class DatasetView(_Wire):
    """A dataset's cursor and tallies (GET /tasks, /status)."""

    name: str
    """As registered."""
    env: str | None
    """The env it feeds, as registered."""
    size: int
    """Tasks stored."""
    sealed: bool
    """Every page is stored."""
    epochs: int | None
    """As registered (null: forever)."""
    order: str
    """As registered."""
    levels: dict[str, float] | None = None
    """A weighted order's levels and weights, as registered."""
    level_sizes: dict[str, int] | None = None
    """A weighted order: tasks stored per level."""
    seed: int
    """As registered."""
    max_retries: int
    """As registered."""
    epoch: int
    """The cursor's epoch."""
    position: int
    """The cursor's next position in that epoch's order."""
    counts: dict[str, int]
    """Tasks per state (leased, waiting, submitted, served, trained, dropped, failed) and events (expired, retried,
    late). `served`: in a batch formed and not acknowledged yet (the trainer's next request or POST /commit)."""
    done: bool
    """Every epoch handed out, and nothing leased, waiting or submitted."""


class TaskView(_Wire):
    """One task of one epoch (GET /tasks/rows, the export's `tasks` table)."""

    dataset: str
    """Its dataset."""
    epoch: int
    """The pass it belongs to."""
    index: int
    """Its place in the dataset."""
    state: str
    """leased, waiting (at the front: its lease expired, or a retry), submitted, served (its batch is formed and not
    acknowledged yet), trained (acknowledged), dropped or failed."""
    leases: int
    """Times it was leased."""
    producer: str | None
    """The producer that leased it last."""
    expires_at: float | None
    """Leased: when the lease ends unless heartbeated."""
    retries: int
    """Times it was offered again after a drop or a failure."""
    ledger_id: int | None
    """Submitted and after: its group's ledger id (GET /ledger/groups/{token})."""
    step: int | None
    """Trained: the batch's step; dropped: the step formed next when it was dropped."""
    reason: str | None
    """Dropped or failed: why (retried: the last fate and why)."""
    updated_at: float
    """Wall-clock seconds of its last change."""


class TaskRows(_Wire):
    tasks: list[TaskView]
    """By (epoch, index)."""
    next: tuple[int, int] | None
    """(epoch, index) to pass as `after_epoch`, `after_index` for the next page; null at the end."""
