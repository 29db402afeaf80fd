"""What can go wrong talking to rollbuf, as a small tree, and the pure predicate that decides what to retry.

```
RolloutClientError
 ├─ TransportError        connect/read timeout, reset, server gone: retryable
 ├─ ServerError(status, code, detail)
 │   ├─ Unavailable       429/503 (queue full, store busy): retryable after Retry-After
 │   └─ Rejected          any other 4xx: the data or request is wrong; never retried
 ├─ RetriesExhausted      the retry deadline passed; `__cause__` is the last error
 └─ PromptTooLong         a prompt leaves no room for a completion; the group is skipped and counted
```
"""

from __future__ import annotations

from typing import Any


class RolloutClientError(Exception):
    """Base of every error the rollout client raises."""


class TransportError(RolloutClientError):
    """The request never got an HTTP answer (refused, reset, timed out)."""


class ServerError(RolloutClientError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: Any, code: str | None = None, retry_after: float | None = None) -> None:
        self.status = status
        self.detail = detail
        self.code = code
        self.retry_after = retry_after
        super().__init__(f"HTTP {status}: {describe_detail(detail)}")


class Unavailable(ServerError):
    """429/503: try again later (the server stored nothing)."""


class Rejected(ServerError):
    """4xx other than 429: resending the same request will never work."""


class RetriesExhausted(RolloutClientError):
    """Retryable errors kept coming until the deadline; the last one is the `__cause__`."""


class PromptTooLong(RolloutClientError):
    """The prompt already fills the token budget (trainer's max_token_len or the model's context)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        super().__init__(f"prompt of {prompt_tokens} tokens leaves no room for a completion within {limit} tokens")


def describe_detail(detail: Any) -> str:
    """A 422 detail list as `loc: msg; ...` (the field and the rule); anything else as text."""
    if isinstance(detail, list) and detail and all(isinstance(d, dict) and "msg" in d for d in detail):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d['msg']}" for d in detail)
    return str(detail)


def error_for_status(status: int, body: Any, retry_after: str | None) -> ServerError:
    """The exception for an error reply; `body` is the decoded JSON (or text) the server sent."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    code = body.get("code") if isinstance(body, dict) else None
    wait = parse_retry_after(retry_after)
    if status in (429, 503):
        return Unavailable(status, detail, code, wait)
    if 400 <= status < 500:
        return Rejected(status, detail, code)
    return ServerError(status, detail, code, wait)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form; the HTTP-date form is not used by rollbuf)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(0.0, seconds)


def is_retryable(exc: BaseException) -> bool:
    """True for errors where sending the same request again may succeed: transport failures, 429/503 and
    other 5xx. A 4xx is a verdict on the request and is never retried."""
    if isinstance(exc, TransportError | Unavailable):
        return True
    if isinstance(exc, Rejected):
        return False
    return isinstance(exc, ServerError) and exc.status >= 500
