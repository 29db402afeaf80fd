"""client_core.retry.RetryPolicy: the waits it chooses, and the budget it keeps, with tenacity's loop."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tenacity import RetryError

from client_core.errors import Rejected, ServerError, TransportError, Unavailable
from client_core.retry import CAP_S, RETRY_AFTER_JITTER, RetryPolicy

POLICY = RetryPolicy(deadline=60.0)
FAST = {"base": 0.001, "cap": 0.002}
"""Waits of a millisecond or two: the loop's behaviour without the test sleeping."""


@given(st.integers(1, 200), st.none() | st.floats(0, 30), st.floats(0, 0.999))
def test_delay_is_bounded_and_honours_retry_after(attempt: int, retry_after: float | None, u: float) -> None:
    delay = POLICY.delay(attempt, retry_after, rng=lambda: u)
    assert delay >= 0
    if retry_after is None:
        assert delay <= CAP_S
    else:
        assert retry_after <= delay <= max(CAP_S, retry_after * (1 + RETRY_AFTER_JITTER))


def test_delay_ceiling_grows_exponentially_until_the_cap() -> None:
    top = [POLICY.delay(a, None, rng=lambda: 0.999999) for a in range(1, 12)]
    assert top == sorted(top) and top[1] == pytest.approx(2 * top[0]) and top[-1] == pytest.approx(CAP_S, rel=1e-3)


@pytest.mark.parametrize(
    "bad",
    [
        {"deadline": -1},
        {"deadline": 1, "max_attempts": 0},
        {"deadline": 1, "base": 0},
        {"deadline": 1, "base": 2, "cap": 1},
    ],
)
def test_nonsense_budgets_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


class Flaky:
    """Fails with `errors` in turn, then answers."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def run(policy: RetryPolicy, fn: Flaky, *, reraise: bool = False) -> str:
    for attempt in policy.retrying(reraise=reraise):
        with attempt:
            return fn()
    raise AssertionError("unreachable")


def test_transient_errors_are_retried_until_an_answer() -> None:
    fn = Flaky(TransportError("reset"), Unavailable(503, "busy"), ServerError(500, "boom"))
    assert run(RetryPolicy(deadline=30, **FAST), fn) == "ok" and fn.calls == 4


def test_a_4xx_is_never_sent_again() -> None:
    fn = Flaky(Rejected(422, "bad"))
    with pytest.raises(Rejected):
        run(RetryPolicy(deadline=30, **FAST), fn, reraise=True)
    assert fn.calls == 1


def test_max_attempts_caps_the_tries_within_the_deadline() -> None:
    fn = Flaky(*[TransportError("reset")] * 10)
    with pytest.raises(RetryError) as exc:
        run(RetryPolicy(deadline=30, max_attempts=3, **FAST), fn)
    assert fn.calls == 3 and isinstance(exc.value.last_attempt.exception(), TransportError)


def test_the_deadline_ends_retries() -> None:
    """With a deadline of 0 the first failure is the last try: the caller's budget, not a count, decides."""
    fn = Flaky(*[Unavailable(503, "busy")] * 10)
    with pytest.raises(Unavailable):
        run(RetryPolicy(deadline=0, **FAST), fn, reraise=True)
    assert fn.calls == 1


def test_the_async_loop_keeps_the_same_policy() -> None:
    fn = Flaky(TransportError("reset"), Rejected(404, "no env"))

    async def main() -> None:
        async for attempt in RetryPolicy(deadline=30, **FAST).aretrying(reraise=True):
            with attempt:
                fn()

    with pytest.raises(Rejected):
        asyncio.run(main())
    assert fn.calls == 2
