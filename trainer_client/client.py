"""`TrainerClient`: register, then iterate over batches as numpy arrays. Synchronous; see `aio` for async."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import httpx

from api.wire.producers import WeightsReply, WeightSyncReply
from api.wire.schema import CommitReply, Info, RegisterReply, Status
from trainer_client.arrays import Batch
from trainer_client.base import BaseTrainerClient
from trainer_client.errors import ServerUnreachable, error_for
from trainer_client.protocol import (
    DEFAULT_WAIT,
    DRAIN_POLL_S,
    DRAIN_TIMEOUT_S,
    NO_PROGRESS_S,
    Balance,
    BatchQuery,
    Cursor,
    DrainWait,
    Encoding,
    Server,
    parse_batch_reply,
    registration,
)
from trainer_client.transport import StdlibTransport


class TrainerClient(BaseTrainerClient[httpx.Client]):
    """The trainer's side of rollbuf (or of an Atropos server, over JSON).

    ```python
    with TrainerClient("http://127.0.0.1:8000") as rb:
        rb.register(batch_size=256, max_token_len=4096)
        for batch in rb.batches(start_step=checkpoint_step):
            train(batch.packed(4096))
    ```

    Every request is retried on timeouts, dropped connections, 429 and 5xx (`errors.is_retryable`), with
    exponential backoff (full jitter) never shorter than the server's Retry-After, for `retry_deadline`
    seconds after a request's own read timeout (`Endpoint.retry_for`: a /batch timed out at its sized limit is
    still tried again), and at most `tries` tries when given (`client_core.retry.RetryPolicy`); then
    ServerUnreachable (no answer at all) or the last ServerError is raised. A 4xx is never retried. The
    client's own httpx.Client sends over `transport.StdlibTransport` (3x faster than httpx's default for a
    large batch); `http_client` replaces it (any httpx.Client, for instance with a MockTransport) and is
    not closed by `close()`.
    """

    def _default_http(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout, transport=StdlibTransport())

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self._http.close()

    # ------------------------------------------------------------------------------------------- calls

    def register(self, *, batch_size: int, max_token_len: int, starting_step: int = 0, **fields: Any) -> RegisterReply:
        """Register the run (POST /register). `fields` are the other Registration fields: the wandb and
        checkpoint ones have defaults; rollbuf's extensions (`max_batch_tokens`, `max_staleness`, ...)
        are sent only when given. Registering again with the same values is harmless; different ones
        raise Rejected (409) until the run is reset."""
        body = registration(batch_size=batch_size, max_token_len=max_token_len, starting_step=starting_step, **fields)
        return RegisterReply.model_validate_json(self._request("POST", "/register", json=body).content)

    def info(self) -> Info:
        """GET /info: batch size and max token length (-1 before registration), encodings spoken."""
        return Info.model_validate_json(self._request("GET", "/info").content)

    def status(self) -> Status:
        """GET /status: the current step, what is queued, and why no batch can be formed (if blocked)."""
        return Status.model_validate_json(self._request("GET", "/status").content)

    def commit(self, step: int) -> CommitReply:
        """Acknowledge every batch before `step` (POST /commit): call it once the checkpoint that resumes at
        `step` is saved (the step after the last batch trained; from one rank, after the checkpoint barrier).
        With `register(acknowledge="commit")`, only commits free batches: batches from the last commit on are
        served again to `batches(start_step=...)` after a crash, however far a prefetching loader read ahead.
        A commit at or below the last one changes nothing, so it is retried like any request."""
        return CommitReply.model_validate_json(self._request("POST", "/commit", json={"step": step}).content)

    def announce_weights(self, step: int) -> WeightsReply:
        """Tell rollbuf that the weights of `step` are live on the inference servers (POST /weights): call it
        after each weight sync, with the step of the next batch to train (the weights trained on every batch
        before it). Producers stamp it on the groups they start from then on and judge `max_staleness` against
        it; an older step changes nothing, so it is retried like any request."""
        reply = WeightsReply.model_validate_json(self._request("POST", "/weights", json={"step": step}).content)
        self._moves += 1
        return reply

    def begin_weights(self, step: int) -> WeightSyncReply:
        """Begin a weight sync to `step` (POST /weights/pending), before pushing weights: producers of
        `on_new_weights="drain"` envs start no new group of them and report drained once their episodes in flight
        end. `announce_weights(step)` ends it. Usually through `weight_sync`."""
        reply = self._request("POST", "/weights/pending", json={"step": step})
        return WeightSyncReply.model_validate_json(reply.content)

    def weight_sync_state(self) -> WeightSyncReply:
        """GET /weights/pending: the sync begun and not yet announced, and who it waits for."""
        return WeightSyncReply.model_validate_json((self._request("GET", "/weights/pending")).content)

    def wait_drained(self, step: int, timeout: float | None = DRAIN_TIMEOUT_S) -> bool:
        """Wait until every live producer of a drain env has drained for the pending sync to `step`
        (producers gone do not count), logging who it waits for at once and every 5 s; True once drained, False
        after `timeout` s (None: no bound), when the sync should go on without them."""
        wait = DrainWait(step, timeout, time.monotonic())
        while True:
            verdict = wait.verdict(self.weight_sync_state(), time.monotonic())
            if verdict != "wait":
                return verdict == "drained"
            time.sleep(DRAIN_POLL_S)

    @contextmanager
    def weight_sync(self, step: int, timeout: float | None = DRAIN_TIMEOUT_S) -> Iterator[bool]:
        """A weight sync to `step` that drain envs' producers wait out, across processes:

        ```python
        with rb.weight_sync(step):  # producers of drain envs stop and finish their episodes in flight
            push_weights_to_inference(step)
        # announced (POST /weights): producers start again, stamped with `step`
        ```

        Yields whether every live drain producer drained within `timeout` s. When the block raises, nothing is
        announced and the sync stays pending (drain envs held, as /status says) until the next sync's
        announcement."""
        self.begin_weights(step)
        drained = self.wait_drained(step, timeout)
        yield drained
        self.announce_weights(step)

    def batches(
        self,
        *,
        start_step: int | None = None,
        wait: float = DEFAULT_WAIT,
        rank: int | None = None,
        world_size: int | None = None,
        encoding: Encoding = "msgpack",
        balance: Balance = "tokens",
        stop: threading.Event | None = None,
        no_progress_timeout: float | None = NO_PROGRESS_S,
    ) -> Iterator[Batch]:
        """Batches, one per step, until the run is finished or forever (stop iterating to stop).

        Asks for batch `start_step`, then the next, with `?step=`. A run registered with
        `acknowledge="next"` (the default) acknowledges batch N when N+1 is asked for; with
        `acknowledge="commit"`, when `commit()` passes it. Until then N is served again, so a retry or a restart
        with `start_step=N` (the step in your checkpoint) never skips or repeats data. In commit mode the
        iterator may read ahead of training (a prefetching loader) up to the server's bound
        (`max_read_ahead_batches`); there it waits for a commit, as it waits for data. Without `start_step`,
        it starts at the server's current step. Waits by long-polling (`wait` seconds per request);
        against a server that does not (Atropos) it polls with backoff and jitter and sends no query
        parameters. `rank`/`world_size` give this data-parallel rank its share of every batch.
        `encoding="msgpack"` is used when the server offers it (GET /info), else JSON.

        `stop`: the iterator ends once it is set, checked after every reply (a reader thread stops within one
        long-poll, even while no batch comes).

        The iterator ends on its own when the server says the run is finished (`finished`): every dataset feeding
        it is done and nothing else can arrive (docs/tasks.md, "The end of a dataset"); in next mode the request
        that learns it acknowledges the last batch. A run without datasets never finishes: stop iterating at your
        own step count.

        No silent waits: when the server says nothing can arrive (its `stall_reason`: no live producer for the
        run's envs, or every live one held back waiting for the trainer) it is logged at once, and after
        `no_progress_timeout` s of it (None: never) NoProgress is raised with the reason.

        Raises NoProgress, NotRegistered, BatchGone (batch N was acknowledged already), Rejected, or
        ServerUnreachable once a request got no answer until the retry deadline.
        """
        server = Server.from_info(self.info())
        query = BatchQuery.make(
            server,
            wait=wait,
            rank=rank,
            world_size=world_size,
            encoding=encoding,
            balance=balance,
            timeout=self.timeout,
        )
        step = start_step if start_step is not None or not server.rollbuf else self.status().current_step
        cursor = Cursor(query, step, moves=lambda: self._moves)
        cursor.progress.no_progress_timeout = no_progress_timeout
        while (stop is None or not stop.is_set()) and not cursor.finished:
            request = cursor.request()
            batch = cursor.receive(parse_batch_reply(self._request("GET", "/batch", **request), request["step"]))
            if batch is not None:
                yield batch
            elif not cursor.finished and (pause := cursor.pause()):
                if stop is None:
                    time.sleep(pause)
                else:
                    stop.wait(pause)

    # ------------------------------------------------------------------------------------------- sending

    def _request(
        self,
        method: str,
        path: str,
        *,
        step: int | None = None,
        answer: Callable[[httpx.Response], bool] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send with retries; error replies become exceptions (errors.error_for)."""
        kwargs.setdefault("timeout", self.timeout)
        headers = self.endpoint.headers | kwargs.pop("headers", {})
        tries = 0
        try:
            for attempt in self.endpoint.retry_for(kwargs["timeout"]).retrying(reraise=True):
                tries = attempt.retry_state.attempt_number
                with attempt:
                    try:
                        reply = self._http.request(method, self.base_url + path, headers=headers, **kwargs)
                    except httpx.TransportError as exc:
                        self._outage.failed(f"{method} {path}: {type(exc).__name__}: {exc}")
                        raise
                    self._outage.answered()
                    if reply.status_code >= 400 and not (answer is not None and answer(reply)):
                        raise error_for(reply, step)
                    return reply
        except httpx.TransportError as exc:
            raise ServerUnreachable(self.base_url, tries, exc) from exc
        raise AssertionError("unreachable: tenacity reraises the last error")
