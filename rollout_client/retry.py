"""Backoff for retried requests: exponential with full jitter, never shorter than the server's Retry-After."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_delay

from rollout_client.errors import ServerError, is_retryable

BASE_S = 0.1
"""First backoff ceiling: short enough that a blip costs little."""
CAP_S = 5.0
"""Largest backoff ceiling: a restarting server is probed at least this often."""


def backoff_delay(attempt: int, retry_after: float | None, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before attempt `attempt + 1` (attempt counts from 1).

    Full jitter (uniform in [0, min(cap, base * 2**(attempt-1))]) spreads many clients apart after a restart;
    Retry-After is a floor, with up to 10% jitter on top so a crowd told "2 s" does not return in lockstep.
    """
    ceiling = min(CAP_S, BASE_S * float(2 ** max(0, attempt - 1)))
    delay = rng() * ceiling
    if retry_after is not None:
        delay = max(delay, retry_after * (1.0 + 0.1 * rng()))
    return delay


def _wait(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome is not None else None
    retry_after = exc.retry_after if isinstance(exc, ServerError) else None
    return backoff_delay(state.attempt_number, retry_after)


def retrying(deadline_s: float, **kwargs: Any) -> AsyncRetrying:
    """Retry what `is_retryable` allows until `deadline_s` has passed (then tenacity raises RetryError)."""
    return AsyncRetrying(
        retry=retry_if_exception(is_retryable),
        wait=_wait,
        stop=stop_after_delay(deadline_s),
        **kwargs,
    )
