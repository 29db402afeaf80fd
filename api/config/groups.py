"""Every server setting, declared once, by concern: its name (the `ROLLBUF_*` variable and the `rollbuf serve`
flag), type, bound, default and meaning. `api.config.settings.Settings` is all of them together (flat, so that names
stay `--max-queue-tokens`, not `--queue.max-tokens`); each field of the service's config objects
(`QueueLimits`, `ReadAhead`, `LedgerSettings`, ...) names the setting it takes (`setting`), so that a `Service()`
built in process holds the server's defaults, and the server builds them from its settings (`built`);
docs/settings.md's tables are generated from here (`python -m api.config.doc`).

Pure pydantic, no other module of `api`: the config objects' modules import it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def shown(text: str) -> dict[str, Any]:
    """A default as docs/settings.md shows it, where the value alone would not say it (a computed default)."""
    return {"shown_default": text}


class Group(BaseModel):
    """One concern's settings; its docstring's first line is its heading in docs/settings.md."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")


class ServerSettings(Group):
    """The server process"""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """TCP port; Atropos clients expect 8000."""
    store: str = "sqlite:///rollbuf-data/rollbuf.db"
    """Where acknowledged data lives: `sqlite:///path.db` (durable, the default; relative to the working
    directory, `sqlite:////abs/path.db` for an absolute path), `memory://` (lost on exit) or
    `postgresql://user@host:port/dbname` (shared by replicas on many hosts, docs/stores.md)."""
    workers: int = Field(1, ge=1)
    """Server processes on one port sharing the store (SQLite or PostgreSQL; `memory://` is refused). One process
    uses about one core (Python's interpreter lock): more spread request parsing and batch encoding over cores,
    while the store orders the writes (docs/deployment.md)."""
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Server log level: critical, error, warning, info, debug (adds a line per request with its request id,
    docs/observability.md#logs) or trace (uvicorn's levels)."""
    log_format: Literal["text", "json"] = "text"
    """Server log lines: plain text with timestamps, or one JSON object per line."""
    metrics: bool = True
    """Serve Prometheus metrics at /metrics and time every request into them (docs/observability.md)."""
    metrics_max_envs: int = Field(100, ge=1)
    """Envs with their own series in /metrics and their own rows in /dashboard/data (the first registered); the
    rest are summed under `env="(other envs)"` (counters, gauges, the dashboard's queue rows) or left out (the
    drop-bias monitor's, flagged envs first), so that a scrape or a poll stays small with thousands of envs."""
    views_max_datasets: int = Field(100, ge=1)
    """Datasets listed one by one in /status and /dashboard/data (the first by name; `tasks_total` counts them all),
    with their own series in /metrics (the rest summed under `dataset="(other datasets)"`), and in one page of
    GET /tasks (`after` for the next), so that a view stays small however many datasets the keys registered."""
    views_max_producers: int = Field(100, ge=1)
    """Producers listed one by one in /status and /dashboard/data (live ones first; `producers_total` counts them
    all), with their own series in /metrics, and in one page of GET /producers (`after` for the next)."""
    wandb_interval: float = Field(5.0, gt=0)
    """Seconds between two W&B logs of the buffer's stats (only when wandb is installed and configured:
    `WANDB_API_KEY` or `WANDB_MODE` in the environment, docs/observability.md#weights--biases)."""
    gzip_level: int = Field(1, ge=1, le=9)
    """Compression level of gzip responses (1-9; JSON batches use ISA-L, capped at its 3); 1 is several times
    faster than Atropos's 9 at a slightly larger size."""
    shutdown_timeout: int = Field(5, gt=0)
    """Seconds a stopping server (SIGTERM) waits for requests in flight, long-polls included, before it cancels
    them (their clients retry): inside a container runtime's stop grace period (10 s), so a stop is clean
    instead of a kill."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class KeySettings(Group):
    """Keys and who may call"""

    api_key: SecretStr | None = None
    """An admin key (`Authorization: Bearer <key>`, else 401), named "admin", required on every endpoint but the
    health checks (`GET /`, `/healthz`, `/readyz`), the dashboard page `/dashboard` (its data needs a key) and
    the API's description (`/docs`, `/redoc`, `/openapi.json`). With it or `api_keys`, the OpenAPI description
    declares the bearer scheme. At least 16 characters on a non-loopback `host`. None and no `api_keys`: no
    auth (Atropos's model). Keys with roles: `api_keys`, docs/security.md."""
    api_keys: SecretStr | None = None
    """Keys with roles, `name role secret` each, separated by newlines or `;`; `#` starts a comment at a line's
    start or after whitespace only. Set but holding no key: an error on a non-loopback `host`, a warning on
    loopback (the server is keyed and refuses every request needing a key) (docs/security.md)."""
    api_keys_file: Path | None = None
    """A file of keys as in `api_keys` (at most 1 MiB), watched: a change is used, without a restart or a request,
    once the file has stayed the same for `api_keys_file_settle` (within a second of the last write by default;
    rotate a key by writing a new file and renaming it over this one); gone or broken, the last good keys stay and
    the log, `/readyz` and `rollbuf_key_file_stale` say so."""
    api_keys_file_settle: float = Field(0.5, ge=0, le=60)
    """Seconds `api_keys_file` must stay the same after a change before its keys are used, so that a file caught
    half written (an editor's save, a script writing it line by line) is not: the file is looked at every 0.25 s,
    and a change is used within this + 0.5 s of the last write. 0: at the next look (for a file only ever
    replaced by a rename)."""
    allowed_hosts: list[str] | None = Field(
        None, json_schema_extra=shown("loopback names on a keyless loopback server, any otherwise")
    )
    """`Host` names the server answers to (a JSON list: `'["rollbuf.internal", "*.svc.cluster.local"]'`;
    `loopback`, `*` for any); 421 for others. Default: loopback names only on a keyless loopback server (no DNS
    rebinding), any otherwise."""
    allow_simple_content_types: bool = False
    """Accept JSON bodies sent as `text/plain` or forms (what a web page may send cross-site without asking);
    415 otherwise."""
    allow_unauthenticated: bool = False
    """Listen on a non-loopback interface without keys (anyone who can reach the port can reset the run)."""


class QueueSettings(Group):
    """Queue limits and side buffers"""

    max_queue_groups: int | None = Field(None, gt=0)
    """Most groups queued over all envs; beyond it submissions get 503 + Retry-After. None: no limit."""
    max_queue_tokens: int | None = Field(2**28, gt=0, json_schema_extra=shown("268435456 (2^28)"))
    """Most tokens queued over all envs (~3 GB of payload, dozens of large batches): a trainer that falls behind
    meets backpressure instead of a server that runs out of memory or disk."""
    max_queue_bytes: int | None = Field(4 * GiB, gt=0)
    """Most bytes queued over all envs, as stored: token ids, masks, per-token floats and the metadata
    (`images`, `messages`, `overrides`, ...) that `max_queue_tokens` does not see. Values kept as blobs count as
    their references here, and against `max_blob_bytes` (docs/payloads.md)."""
    max_env_queue_groups: int | None = Field(None, gt=0)
    """Most groups queued for one env (503 beyond)."""
    max_env_queue_tokens: int | None = Field(None, gt=0)
    """Most tokens queued for one env (503 beyond)."""
    max_env_queue_bytes: int | None = Field(None, gt=0)
    """Most bytes queued for one env (503 beyond)."""
    max_group_seqs: int = Field(4096, gt=0)
    """Most sequences in one group (422 beyond)."""
    retry_after: float = Field(2.0, gt=0)
    """Seconds a client is told to wait (Retry-After) when the queue is full."""
    side_buffer_max_groups: int | None = Field(256, gt=0)
    """Most groups one env's side buffer holds (groups of another size than its `group_size`, waiting until they
    add up to it); a group past it gets 503 + Retry-After. What side buffers hold also counts against the queue
    limits."""
    side_buffer_max_bytes: int | None = Field(256 * MiB, gt=0)
    """Most bytes one env's side buffer holds, as stored (503 beyond)."""
    side_buffer_ttl_s: float | None = Field(1800.0, gt=0)
    """Seconds a group waits in a side buffer before it is dropped and counted as `side_buffer_expired`
    (`/status`'s `dropped`, `rollbuf_groups_dropped_total`): held sizes that never add up (an env that loses
    one rollout of every group) are not held for ever."""


class BatchSettings(Group):
    """Forming and serving batches"""

    max_read_ahead_batches: int = Field(8, ge=1)
    """With `acknowledge: "commit"`: batches served and not committed past which `/batch` forms no more (a
    long-poll waits for a commit, then 503 `read_ahead_full` + Retry-After), so a trainer that never commits
    cannot hold the whole run."""
    max_read_ahead_bytes: int | None = Field(4 * GiB, gt=0)
    """With `acknowledge: "commit"`: bytes of served, uncommitted batches past which no further batch is formed
    (one always is: the bound is checked before forming)."""
    formation_look_ahead_groups: int = Field(256, ge=1)
    """When the oldest groups (a batch's worth) hold no exact fill, formation reads each env's queue further, up
    to this many groups, and takes the oldest exact fill there (docs/batching.md#beyond-the-window): its cost is
    bounded by this, not by the queue's depth."""
    formation_look_ahead_sequences: int = Field(8192, ge=1)
    """The same read's bound in sequences, per env."""
    formation_due_after: int = Field(4, ge=1)
    """Batches an env's oldest group may be passed over (newer groups of its env taken) before a batch must hold
    it: exactly if some choice can, else as the trainer's `no_exact_fill` says (docs/batching.md)."""
    quiet_share_seconds: float = Field(30.0, ge=0)
    """How long an env's `min_batch_allocation` may hold batches back while it queues too little; past it, its
    minimum stops holding them (counted, logged once, `/status`'s `min_share_releases`) until it queues its
    share again."""
    formation_arrival_wait_seconds: float = Field(30.0, ge=0)
    """Exact mode: how long formation waits, with no group arriving, for arrivals that could complete an exact
    fill of the queued sizes (6s and 8s towards 64) while less than two batches' worth is queued; past it, the
    trainer's `no_exact_fill` applies (under "smaller", a smaller batch), so a run whose producers stop still
    trains what is queued (docs/batching.md)."""
    max_batch_wait: float = Field(60.0, ge=0)
    """Longest `GET /batch?wait=` a trainer may ask for, in seconds."""
    max_world_size: int = Field(4096, ge=1)
    """Largest `world_size` of `GET /batch` (422 beyond): ranks cost memory and time when a batch is split."""


class LedgerRetention(Group):
    """The ledger and retention"""

    ledger: bool = True
    """Write the ledger: every acknowledged group's fate and every formed batch's contents (docs/ledger.md),
    in the transaction that decides them."""
    ledger_max_groups: int | None = Field(1_000_000, gt=0)
    """Ledger rows of groups kept: rows of groups acknowledged before the last this many are pruned in the
    background once served or dropped. None: all (the ledger grows with the run)."""
    ledger_max_steps: int | None = Field(100_000, gt=0)
    """Ledger rows of formed batches kept: those of the last this many steps. None: all."""
    retain_steps: int | None = Field(None, ge=0)
    """Keep served and dropped groups' payloads (readable at `/ledger/...`) for this many steps after their fate.
    With `retain_bytes` unset too: none are kept (the default: retaining costs a payload write per dropped
    group, docs/ledger.md)."""
    retain_bytes: int | None = Field(None, ge=0)
    """Keep served and dropped groups' payloads while they hold at most this many bytes (the oldest go first)."""


class BlobSettings(Group):
    """Large payloads (the blob tier)"""

    blobs: bool = True
    """Keep large `images` and `distill_*` values as blobs named by their content, outside the row store, each
    stored once per key however many sequences or groups send it (docs/payloads.md). On by default beside a
    SQLite store; a `memory://` or PostgreSQL store needs `blob_dir` too."""
    blob_dir: Path | None = Field(None, json_schema_extra=shown("`<sqlite file>.blobs/` beside a SQLite store"))
    """Directory of the blob tier's files. None: beside a SQLite store's file; no blob tier on other stores."""
    blob_min_bytes: int = Field(64 * KiB, ge=64)
    """A blob field's value (or, for a list, one of its entries) of at least this many bytes, as stored, is kept as
    a blob; smaller ones stay in the row."""
    max_blob_bytes: int = Field(64 * GiB, gt=0)
    """Most bytes the blob tier holds over all keys; a submission that would write more gets 503 + Retry-After."""
    max_blob_bytes_per_key: int | None = Field(None, gt=0, json_schema_extra=shown("half of `max_blob_bytes`"))
    """Most blob bytes one API key (by name) holds (503 + Retry-After beyond), so that one key cannot take the
    tier. None: half of `max_blob_bytes`."""
    blob_grace_s: float = Field(600.0, gt=0)
    """Seconds a blob that nothing refers to is kept after it was last written or sent again: a group's blobs are
    written before its transaction, so this must exceed the longest time from a request's blob writes to its
    commit (a request whose transaction starts past half of it is refused with 503, to be sent again)."""
    blob_sweep_s: float = Field(60.0, gt=0)
    """Seconds between two collections of the blobs nothing refers to (each reads the stored payloads that hold
    references)."""
    blob_shared_across_keys: bool = False
    """Store the same bytes once for all keys, not once per key: saves space where keys send the same media, but
    lets a key learn (by timing, or by a digest it reads) that another key stored those bytes."""


class ProducerLimits(Group):
    """Producers"""

    producer_gone_after: float = Field(30.0, gt=0)
    """Seconds without a heartbeat (`POST /producers/heartbeat`) after which a producer counts as gone
    (`/status`, `/metrics`, and a waiting trainer's `stall_reason`); producers beat every sixth of it, as the
    heartbeat's reply tells them."""
    max_producers: int = Field(1024, ge=1)
    """Producers the server keeps track of; a new one forgets the longest-gone, and with every one live it is
    refused (503) until one goes."""
    max_producers_per_key: int = Field(256, ge=1)
    """Of `max_producers`, those one key heartbeats under (on a server with keys): a key's new producer forgets
    that key's longest-gone one, and with every one of them live it is refused (503) until one goes, so that one
    key's producers leave room for the others'."""


class TaskLeases(Group):
    """Tasks leased to producers (docs/tasks.md)"""

    task_lease_s: float = Field(300.0, gt=0)
    """Seconds a task lease lasts unless heartbeated: an expired lease puts its task back at the front of its
    dataset."""
    task_max_leases_per_producer: int = Field(1024, gt=0)
    """Task leases one producer holds at once: past it, a lease request gets fewer (or none)."""
    task_page_size: int = Field(1000, gt=0)
    """Most tasks in one page posted, one lease request and one page of /tasks/rows (422 beyond)."""
    task_max_dataset_size: int = Field(100_000_000, gt=0)
    """Most tasks in one dataset (422 beyond)."""
    task_files_dir: Path | None = None
    """The one directory the server may read datasets from (`path` of POST /tasks/datasets: JSONL, one task a
    line, or Parquet with the export extra); a path that resolves outside it (`..`, a symbolic link, an absolute
    path) is refused. None (the default): no file is read, datasets come only in pages posted by producers."""
    task_max_bytes: int = Field(1 * MiB, gt=0)
    """Most bytes of one task as stored (JSON text: a line of a dataset file, a row of Parquet, a posted task):
    422 beyond, so that a file without line breaks is never read whole."""
    task_max_datasets_per_key: int = Field(256, gt=0)
    """Datasets one key registers (keyless: the server's): 409 beyond. Datasets are kept until the run is reset, so
    that their tasks' fates stay readable."""
    task_max_bytes_per_key: int = Field(8 * GiB, gt=0)
    """Bytes of tasks the datasets of one key store (keyless: the server's), counted as JSON text plus 64 bytes a
    task (its row): 409 for a page or a file that would pass it, whatever the datasets' names."""
    task_lease_max_bytes: int = Field(16 * MiB, gt=0)
    """Bytes of task data in one lease reply: a request gets the tasks that fit (one at least, however large),
    the rest stay for the next, so that a reply's memory is bounded by bytes rather than by the count."""


class RolloutGroups(Group):
    """Groups whose rollouts arrive one by one (docs/rollouts.md)"""

    rollout_lease_s: float = Field(60.0, gt=0)
    """Seconds a producer holds an open group's missing slots (and a sibling a slot it leased) unless it
    heartbeats: then the missing slots are leased to other producers."""
    rollout_max_deadline_s: float = Field(24 * 3600.0, gt=0)
    """Longest deadline an open group may ask for (422 beyond)."""
    rollout_max_open_groups: int = Field(10_000, gt=0)
    """Open groups per env (a 503 to open more beyond, counted)."""
    rollout_max_open_groups_per_key: int = Field(10_000, gt=0)
    """Open groups one key holds over all its envs and none (on a server with keys; a 503 to open more beyond), so
    that one key's groups leave room for the others'; its groups without an env count against this instead of
    against `rollout_max_open_groups`."""
    rollout_max_open_bytes: int = Field(1024 * MiB, gt=0)
    """Bytes of acknowledged rollouts in an env's open groups (a 503 to post more beyond, counted)."""
    rollout_sweep_limit: int = Field(64, gt=0)
    """Most open groups sealed, expired or leased out by one request or sweep."""
    rollout_sweep_every_s: float = Field(1.0, gt=0)
    """Seconds between two background sweeps of each server process, once it has seen per-rollout groups in use:
    open groups past their deadline are sealed with what is in (or expired) without any producer calling. A sweep
    that decided on `rollout_sweep_limit` groups runs again at once."""
    rollout_keep_s: float = Field(3600.0, gt=0)
    """Seconds a sealed or expired group's row and its acknowledged rollouts stay in the store after its decision
    (the views' group pages, the export's `rollouts` table, a late sibling's `redone`); then the background sweep
    deletes them, at most `rollout_sweep_limit` groups a sweep, so that what the server keeps of per-rollout groups
    is bounded by what is decided in this time. A rollout posted to a pruned group is a 404."""
    rollout_max_turn_bytes: int = Field(4 * MiB, gt=0)
    """Bytes of one turn of a rollout (POST /rollouts/turn: its tokens, masks, logprobs, versions, tool results and
    snapshot, as stored): 422 beyond."""
    rollout_max_snapshot_bytes: int = Field(1 * MiB, gt=0)
    """Bytes of the env state a turn carries inline (`snapshot.data`, decoded): 422 beyond; a larger state goes by
    reference (`snapshot.uri`)."""
    rollout_max_turns_per_slot: int = Field(1024, gt=0)
    """Turns one slot acknowledges before its final post: 409 beyond."""
    rollout_max_turn_bytes_per_env: int = Field(1024 * MiB, gt=0)
    """Bytes of acknowledged turns held by an env's open groups (a 503 to post more beyond): turns are freed with
    their group's decision."""
    rollout_max_turn_bytes_per_key: int = Field(1024 * MiB, gt=0)
    """Bytes of acknowledged turns held by one key's open groups over all its envs (on a server with keys; a 503
    beyond), so that one key's turns leave room for the others'."""
    rollout_max_prefix_reply_bytes: int = Field(16 * MiB, gt=0)
    """Bytes of turns one slot lease carries in a lease reply: a slot whose turns hold more is leased with its
    prefix left out (`prefix.complete` false), read whole from GET /rollouts/turns."""


class DropBiasSettings(Group):
    """The drop-bias monitor"""

    drop_bias_starve_steps: int = Field(10, ge=1)
    """The drop-bias monitor calls an env starved when its share of each of this many consecutive batches was
    below its floor: its minimum share, or half its weight's share if that is more
    (docs/ledger.md#drop-bias-monitor)."""
    drop_bias_length_skew: float = Field(0.2, gt=0)
    """Relative difference of mean tokens per sequence, unintentionally dropped groups (stale, expired) against
    trained ones, past which the drop-bias monitor warns of a length skew."""
    drop_bias_reward_skew: float = Field(0.5, gt=0)
    """Difference of mean rewards, dropped against trained, in pooled standard deviations, past which the
    drop-bias monitor warns of a reward skew."""


class RequestLimits(Group):
    """Requests and connections"""

    max_body_bytes: int = Field(256 * MiB, gt=0)
    """Largest request body as sent (413 beyond)."""
    max_decompressed_bytes: int = Field(256 * MiB, gt=0)
    """Largest gzip request body once inflated (413 beyond): inflating streams and stops there, so a gzip bomb
    costs at most this much memory per body being inflated (at most one per core at once). The default holds
    lists of dozens of groups of 8 x 4k tokens as JSON."""
    max_inflight_bytes: int = Field(1 * GiB, gt=0)
    """Bytes of request bodies (as received and as inflated) one server process holds at once, over all
    requests; a request that would pass it gets 503 + Retry-After (`code: busy`). Bytes are counted as they
    arrive; a declared Content-Length reserves at most `body_reserve_bytes` before they do; a submission is then
    charged what decoding it costs (JSON: 32 bytes per value more; msgpack: 3.3x), so that this bounds memory
    within about 1.3x (docs/security.md). At least `max_body_bytes` + `max_decompressed_bytes`, so that any one
    valid request fits (one whose decoding costs more runs when it is the only one held)."""
    max_inflight_bytes_per_client: int | None = Field(
        None,
        gt=0,
        json_schema_extra=shown("half of `max_inflight_bytes`, at least `max_body_bytes` + `max_decompressed_bytes`"),
    )
    """Of `max_inflight_bytes`, the most one API key (by name), or on a keyless server one client address, holds
    at once (503 `busy` beyond), so that one holder's slow or many uploads cannot take it all. None: half of
    `max_inflight_bytes`, and at least `max_body_bytes` + `max_decompressed_bytes`."""
    body_reserve_bytes: int = Field(16 * MiB, gt=0)
    """Most bytes a request's declared Content-Length takes from the budgets before they arrive (a body that
    cannot fit is refused early); the rest is counted as it arrives, so a client that declares 256 MiB and
    sends a byte now and then holds what it sent and this much."""
    max_header_bytes: int = Field(64 * KiB, ge=4096)
    """Largest request head (request line and headers); 431 beyond, before it is read whole."""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds a request head may take to arrive, from the connection or its first byte (408 beyond)."""
    body_timeout: float = Field(30.0, gt=0)
    """Seconds a request body may pause between two chunks before the connection is closed."""
    min_body_rate: int = Field(1 * MiB, gt=0, json_schema_extra=shown("1 MiB/s"))
    """Bytes per second a request body must average: it must have arrived within `body_timeout` plus its bytes
    so far over this rate (408 and closed beyond), so a body sent a byte at a time ends within `body_timeout`,
    and 256 MiB may take about 4.8 minutes."""
    keepalive_timeout: int = Field(5, gt=0)
    """Seconds an idle keep-alive connection is held open."""
    max_connections: int = Field(1000, ge=16)
    """Connections held at once, whatever their state (lowered to the process's descriptor limit less 64); past
    it the connection idle longest is closed to make room, else the one sending its request slowest (a request
    waiting for its answer, a long-poll, never)."""
    max_exports: int = Field(2, ge=1)
    """`GET /export` streams this server process sends at once (503 + Retry-After beyond): each holds a page of
    the ledger and one Parquet row group (at most 32 MiB of arrays) while it runs (docs/ledger.md#export)."""

    @model_validator(mode="after")
    def _one_request_fits(self) -> RequestLimits:
        one_request = self.max_body_bytes + self.max_decompressed_bytes
        if self.max_inflight_bytes < one_request:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) is below max_body_bytes + max_decompressed_bytes "
                f"({one_request}): a valid gzip request could never be read"
            )
        per_client = self.max_inflight_bytes_per_client
        if per_client is not None and per_client < one_request:
            raise ValueError(
                f"max_inflight_bytes_per_client ({per_client}) is below max_body_bytes + max_decompressed_bytes "
                f"({one_request}): a valid gzip request could never be read"
            )
        return self


GROUPS: tuple[type[Group], ...] = (
    ServerSettings,
    KeySettings,
    QueueSettings,
    BatchSettings,
    LedgerRetention,
    BlobSettings,
    ProducerLimits,
    TaskLeases,
    RolloutGroups,
    DropBiasSettings,
    RequestLimits,
)
"""Every concern, in the order docs/settings.md and `rollbuf serve --help` list them."""

SERVER = ServerSettings()
REQUESTS = RequestLimits()
DEFAULTS: dict[str, Any] = {name: info.default for group in GROUPS for name, info in group.model_fields.items()}

# The service's config objects (frozen dataclasses: `QueueLimits`, `ReadAhead`, ...) name the setting each field
# takes, once: its default is the setting's, and `built` fills it from the server's settings.

T = TypeVar("T")
_SETTING = "setting"
_PART = "part"


def setting(name: str) -> Any:
    """A config object's field that takes the setting `name` (its default: the setting's)."""
    return dataclasses.field(default=DEFAULTS[name], metadata={_SETTING: name})


def part(cls: type[Any]) -> Any:
    """A config object's field holding another one, built from the same settings."""
    return dataclasses.field(default_factory=cls, metadata={_PART: cls})


def built(cls: type[T], settings: BaseModel) -> T:
    """A config object with each field that names a setting taken from `settings`, each part built alike, and
    its other fields (constants, not settings) left at their defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if _SETTING in f.metadata:
            values[f.name] = getattr(settings, f.metadata[_SETTING])
        elif _PART in f.metadata:
            values[f.name] = built(f.metadata[_PART], settings)
    return cls(**values)
