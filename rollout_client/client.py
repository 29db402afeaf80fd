"""`RolloutClient`: an environment's connection to rollbuf (register, submit groups, read status, disconnect).

Every reply is validated with the wire schema (`api.wire.schema`). Submissions carry a `group_id`, so the retries
this client makes after a timeout, a restart or a 503 can never store a group twice.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel
from tenacity import RetryError

from api.wire import records
from api.wire.producers import Heartbeat, HeartbeatReply
from api.wire.records import MSGPACK
from api.wire.replay import ReusePolicy
from api.wire.rollouts import TurnReply
from api.wire.schema import (
    EnvRegistered,
    EnvStatus,
    Info,
    RegisterEnv,
    ScoredData,
    ScoredListReply,
    ScoredReply,
)
from api.wire.tasks import DatasetView
from client_core.config import DEFAULT_TIMEOUT, DEFAULT_URL, RETRY_DEADLINE_S, auth_headers
from client_core.errors import (
    ClientError,
    RetriesExhausted,
    TransportError,
    Unavailable,
    error_for,
    is_retryable,
    reply_body,
)
from client_core.outage import Outage
from client_core.retry import RetryPolicy

log = logging.getLogger("rollout_client")

REGISTER_BACKOFF = RetryPolicy(deadline=0.0)
"""The backoff between registration attempts while the trainer has not started (their deadline is
`wait_timeout`); each wait is also capped at 2 s so a starting trainer is noticed quickly."""
HEARTBEAT_DEADLINE_S = 2.0
"""How long one heartbeat is retried: the next is due within seconds."""
GZIP_MIN_BYTES = 1024
"""JSON bodies from this size up are gzipped; below it gzip's header costs more than it saves."""

M = TypeVar("M", bound=BaseModel)


class TrainerNotStarted(ClientError):
    """`register(wait_timeout=...)` gave up: the trainer has not asked for its first batch yet."""


def encode_json(group: ScoredData | list[ScoredData]) -> tuple[bytes, dict[str, str]]:
    """A group (or a list of them, for /scored_data_list) as a JSON body (gzipped from GZIP_MIN_BYTES up) and its
    headers."""
    fields = (
        [g.model_dump(exclude_none=True) for g in group]
        if isinstance(group, list)
        else group.model_dump(exclude_none=True)
    )
    body = orjson.dumps(fields)
    headers = {"Content-Type": "application/json"}
    if len(body) >= GZIP_MIN_BYTES:
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return body, headers


class RolloutClient:
    """Async client for one environment. Use as `async with RolloutClient(url) as client:`.

    `register()` waits politely until the trainer has started, `submit()` retries transport errors, 429 and
    503 (honouring Retry-After) with exponential backoff and jitter for up to `retry_deadline` seconds and
    raises `Rejected` (naming the field and the rule) on any other 4xx. Leaving the `async with` block
    disconnects the environment, so the server stops reserving batch shares for it.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        retry_deadline: float = RETRY_DEADLINE_S,
        api_key: str | None = None,
        prefer_binary: bool = True,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._http = http_client or httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=auth_headers(api_key))
        self._owns_http = http_client is None
        self.retry_deadline = retry_deadline
        """Seconds one request is retried (transport errors, 429, 503, other 5xx), from its first try."""
        self.env_id: int | None = None
        self.registration: EnvRegistered | None = None
        self.prefer_binary = prefer_binary
        """Submit msgpack when the server offers it (`content_types` in /info); JSON otherwise."""
        self.binary = False
        """True once /info advertised msgpack submissions (and `prefer_binary`)."""
        self.outage = Outage(f"rollbuf server {base_url}", log)
        """This client's view of the server's reachability: its failed requests, its replies, and requests its
        caller found unanswered past their bound (the runner's heartbeat), each logged as it starts and ends."""

    # ------------------------------------------------------------------------------------------- plumbing

    async def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request, no retries: the decoded JSON reply, or the exception from `errors`."""
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise TransportError.from_httpx(exc, method, path) from exc
        if response.status_code >= 400:
            raise error_for(response)
        return reply_body(response)

    async def _call(
        self,
        method: str,
        path: str,
        deadline: float | None = None,
        retry_on: Callable[[BaseException], bool] = is_retryable,
        **kwargs: Any,
    ) -> Any:
        """`_send` with retries (of what `retry_on` allows) until the deadline; RetriesExhausted (from the last
        error) after it."""
        try:
            policy = RetryPolicy(self.retry_deadline if deadline is None else deadline, retry_on=retry_on)
            async for attempt in policy.aretrying():
                with attempt:
                    try:
                        reply = await self._send(method, path, **kwargs)
                    except TransportError as exc:
                        self.outage.failed(f"{method} {path}: {exc}")
                        raise
                    except ClientError:
                        self.outage.answered()  # an error reply: the server is there
                        raise
                    self.outage.answered()
                    return reply
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise RetriesExhausted(f"{method} {path}: still failing after retrying: {last}") from last
        raise AssertionError("unreachable: tenacity either returns, raises, or raises RetryError")

    async def _model(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        return model.model_validate(await self._call(method, path, **kwargs))

    # ------------------------------------------------------------------------------------------- API

    async def info(self) -> Info:
        """The trainer's batch size and max token length (-1 before it registers)."""
        info = await self._model(Info, "GET", "/info")
        self.binary = self.prefer_binary and MSGPACK in (info.content_types or [])
        return info

    async def register(
        self,
        name: str,
        group_size: int,
        *,
        weight: float = 1.0,
        max_token_length: int | None = None,
        min_batch_allocation: float | None = None,
        wait_timeout: float | None = None,
        on_wait: Callable[[str], None] | None = None,
        variable_group_size: bool = False,
        max_token_staleness: int | None = None,
        reuse: ReusePolicy | None = None,
    ) -> EnvRegistered:
        """Register this environment, waiting (with backoff, up to `wait_timeout` s; None: forever) while the
        trainer has not registered or not asked for its first batch. `max_token_length` defaults to the
        trainer's `max_token_len`. `variable_group_size`: its groups are complete at any size (survivors of
        failed rollouts, `min_group_size`; several sequences per rollout, `Environment.variable_group_size`): the
        server queues each whole. `max_token_staleness`: trained tokens of weights more than this many steps older
        than the batch they are served in are served masked (docs/api-environments.md). `reuse`: this env's reuse
        policy where it differs from the trainer's (`ReusePolicy(max_served=1)` opts out; docs/replay.md)."""
        loop = asyncio.get_running_loop()
        give_up = None if wait_timeout is None else loop.time() + wait_timeout
        attempt = 0
        while True:
            info = await self.info()
            if info.max_token_len > 0:
                body = RegisterEnv(
                    max_token_length=max_token_length or info.max_token_len,
                    desired_name=name,
                    weight=weight,
                    group_size=group_size,
                    min_batch_allocation=min_batch_allocation,
                    variable_group_size=variable_group_size,
                    max_token_staleness=max_token_staleness,
                    reuse=reuse,
                )
                raw = await self._call("POST", "/register-env", json=body.model_dump(exclude_none=True))
                if raw.get("status") != "wait for trainer to start":
                    self.registration = EnvRegistered.model_validate(raw)
                    self.env_id = self.registration.env_id
                    return self.registration
                reason = "the trainer has not asked for its first batch yet"
            else:
                reason = "no trainer has registered yet"
            attempt += 1
            delay = min(2.0, REGISTER_BACKOFF.delay(attempt, None) + 0.05)
            if give_up is not None and loop.time() + delay > give_up:
                raise TrainerNotStarted(f"registering {name!r}: {reason} (waited {wait_timeout} s)")
            if on_wait is not None:
                on_wait(reason)
            await asyncio.sleep(delay)

    async def submit(self, group: ScoredData, *, deadline: float | None = None) -> ScoredReply:
        """Submit one group, retried until acknowledged or `deadline` seconds (default `retry_deadline`).

        It goes as msgpack when the server offers it (after `info()` or `register()`), else as JSON (gzipped
        from 1 KiB). The group gets this env's `env_id` and, if it has none, a fresh `group_id`, chosen once before the
        first attempt: every retry carries the same id, so the server stores the group at most once.
        """
        group = self._identified(group)
        body, headers = encode_msgpack(group) if self.binary else encode_json(group)
        raw = await self._call("POST", "/scored_data", deadline, content=body, headers=headers)
        return ScoredReply.model_validate(raw)

    async def post_turn(
        self,
        group_id: str,
        slot: int,
        producer_id: str,
        turn: int,
        tokens: Sequence[int],
        masks: Sequence[int],
        *,
        inference_logprobs: Sequence[float] | None = None,
        token_weight_versions: Sequence[int] | None = None,
        tool_results: Sequence[Any] | None = None,
        snapshot: bytes | str | None = None,
        deadline: float | None = None,
    ) -> TurnReply:
        """Acknowledge turn `turn` (0, 1, ...) of a slot of an open per-rollout group as it ends: the tokens it
        appends, one mask (and logprob and weights version, if sent) per token, its tools' results and the env's
        state after it (`snapshot`: bytes sent inline, or a `str` URI where the state is kept). Retried until
        acknowledged or `deadline` seconds: a retry is the same turn, answered `duplicate`. `Rejected` (409) when
        the slot's lease passed to another producer: stop the rollout. A producer that takes the slot's lease gets
        the turns (`SlotLease.prefix`); the slot's final post sends the rest with `after_turns`
        (docs/rollouts.md, Turns)."""
        snap: dict[str, str] | None = None
        if isinstance(snapshot, bytes):
            snap = {"data": base64.b64encode(snapshot).decode()}
        elif snapshot is not None:
            snap = {"uri": snapshot}
        body = {
            "group_id": group_id,
            "slot": slot,
            "producer_id": producer_id,
            "turn": turn,
            "tokens": list(tokens),
            "masks": list(masks),
            "inference_logprobs": None if inference_logprobs is None else list(inference_logprobs),
            "token_weight_versions": None if token_weight_versions is None else list(token_weight_versions),
            "tool_results": None if tool_results is None else list(tool_results),
            "snapshot": snap,
        }
        return TurnReply.model_validate(await self._call("POST", "/rollouts/turn", deadline, json=body))

    async def submit_list(
        self, groups: Sequence[ScoredData], *, deadline: float | None = None, retry_unavailable: bool = True
    ) -> ScoredListReply:
        """Submit several groups in one POST /scored_data_list, as `submit` does one: the same encoding, retries
        and ids (each group's, chosen once before the first attempt). All are stored, or none: one invalid
        group rejects the list (`Rejected`, naming its index). `duplicate_at` in the reply names the groups
        that were stored before.

        `retry_unavailable=False`: a 429/503 raises `Unavailable` at once instead of being retried: a queue
        with room for some of the groups but not all refuses the list whole, and the caller may send them
        alone (as the runner does), so that the queue fills to its limit as with single submits."""
        sent = [self._identified(g) for g in groups]
        if self.binary:
            body = records.encode_submission_list(encode_msgpack(g)[0] for g in sent)
            headers = {"Content-Type": MSGPACK}
        else:
            body, headers = encode_json(sent)
        retry_on = is_retryable if retry_unavailable else _retryable_but_unavailable
        raw = await self._call("POST", "/scored_data_list", deadline, retry_on, content=body, headers=headers)
        return ScoredListReply.model_validate(raw)

    def _identified(self, group: ScoredData) -> ScoredData:
        """The group with this env's `env_id` and, if it has none, a fresh `group_id`."""
        if group.env_id is None and self.env_id is not None:
            group = group.model_copy(update={"env_id": self.env_id})
        if group.group_id is None:
            group = group.model_copy(update={"group_id": uuid.uuid4().hex})
        return group

    async def status(self) -> EnvStatus:
        """This env's view of the queue (GET /status-env): step, backlog, weight, remaining capacity."""
        return await self._model(EnvStatus, "GET", "/status-env", params={"env_id": self._require_env()})

    async def heartbeat(self, beat: Heartbeat, *, deadline: float = HEARTBEAT_DEADLINE_S) -> HeartbeatReply:
        """Tell the server this producer is alive and what it does (POST /producers/heartbeat); retried for
        `deadline` s only: the next beat is due soon."""
        body = beat.model_dump(exclude_none=True)
        return HeartbeatReply.model_validate(await self._call("POST", "/producers/heartbeat", deadline, json=body))

    async def disconnect(self) -> None:
        """Tell the server this env is gone (its reserved batch share is released; queued data stays)."""
        if self.env_id is not None:
            await self._call("POST", "/disconnect-env", json={"env_id": self.env_id}, deadline=5.0)
            self.env_id = None

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.env_id is not None:
                try:
                    await self.disconnect()
                except ClientError:
                    if exc is None:
                        raise  # a clean exit reports a failed disconnect; an error exit keeps the original error
        finally:
            await self.aclose()

    def _require_env(self) -> int:
        if self.env_id is None:
            raise ClientError("register() this environment first")
        return self.env_id


def _retryable_but_unavailable(exc: BaseException) -> bool:
    return is_retryable(exc) and not isinstance(exc, Unavailable)


def encode_msgpack(group: ScoredData) -> tuple[bytes, dict[str, str]]:
    """A group as a binary body (docs/binary-format.md): raw int32/float32 arrays, no digits to print or parse."""
    fields = group.model_dump(exclude_none=True)
    body = records.encode_submission(
        fields.pop("tokens"),
        fields.pop("masks"),
        fields.pop("scores"),
        env_id=fields.pop("env_id", None),
        policy_step=fields.pop("policy_step", None),
        group_id=fields.pop("group_id", None),
        producer_id=fields.pop("producer_id", None),
        advantages=fields.pop("advantages", None),
        ref_logprobs=fields.pop("ref_logprobs", None),
        inference_logprobs=fields.pop("inference_logprobs", None),
        **fields,
    )
    return body, {"Content-Type": MSGPACK}


class SyncRolloutClient:
    """The blocking twin of `RolloutClient` (same methods, same retries), for scripts without an event loop.

    It drives a `RolloutClient` on a private event loop, so it must not be used from inside a running loop.
    """

    def __init__(self, base_url: str = DEFAULT_URL, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._client = self._runner.run(_make(base_url, kwargs))

    @property
    def env_id(self) -> int | None:
        return self._client.env_id

    def info(self) -> Info:
        return self._runner.run(self._client.info())

    def register(self, name: str, group_size: int, **kwargs: Any) -> EnvRegistered:
        return self._runner.run(self._client.register(name, group_size, **kwargs))

    def submit(self, group: ScoredData, *, deadline: float | None = None) -> ScoredReply:
        return self._runner.run(self._client.submit(group, deadline=deadline))

    def submit_list(
        self, groups: Sequence[ScoredData], *, deadline: float | None = None, retry_unavailable: bool = True
    ) -> ScoredListReply:
        return self._runner.run(
            self._client.submit_list(groups, deadline=deadline, retry_unavailable=retry_unavailable)
        )

    def status(self) -> EnvStatus:
        return self._runner.run(self._client.status())

    def register_dataset(self, name: str, tasks: Iterable[Any] | os.PathLike[str], **kwargs: Any) -> DatasetView:
        """`rollout_client.register_dataset(client, name, tasks, **kwargs)` through this client (same retries)."""
        from rollout_client.leases.datasets import register_dataset  # it imports this module

        return self._runner.run(register_dataset(self._client, name, tasks, **kwargs))

    def disconnect(self) -> None:
        self._runner.run(self._client.disconnect())

    def close(self) -> None:
        try:
            self._runner.run(self._client.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._runner.run(self._client.__aexit__(exc_type, exc, tb))
        finally:
            self._runner.close()


async def _make(base_url: str, kwargs: dict[str, Any]) -> RolloutClient:
    # httpx.AsyncClient binds to the loop it is first used on: build it on the runner's loop.
    return RolloutClient(base_url, **kwargs)
