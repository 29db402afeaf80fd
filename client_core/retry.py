"""One retry policy for every request either client sends again: what to retry, how long to wait between
tries, and when to give up, as a value a caller sets (procrastinate's `retry.py` is the model).

The wait is exponential with full jitter (uniform in [0, min(cap, base * 2**(attempt-1))]), so that many
clients cut off by one restart come back spread out, never shorter than the server's Retry-After (plus up to
10% on top, so that a crowd told "2 s" does not return in lockstep). The budget is a deadline in seconds
from the first try, optionally also a number of tries: the caller says how long an outage is worth riding
out (each client documents its default).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
)
from tenacity.stop import stop_base

from client_core.errors import RetriesExhausted, TransportError, error_for, is_retryable, reply_body

BASE_S = 0.1
"""First backoff ceiling: short enough that a blip costs little."""
CAP_S = 5.0
"""Largest backoff ceiling: a restarting server is probed at least this often."""
RETRY_AFTER_JITTER = 0.1
"""Up to this share of the server's Retry-After is added, so that clients told the same wait spread out."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry what `retry_on` allows, waiting `delay(...)` between tries, until `deadline` seconds have passed
    since the first (and at most `max_attempts` tries, when set)."""

    deadline: float
    max_attempts: int | None = None
    base: float = BASE_S
    cap: float = CAP_S
    retry_on: Callable[[BaseException], bool] = field(default=is_retryable)

    def __post_init__(self) -> None:
        if self.deadline < 0:
            raise ValueError(f"deadline must be at least 0 s, got {self.deadline}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not 0 < self.base <= self.cap:
            raise ValueError(f"need 0 < base <= cap, got base {self.base}, cap {self.cap}")

    def delay(self, attempt: int, retry_after: float | None, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait after try `attempt` (counting from 1) failed, the server having asked for
        `retry_after` seconds (None: it did not say)."""
        ceiling = min(self.cap, self.base * 2.0 ** min(max(0, attempt - 1), 64))
        wait = rng() * ceiling
        if retry_after is not None:
            wait = max(wait, retry_after * (1.0 + RETRY_AFTER_JITTER * rng()))
        return wait

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        retry_after = getattr(exc, "retry_after", None)  # ServerError's, or an inference server's 429
        return self.delay(state.attempt_number, retry_after)

    def _stop(self) -> stop_base:
        stop: stop_base = stop_after_delay(self.deadline)
        return stop if self.max_attempts is None else stop | stop_after_attempt(self.max_attempts)

    def _kwargs(self, reraise: bool) -> dict[str, Any]:
        return {
            "retry": retry_if_exception(self.retry_on),
            "wait": self._wait,
            "stop": self._stop(),
            "reraise": reraise,
        }

    def retrying(self, *, reraise: bool = False) -> Retrying:
        """tenacity's blocking loop for this policy: `reraise=False` ends in RetryError (the caller turns it
        into its own error), `True` raises the last error as itself."""
        return Retrying(**self._kwargs(reraise))

    def aretrying(self, *, reraise: bool = False) -> AsyncRetrying:
        """`retrying` for asyncio."""
        return AsyncRetrying(**self._kwargs(reraise))


async def post_retrying(http: httpx.AsyncClient, path: str, body: dict[str, Any], deadline: float) -> Any:
    """POST `body` as JSON, retried under `RetryPolicy(deadline)`: the decoded reply, the error from
    `client_core.errors` (not retried where it says so), or RetriesExhausted from the last one."""
    return await _retrying(http, "POST", path, deadline, json=body)


async def get_retrying(http: httpx.AsyncClient, path: str, params: dict[str, Any], deadline: float) -> Any:
    """GET with query `params`, retried as `post_retrying` is."""
    return await _retrying(http, "GET", path, deadline, params=params)


async def _retrying(http: httpx.AsyncClient, method: str, path: str, deadline: float, **kwargs: Any) -> Any:
    try:
        async for attempt in RetryPolicy(deadline).aretrying():
            with attempt:
                try:
                    response = await http.request(method, path, **kwargs)
                except httpx.TransportError as exc:
                    raise TransportError.from_httpx(exc, method, path) from exc
                if response.status_code >= 400:
                    raise error_for(response)
                return reply_body(response)
    except RetryError as exc:
        last = exc.last_attempt.exception()
        raise RetriesExhausted(f"{method} {path}: still failing after retrying: {last}") from last
    raise AssertionError("unreachable: tenacity either returns, raises, or raises RetryError")
