"""The I/O-free half of the clients: what to send for a batch, how to read the reply, how long to wait.

`TrainerClient` and `AsyncTrainerClient` differ only in how they send; everything they decide is here.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from api.wire.producers import WeightSyncReply
from api.wire.records import MSGPACK, decode_batch, is_msgpack
from api.wire.schema import Info, Registration
from client_core.config import DEFAULT_URL, auth_headers
from client_core.retry import RetryPolicy
from trainer_client.arrays import Batch, from_json, from_records
from trainer_client.errors import NoProgress, NotRegistered, error_for

Encoding = Literal["msgpack", "json"]
Balance = Literal["tokens", "squared"]

DEFAULT_WAIT = 30.0
"""Long-poll: how long the server holds one /batch request; well under the server's cap (60 s)."""
READ_MARGIN_S = 15.0
"""Added to every /batch read timeout: the server's queueing, formation and a busy machine."""
JSON_S_PER_TOKEN = 2e-5
"""Worst-case JSON batch cost per token position (Atropos needs ~9 µs to encode and send one)."""
BINARY_S_PER_TOKEN = 2e-7
"""Worst-case binary cost per token position (~60 MB/s for 12 bytes; loopback moves >1 GB/s)."""
STEP_HEADER = "x-rollbuf-step"
READ_AHEAD_FULL = "read_ahead_full"
"""The error code of a /batch that a trainer in commit mode reached its read-ahead bound with: a wait, not an
error (the training loop commits, and the prefetcher goes on)."""
PROGRESS_EVERY_S = 30.0
"""While waiting for a batch, how often to log that it is still waiting."""
NO_PROGRESS_S = 600.0
"""Default `no_progress_timeout` of `batches()`: how long the server may say that nothing can arrive (no live
producer, every one held back) before the iterator raises `NoProgress` instead of waiting on."""

log = logging.getLogger("trainer_client")


@dataclass(frozen=True, slots=True)
class Server:
    """What the client learnt from GET /info."""

    batch_size: int
    max_token_len: int
    rollbuf: bool
    """The server has rollbuf's extensions (long-poll, ?step=, rank shares); false for Atropos."""
    binary: bool

    @classmethod
    def from_info(cls, info: Info) -> Server:
        types = info.content_types
        return cls(info.batch_size, info.max_token_len, types is not None, types is not None and MSGPACK in types)


REGISTRATION_DEFAULTS: dict[str, Any] = {
    "wandb_group": "rollbuf",
    "wandb_project": "rollbuf",
    "checkpoint_dir": "checkpoints",
    "save_checkpoint_interval": 100,
    "num_steps": 1_000_000,
}
"""Registration fields Atropos requires that a trainer not using wandb or Atropos checkpoints has no value for."""


def registration(**fields: Any) -> dict[str, Any]:
    """A validated /register body: REGISTRATION_DEFAULTS under `fields`; unset extensions are not sent, so
    an Atropos server sees only its own fields."""
    reg = Registration.model_validate({**REGISTRATION_DEFAULTS, **fields})
    unknown = sorted(set(fields) - set(Registration.model_fields))
    if unknown:
        raise TypeError(f"unknown registration fields {unknown}; known: {', '.join(Registration.model_fields)}")
    return reg.model_dump(exclude_unset=True)


def batch_read_timeout(server: Server, *, wait: float, binary: bool) -> float:
    """Seconds to wait for a /batch reply: the long-poll, a margin, and the batch's worst-case transfer
    (batch_size * max_token_len token positions at JSON_S_PER_TOKEN or BINARY_S_PER_TOKEN)."""
    positions = max(0, server.batch_size) * max(0, server.max_token_len)
    return wait + READ_MARGIN_S + positions * (BINARY_S_PER_TOKEN if binary else JSON_S_PER_TOKEN)


@dataclass(frozen=True, slots=True)
class BatchQuery:
    """How this client asks for batches from this server."""

    server: Server
    wait: float
    rank: int | None
    world_size: int | None
    binary: bool
    balance: Balance
    timeout: httpx.Timeout

    @classmethod
    def make(
        cls,
        server: Server,
        *,
        wait: float,
        rank: int | None,
        world_size: int | None,
        encoding: Encoding,
        balance: Balance,
        timeout: httpx.Timeout,
    ) -> BatchQuery:
        if (rank is None) != (world_size is None) or (rank is not None and world_size and not 0 <= rank < world_size):
            raise ValueError("rank and world_size go together, with 0 <= rank < world_size")
        if world_size is not None and not server.rollbuf:
            raise ValueError("rank shares need a rollbuf server; this one has no rank support (Atropos)")
        if encoding not in ("msgpack", "json"):
            raise ValueError(f"encoding must be 'msgpack' or 'json', not {encoding!r}")
        binary = encoding == "msgpack" and server.binary
        wait = wait if server.rollbuf else 0.0
        read = batch_read_timeout(server, wait=wait, binary=binary)
        timeout = httpx.Timeout(connect=timeout.connect, read=read, write=timeout.write, pool=timeout.pool)
        return cls(server, wait, rank, world_size, binary, balance, timeout)

    @property
    def long_poll(self) -> bool:
        """Whether the server holds an empty /batch (so polling again at once does not spin)."""
        return self.server.rollbuf and self.wait > 0

    def params(self, step: int | None) -> dict[str, Any]:
        """Query parameters; none at all for an Atropos server."""
        if not self.server.rollbuf:
            return {}
        out: dict[str, Any] = {"wait": self.wait} if self.wait > 0 else {}
        if step is not None:
            out["step"] = step
        if self.world_size is not None:
            out.update(rank=self.rank, world_size=self.world_size, balance=self.balance)
        return out

    def headers(self) -> dict[str, str]:
        return {"Accept": MSGPACK if self.binary else "application/json"}


@dataclass(frozen=True, slots=True)
class Waiting:
    """No batch yet; `reason` is the server's blocked_reason when something other than data is missing."""

    reason: str | None = None
    read_ahead: bool = False
    """The server's read-ahead bound (commit mode): the next batch comes once the trainer commits."""
    stall: str | None = None
    """The server's `stall_reason`: why no data can arrive (no live producer, every one held back)."""
    finished: bool = False
    """The server says the run is finished: every dataset feeding it is done and nothing else can arrive, so no
    batch will come (docs/tasks.md, "The end of a dataset")."""


def is_read_ahead_full(response: httpx.Response) -> bool:
    """A 503 that says the trainer read as far ahead of its last commit as the server allows."""
    if response.status_code != 503:
        return False
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and body.get("code") == READ_AHEAD_FULL


def parse_batch_reply(response: httpx.Response, step: int | None) -> Batch | Waiting:
    """A /batch reply as a Batch, or Waiting (the read-ahead bound too); raises NotRegistered or a
    ServerError."""
    if is_read_ahead_full(response):
        return Waiting(str(orjson.loads(response.content).get("detail")), read_ahead=True)
    if response.status_code >= 400:
        raise error_for(response, step)
    header = response.headers.get(STEP_HEADER)
    served_step = int(header) if header is not None else step
    if is_msgpack(response.headers.get("content-type")):
        return from_records(decode_batch(response.content), served_step)
    body = orjson.loads(response.content)
    if not isinstance(body, dict):
        raise ValueError(f"unexpected /batch reply: {type(body).__name__}")
    if body.get("status") == "error":
        raise NotRegistered(body.get("message") or "the trainer is not registered: call register() first")
    groups = body.get("batch")
    if not groups:
        finished = body.get("finished") is True
        return Waiting(body.get("blocked_reason"), stall=body.get("stall_reason"), finished=finished)
    return from_json(groups, body.get("step", served_step))


def poll_delay(attempt: int, *, base: float = 0.5, cap: float = 10.0, rng: random.Random | None = None) -> float:
    """Backoff with jitter between polls of a server that does not long-poll: between half and all of
    min(cap, base * 2**attempt), so many trainers never poll in step."""
    ceiling = min(cap, base * 2.0 ** min(attempt, 32))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how both clients send: the base URL, per-request timeout, auth header and retry policy."""

    base_url: str
    timeout: httpx.Timeout
    headers: dict[str, str]
    retry: RetryPolicy

    @classmethod
    def make(
        cls,
        base_url: str | None,
        http_base_url: str,
        timeout: float | httpx.Timeout,
        api_key: str | None,
        retry_deadline: float,
        tries: int | None,
    ) -> Endpoint:
        """From a client's arguments: the URL given, else the http_client's (`http_base_url`), else the default."""
        return cls(
            (base_url or http_base_url or DEFAULT_URL).rstrip("/"),
            timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout),
            auth_headers(api_key),
            RetryPolicy(retry_deadline, max_attempts=tries),
        )

    def retry_for(self, timeout: httpx.Timeout | float | None) -> RetryPolicy:
        """The retry budget of one request: `retry_deadline` counted from the end of its first try's read
        timeout, so that a request that used all of a long timeout (a /batch sized to a large batch and a
        long-poll) is still tried again, however the deadline compares with it."""
        read = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
        return dataclasses.replace(self.retry, deadline=self.retry.deadline + (read or 0.0))


@dataclass(slots=True)
class Progress:
    """Log lines saying what the iterator waits for: once when it starts waiting, then every PROGRESS_EVERY_S;
    and the no-progress clock, which runs while the server says nothing can arrive.

    The clock counts only what the server said of the trainer as it stands: a stall in the reply to a request
    sent before the trainer's latest move (weights announced by this client: `moves`) was judged before it, and
    may no longer hold (producers held back for the trainer start again once they read the new weights), so it
    stops the clock; the first stall said of a request sent since starts it again."""

    logger: logging.Logger = field(default_factory=lambda: log)
    clock: Any = time.monotonic
    _since: float | None = None
    _last_log: float = 0.0
    no_progress_timeout: float | None = NO_PROGRESS_S
    _stalled_since: float | None = None
    _stall: str | None = None
    _stall_moves: int = 0
    """The trainer's moves when the clock started: a later move starts it again."""

    def waiting(self, step: int | None, how: str, result: Waiting, *, asked: int = 0, moves: int = 0) -> None:
        """Log the wait; raise NoProgress once the server has said for `no_progress_timeout` s that nothing can
        arrive (logged at once, as a warning, when it starts saying so or its reason changes). `asked`: the
        trainer's moves when the request was sent, `moves`: now; a stall said before the latest is not counted."""
        now = self.clock()
        what = "the next batch" if step is None else f"batch {step}"
        stall = result.stall if asked == moves else None
        if self._stalled_since is not None and self._stall_moves != moves:
            self._stalled_since = self._stall = None  # the trainer moved since the clock started
        self._stall_moves = moves
        self._stalled(now, what, stall)
        why = result.reason or result.stall or "not enough data queued yet"
        if self._since is None:
            self._since = self._last_log = now
            self.logger.info("waiting for %s (%s): %s", what, how, why)
        elif now - self._last_log >= PROGRESS_EVERY_S:
            self._last_log = now
            self.logger.info("still waiting for %s after %.0f s: %s", what, now - self._since, why)

    def _stalled(self, now: float, what: str, stall: str | None) -> None:
        if stall is None:
            self._stalled_since = self._stall = None
            return
        if self._stalled_since is None:
            self._stalled_since = now
        if stall != self._stall:
            self._stall = stall
            limit = "" if self.no_progress_timeout is None else f" (raising after {self.no_progress_timeout:g} s)"
            self.logger.warning("waiting for %s, but nothing can arrive: %s%s", what, stall, limit)
        waited = now - self._stalled_since
        if self.no_progress_timeout is not None and waited >= self.no_progress_timeout:
            raise NoProgress(stall, waited)

    def got(self, batch: Batch) -> None:
        self._stalled_since = self._stall = None
        waited = "" if self._since is None else f" after waiting {self.clock() - self._since:.1f} s"
        self._since = None
        label = "batch" if batch.step is None else f"batch {batch.step}"
        self.logger.info(
            "%s: %d groups, %d sequences, %d tokens%s", label, batch.n_groups, batch.n_seqs, batch.n_tokens, waited
        )


@dataclass(slots=True)
class Cursor:
    """Where a `batches()` loop stands: the step to ask for next, how to ask, how long to wait before asking
    again. Both clients drive one; only the sending and the sleeping are theirs."""

    query: BatchQuery
    step: int | None
    progress: Progress = field(default_factory=Progress)
    moves: Callable[[], int] = lambda: 0
    """How many times the trainer has moved without a batch (weights announced by its client): a reply to a
    request sent before the latest move says nothing of where the trainer stands now (`Progress`)."""
    _polls: int = 0
    _asked: int = 0
    finished: bool = False
    """The server said the run is finished: the loop ends (no batch will come)."""

    def request(self) -> dict[str, Any]:
        """Keyword arguments of the next GET /batch (the client's `_request`)."""
        q = self.query
        self._asked = self.moves()
        return {
            "params": q.params(self.step),
            "headers": q.headers(),
            "timeout": q.timeout,
            "step": self.step,
            "answer": is_read_ahead_full,
        }

    def receive(self, result: Batch | Waiting) -> Batch | None:
        """Take a parsed reply: the batch (the cursor moves to the next step), or None while waiting, or once the
        run is finished (`finished`, logged: what a run over finite datasets ends with)."""
        if isinstance(result, Batch):
            self.progress.got(result)
            self._polls = 0
            self.step = None if self.step is None else self.step + 1
            return result
        if result.finished:
            self.finished = True
            what = "no batch will come" if self.step is None else f"batch {self.step} will not come"
            left = f" ({result.reason})" if result.reason else ""
            log.info(
                "the run is finished, %s: every dataset feeding it is done and nothing else can arrive%s", what, left
            )
            return None
        how = f"long-poll {self.query.wait:g} s" if self.query.long_poll else "polling"
        self.progress.waiting(self.step, how, result, asked=self._asked, moves=self.moves())
        return None

    def pause(self) -> float:
        """Seconds to wait before asking again after no batch: none when the server long-polls (it held the
        request until a commit or its wait ended, also at the read-ahead bound)."""
        if self.query.long_poll:
            return 0.0
        self._polls += 1
        return poll_delay(self._polls - 1)


# ----------------------------------------------------------------------------------------------- weight syncs

DRAIN_TIMEOUT_S = 60.0
"""Default bound of `weight_sync`'s wait for drain producers: past it the sync goes on without them."""
DRAIN_POLL_S = 0.05
DRAIN_LOG_EVERY_S = 5.0


@dataclass(slots=True)
class DrainWait:
    """The trainer's wait for drain producers before a weight sync to `step`: what each GET /weights/pending reply
    means, and the log lines (who it waits for at once and every few seconds; the outcome). Pure: no I/O."""

    step: int
    timeout: float | None
    started: float
    _logged: float | None = None

    def verdict(self, reply: WeightSyncReply, now: float) -> Literal["drained", "wait", "timeout"]:
        waited = now - self.started
        if reply.pending_step is None or reply.pending_step != self.step or reply.drained:
            # none pending: announced already (a retry) or no sync; another step pending: a newer sync replaced it
            if self._logged is not None:
                log.info("weight sync to step %d: every drain producer drained after %.1f s", self.step, waited)
            return "drained"
        if self.timeout is not None and waited >= self.timeout:
            log.warning(
                "weight sync to step %d: %s not drained after %.0f s; syncing without them (their episodes "
                "in flight span the sync)",
                self.step,
                ", ".join(reply.waiting_on),
                waited,
            )
            return "timeout"
        if self._logged is None or now - self._logged >= DRAIN_LOG_EVERY_S:
            self._logged = now
            log.info(
                "weight sync to step %d waits for %d producer(s) to drain (%.0f s so far%s): %s",
                self.step,
                len(reply.waiting_on),
                waited,
                "" if self.timeout is None else f", at most {self.timeout:g} s",
                ", ".join(reply.waiting_on),
            )
        return "wait"
