"""The one settings object. Sources, highest first: command-line flags, `ROLLBUF_*` environment variables,
defaults (docs/settings.md)."""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.access import MIN_SECRET, Key
from api.keyring import KeyFile, NoKey, describe, fixed_keys, parse_key_file, read_bounded
from api.store import redacted

log = logging.getLogger("rollbuf")

MiB = 1024 * 1024
SHARED_STORES = ("sqlite:///", "postgresql://", "postgres://")
"""Store URLs that several server processes can share."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ROLLBUF_",
        use_attribute_docstrings=True,
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        env_parse_none_str="null",
    )

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """TCP port; Atropos clients expect 8000."""
    store: str = "sqlite:///rollbuf-data/rollbuf.db"
    """Where acknowledged data lives: `sqlite:///path.db` (durable, the default), `memory://` (lost on exit) or
    `postgresql://user@host:port/dbname` (shared by replicas on many hosts, docs/stores.md)."""
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Server log level: critical, error, warning, info, debug (adds a line per request with its id) or trace."""
    log_format: Literal["text", "json"] = "text"
    """Server log lines: plain text with timestamps, or one JSON object per line."""
    metrics: bool = True
    """Serve Prometheus metrics at /metrics and time every request into them."""
    metrics_max_envs: int = Field(100, ge=1)
    """Envs with their own series in /metrics (the first registered); the rest are summed under
    `env="(other envs)"` (counters and gauges) or left out (the drop-bias monitor's, flagged envs first), so
    that a scrape stays small with thousands of envs."""
    wandb_interval: float = Field(5.0, gt=0)
    """Seconds between two W&B logs of the buffer's stats (only when wandb is installed and configured: an
    API key or WANDB_MODE in the environment)."""
    workers: int = Field(1, ge=1)
    """Server processes sharing one port and the store (SQLite or PostgreSQL): parsing and encoding spread over
    cores."""

    api_key: SecretStr | None = None
    """An admin key (`Authorization: Bearer <key>`), named "admin"; with it or `api_keys`, every request but the
    public ones needs a key. None and no `api_keys`: no auth (Atropos's model)."""
    api_keys: SecretStr | None = None
    """Keys with roles, `name role secret` each, separated by newlines or `;` (docs/security.md)."""
    api_keys_file: Path | None = None
    """A file of keys as in `api_keys`, read again when it changes: rotate a key by rewriting the file."""
    allowed_hosts: list[str] | None = None
    """`Host` names the server answers to (`*.example.com`, `loopback`, `*` for any). Default: loopback names
    only on a keyless loopback server (no DNS rebinding), any otherwise."""
    allow_simple_content_types: bool = False
    """Accept JSON bodies sent as `text/plain` or forms (what a web page may send cross-site without asking)."""
    allow_unauthenticated: bool = False
    """Listen on a non-loopback interface without `api_key` (anyone who can reach the port can reset the run)."""

    max_queue_groups: int | None = Field(None, gt=0)
    """Most groups queued over all envs; beyond it submissions get 503 + Retry-After. None: no limit."""
    max_queue_tokens: int | None = Field(2**28, gt=0)
    """Most tokens queued over all envs (default 2^28: ~3 GB of payload, dozens of large batches). A trainer
    that falls behind gets backpressure instead of a server that runs out of memory or disk."""
    max_queue_bytes: int | None = Field(4096 * MiB, gt=0)
    """Most bytes queued over all envs, as stored: tokens and per-token values, and the metadata (`images`,
    `messages`, ...) that `max_queue_tokens` does not see (default 4 GiB)."""
    max_env_queue_groups: int | None = Field(None, gt=0)
    """Most groups queued for one env."""
    max_env_queue_tokens: int | None = Field(None, gt=0)
    """Most tokens queued for one env."""
    max_env_queue_bytes: int | None = Field(None, gt=0)
    """Most bytes queued for one env."""
    max_group_seqs: int = Field(4096, gt=0)
    """Most sequences in one group."""
    side_buffer_max_groups: int | None = Field(256, gt=0)
    """Most groups one env's side buffer holds (groups of another size than its `group_size`, waiting until they
    add up to it); a group past it gets 503 + Retry-After. What side buffers hold also counts against the queue
    limits."""
    side_buffer_max_bytes: int | None = Field(256 * MiB, gt=0)
    """Most bytes one env's side buffer holds, as stored."""
    side_buffer_ttl_s: float | None = Field(1800.0, gt=0)
    """Seconds a group waits in a side buffer before it is dropped and counted (`side_buffer_expired`): held
    sizes that never add up (an env that loses one rollout of every group) are not held for ever."""
    ledger: bool = True
    """Write the ledger: every acknowledged group's fate and every formed batch's contents (docs/ledger.md),
    in the transaction that decides them."""
    ledger_max_groups: int | None = Field(1_000_000, gt=0)
    """Ledger rows of groups kept: rows of groups acknowledged before the last this many are pruned in the
    background once served or dropped. None: all (the ledger grows with the run)."""
    ledger_max_steps: int | None = Field(100_000, gt=0)
    """Ledger rows of formed batches kept: those of the last this many steps. None: all."""
    retain_steps: int | None = Field(None, ge=0)
    """Keep served and dropped groups' payloads (readable at /ledger) for this many steps after their fate.
    With `retain_bytes` unset too: none are kept (the default: retaining costs a write per dropped group)."""
    retain_bytes: int | None = Field(None, ge=0)
    """Keep served and dropped groups' payloads while they hold at most this many bytes (the oldest go first)."""
    retry_after: float = Field(2.0, gt=0)
    """Seconds a client is told to wait (Retry-After) when the queue is full."""
    task_lease_s: float = Field(300.0, gt=0)
    """Seconds a task lease lasts unless heartbeated (docs/tasks.md): an expired lease puts its task back at the
    front of its dataset."""
    task_max_leases_per_producer: int = Field(1024, gt=0)
    """Task leases one producer holds at once: past it, a lease request gets fewer (or none)."""
    task_page_size: int = Field(1000, gt=0)
    """Most tasks in one page posted, one lease request and one page of /tasks/rows (422 beyond)."""
    task_max_dataset_size: int = Field(100_000_000, gt=0)
    """Most tasks in one dataset (422 beyond)."""
    task_files_dir: Path | None = None
    """Where the server may read datasets from (`path` of POST /tasks/datasets, JSONL, one task a line); None:
    datasets come only in pages posted by producers."""

    max_body_bytes: int = Field(256 * MiB, gt=0)
    """Largest request body as sent (413 beyond)."""
    max_decompressed_bytes: int = Field(256 * MiB, gt=0)
    """Largest gzip request body once inflated (413 beyond): inflating stops there, so a gzip bomb costs at
    most this much memory (times the cores, for bombs sent at once). The default holds lists of dozens of
    groups of 8 x 4k tokens as JSON."""
    max_inflight_bytes: int = Field(1024 * MiB, gt=0)
    """Bytes of request bodies (as received and as inflated) one server process holds at once, over all
    requests; a request that would pass it gets 503 + Retry-After. At least `max_body_bytes` +
    `max_decompressed_bytes`, so that any one valid request fits."""
    max_inflight_bytes_per_client: int | None = Field(None, gt=0)
    """Of `max_inflight_bytes`, the most one API key (by name), or on a keyless server one client address, holds
    at once (503 + Retry-After beyond), so that one holder's slow or many uploads cannot take it all. None: half
    of `max_inflight_bytes`, and at least `max_body_bytes` + `max_decompressed_bytes`."""
    body_reserve_bytes: int = Field(16 * MiB, gt=0)
    """Most bytes a request's declared Content-Length takes from the budgets before they arrive (a body that
    cannot fit is refused early); the rest is counted as it arrives, so a client that declares 256 MiB and
    sends a byte now and then holds what it sent and this much."""
    gzip_level: int = Field(1, ge=1, le=9)
    """Compression level of gzip responses (1-9; JSON batches use ISA-L, capped at its 3); 1 is several times
    faster than Atropos's 9 at a slightly larger size."""
    max_read_ahead_batches: int = Field(8, ge=1)
    """With `acknowledge: "commit"`: batches served and not committed past which `/batch` answers 503 +
    Retry-After (code `read_ahead_full`) instead of forming another, so a trainer that never commits cannot
    hold the whole run."""
    max_read_ahead_bytes: int | None = Field(4096 * MiB, gt=0)
    """With `acknowledge: "commit"`: bytes of served, uncommitted batches past which no further batch is formed
    (one always is: the bound is checked before forming)."""
    formation_look_ahead_groups: int = Field(256, ge=1)
    """When the oldest groups (a batch's worth) hold no exact fill, formation reads each env's queue further, up to
    this many groups: a batch forms whenever a choice among them adds up (its cost is bounded by this, not by the
    queue's depth)."""
    formation_look_ahead_sequences: int = Field(8192, ge=1)
    """The same read's bound in sequences, per env."""
    formation_due_after: int = Field(4, ge=1)
    """Batches an env's oldest group may be passed over (newer groups of its env taken) before a batch must hold
    it: exactly if some choice can, else as the trainer's `no_exact_fill` says (docs/batching.md)."""
    quiet_share_seconds: float = Field(30.0, ge=0)
    """How long an env's `min_batch_allocation` may hold batches back while it queues too little; past it, its
    minimum stops holding them (counted, logged once) until it queues its share again."""
    max_batch_wait: float = Field(60.0, ge=0)
    """Longest `GET /batch?wait=` a trainer may ask for, in seconds."""
    producer_gone_after: float = Field(30.0, gt=0)
    """Seconds without a heartbeat after which a producer counts as gone (/status, /metrics, and a waiting
    trainer's `stall_reason`); producers beat every `producer_gone_after / 6` s, as the heartbeat reply tells them."""
    max_producers: int = Field(1024, ge=1)
    """Producers the server keeps track of; a new one forgets the longest-gone, and with every one live it is
    refused (503) until one goes."""
    max_world_size: int = Field(4096, ge=1)
    """Largest `world_size` of `GET /batch` (422 beyond): ranks cost memory and time when a batch is split."""
    max_header_bytes: int = Field(64 * 1024, ge=4096)
    """Largest request head (request line and headers); 431 beyond, before it is read whole."""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds a request head may take to arrive, from the connection or its first byte (408 beyond)."""
    body_timeout: float = Field(30.0, gt=0)
    """Seconds a request body may pause between two chunks before the connection is closed."""
    min_body_rate: int = Field(1 * MiB, gt=0)
    """Bytes per second a request body must average: it must have arrived within `body_timeout` plus its bytes
    so far over this rate (408 and closed beyond), so a body sent a byte at a time ends within `body_timeout`,
    and 256 MiB may take about 4.8 minutes."""
    keepalive_timeout: int = Field(5, gt=0)
    """Seconds an idle keep-alive connection is held open."""
    max_connections: int = Field(1000, ge=16)
    """Connections held at once (lowered to what the process's descriptor limit leaves); past it the
    connection idle longest is closed to make room."""
    max_exports: int = Field(2, ge=1)
    """`GET /export` streams this server process sends at once (503 + Retry-After beyond): each holds a page of the
    ledger and one Parquet row group (at most `api.export.table.ROW_GROUP_BYTES` of arrays) while it runs."""
    drop_bias_starve_steps: int = Field(10, ge=1)
    """The drop-bias monitor calls an env starved when its share of each of this many consecutive batches was
    below its minimum share (docs/ledger.md, "Drop-bias monitor")."""
    drop_bias_length_skew: float = Field(0.2, gt=0)
    """Relative difference of mean tokens per sequence, unintentionally dropped groups against trained ones, past
    which the drop-bias monitor warns of a length skew."""
    drop_bias_reward_skew: float = Field(0.5, gt=0)
    """Difference of mean rewards, dropped against trained, in pooled standard deviations, past which the
    drop-bias monitor warns of a reward skew."""
    shutdown_timeout: int = Field(5, gt=0)
    """Seconds a stopping server (SIGTERM) waits for requests in flight, long-polls included, before it cancels
    them (their clients retry): inside a container runtime's stop grace period (10 s), so a stop is clean
    instead of a kill."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _safe(self) -> Settings:
        if not self.store.startswith(SHARED_STORES + ("memory://",)):
            raise ValueError(
                f"store {redacted(self.store)!r}: use memory://, sqlite:///path.db or postgresql://host/dbname"
            )
        if self.workers > 1 and not self.store.startswith(SHARED_STORES):
            raise ValueError(
                f"workers={self.workers} needs a store the processes share: sqlite:///path.db or postgresql://, "
                f"not {redacted(self.store)}"
            )
        if self.max_inflight_bytes < self.max_body_bytes + self.max_decompressed_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) is below max_body_bytes + max_decompressed_bytes "
                f"({self.max_body_bytes + self.max_decompressed_bytes}): a valid gzip request could never be read"
            )
        per_client = self.max_inflight_bytes_per_client
        if per_client is not None and per_client < self.max_body_bytes + self.max_decompressed_bytes:
            raise ValueError(
                f"max_inflight_bytes_per_client ({per_client}) is below max_body_bytes + max_decompressed_bytes "
                f"({self.max_body_bytes + self.max_decompressed_bytes}): a valid gzip request could never be read"
            )
        keyed = self.api_key is not None or self.api_keys is not None or self.api_keys_file is not None
        short = self.api_key is not None and len(self.api_key.get_secret_value()) < MIN_SECRET
        if short and not _is_loopback(self.host):
            raise ValueError(
                f"api_key is shorter than {MIN_SECRET} characters on {self.host}, reachable from other machines: "
                "a key that can be guessed is no key"
            )
        fixed, _ = _fixed(self)
        if self.api_keys_file is not None:
            try:
                parse_key_file(self.api_keys_file, read_bounded(self.api_keys_file), fixed)
            except NoKey:
                if not _is_loopback(self.host):
                    raise ValueError(
                        f"api_keys_file {self.api_keys_file} holds no key: on a host other machines reach, a key "
                        "source must hold a key (give it one, or unset it)"
                    ) from None
            except OSError as exc:
                raise ValueError(f"api_keys_file: {exc}") from None
        if not keyed and not self.allow_unauthenticated and not _is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no api_key is set: "
                "set --api-key (ROLLBUF_API_KEY), or --allow-unauthenticated to accept that"
            )
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def to_environ(settings: Settings) -> dict[str, str]:
    """The `ROLLBUF_*` variables that rebuild these settings in another process (uvicorn's worker processes
    build their app from the environment)."""
    out = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, list):
            out[f"ROLLBUF_{name.upper()}"] = json.dumps(value)
            continue
        out[f"ROLLBUF_{name.upper()}"] = (
            "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        )
    return out


def _fixed(settings: Settings) -> tuple[list[Key], list[str]]:
    """`api_key`'s and `api_keys`' keys, checked (`api.keyring.fixed_keys`), and warnings."""
    return fixed_keys(
        None if settings.api_key is None else settings.api_key.get_secret_value(),
        None if settings.api_keys is None else settings.api_keys.get_secret_value(),
        required=not _is_loopback(settings.host),
    )


def door_keys(settings: Settings) -> Callable[[], list[Key]] | None:
    """The keys the front door checks, as a function (a key file is read again when it changes); None only when
    no key source is set. A source set but empty leaves a keyed server with no keys, which refuses every
    request needing one: keys fail closed."""
    keyed = settings.api_key is not None or settings.api_keys is not None or settings.api_keys_file is not None
    if not keyed:
        return None
    fixed, _ = _fixed(settings)
    if settings.api_keys_file is not None:
        return KeyFile(settings.api_keys_file, fixed, required=not _is_loopback(settings.host))
    return lambda: fixed


def log_keys(settings: Settings, keys: Callable[[], list[Key]] | None) -> None:
    """At start: the active keys' names and roles (never a secret), and why a key source gives none."""
    if keys is None:
        return
    for warning in _fixed(settings)[1]:
        log.warning("%s", warning)
    if isinstance(keys, KeyFile) and keys.error is not None:
        log.error("api_keys_file %s: %s", keys.path, keys.error)
    log.info("keys in use: %s", describe(keys()) or "none (every request needing a key is refused)")


def inflight_per_client(settings: Settings) -> int:
    """`max_inflight_bytes_per_client`, or its default: half the budget, at least one valid request's bytes."""
    if settings.max_inflight_bytes_per_client is not None:
        return settings.max_inflight_bytes_per_client
    one_request = settings.max_body_bytes + settings.max_decompressed_bytes
    return min(settings.max_inflight_bytes, max(settings.max_inflight_bytes // 2, one_request))


def door_hosts(settings: Settings) -> tuple[str, ...] | None:
    """`allowed_hosts`, or its default: loopback names on a keyless loopback server, any host otherwise."""
    if settings.allowed_hosts is not None:
        return tuple(h.lower() for h in settings.allowed_hosts)
    keyed = settings.api_key is not None or settings.api_keys is not None or settings.api_keys_file is not None
    return ("loopback",) if not keyed and _is_loopback(settings.host) else None
