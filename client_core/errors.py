"""What can go wrong talking to rollbuf, as one tree for both clients, and the one predicate that decides
what is sent again.

```
ClientError                    base of every error trainer_client and rollout_client raise
 ├─ TransportError             no HTTP answer: refused, reset, timed out (retried, but for a malformed request)
 ├─ ServerError(status, detail, code, retry_after)
 │   │                         an error reply; a 5xx not below is transient: retried
 │   ├─ Unavailable            429/503: "not now", retried after Retry-After
 │   └─ Rejected               any other 4xx: the request is wrong; never retried
 └─ RetriesExhausted           retryable errors until the caller's deadline; `__cause__` is the last one
```

Each client adds the errors only it can meet under `ClientError` (`trainer_client.errors`: NotRegistered,
BatchGone, ServerUnreachable; `rollout_client.errors`: PromptTooLong, RunFailed, ...), so a program that
runs both sides catches one `ServerError`. `TrainerClientError` and `RolloutClientError`, the two sides'
former bases, are names of `ClientError`.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

FATAL_TRANSPORT = (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.ProxyError)
"""Transport errors of a request that cannot be sent at all: sending it again fails the same way."""


class ClientError(Exception):
    """Base of every error either client raises."""


class TransportError(ClientError):
    """The request never got an HTTP answer (refused, reset, timed out). `retryable` is false only for a
    request that cannot be sent at all (an unsupported scheme, a malformed request): sending it again fails
    the same way."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable

    @classmethod
    def from_httpx(cls, exc: httpx.TransportError, method: str, url: str) -> TransportError:
        return cls(f"{method} {url}: {type(exc).__name__}: {exc}", retryable=not isinstance(exc, FATAL_TRANSPORT))


class ServerError(ClientError):
    """An error reply. `detail` is the server's explanation (for a 422, a list naming each field and rule),
    `code` its machine-readable kind when it sent one, `retry_after` the seconds it asked to wait."""

    def __init__(
        self,
        status: int,
        detail: Any,
        code: str | None = None,
        retry_after: float | None = None,
        errors: list[Any] | None = None,
    ) -> None:
        self.status = status
        self.detail = detail
        self.code = code
        self.retry_after = retry_after
        self.errors = errors or []
        """rollbuf's `errors` of the reply (each with its `loc`: the field refused), when it sent them."""
        super().__init__(f"HTTP {status}: {describe_detail(detail)}")


class Unavailable(ServerError):
    """429/503: the server stored nothing and asks to be tried again later (Retry-After)."""


class Rejected(ServerError):
    """A 4xx other than 429: resending the same request will never work."""


class RetriesExhausted(ClientError):
    """Retryable errors kept coming until the caller's deadline; the last one is the `__cause__`."""


def describe_detail(detail: Any) -> str:
    """A 422 detail list as `loc: msg; ...` (the field and the rule); anything else as text."""
    if isinstance(detail, list) and detail and all(isinstance(d, dict) and "msg" in d for d in detail):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d['msg']}" for d in detail)
    return str(detail)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (the delta-seconds form rollbuf sends; an HTTP date is ignored)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return max(0.0, seconds)


def error_for_status(status: int, body: Any, retry_after: str | None) -> ServerError:
    """The exception for an error reply; `body` is the decoded JSON (or the text) the server sent."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    code = body.get("code") if isinstance(body, dict) else None
    errors = body.get("errors") if isinstance(body, dict) else None
    errors = errors if isinstance(errors, list) else None
    wait = parse_retry_after(retry_after)
    if status in (429, 503):
        return Unavailable(status, detail, code, wait, errors)
    if 400 <= status < 500:
        return Rejected(status, detail, code, errors=errors)
    return ServerError(status, detail, code, wait, errors)


def reply_body(response: httpx.Response) -> Any:
    """A reply's JSON, or its text when it is not JSON (a proxy's error page)."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text


def error_for(response: httpx.Response) -> ServerError:
    """`error_for_status` of an httpx error reply."""
    return error_for_status(response.status_code, reply_body(response), response.headers.get("Retry-After"))


def is_retryable(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed: transport failures (but a request that cannot be
    sent), 429, 503 and any other 5xx. A 4xx is a verdict on the request and is never retried."""
    if isinstance(exc, TransportError):
        return exc.retryable
    if isinstance(exc, httpx.TransportError):
        return not isinstance(exc, FATAL_TRANSPORT)
    if isinstance(exc, Unavailable):
        return True
    return isinstance(exc, ServerError) and not isinstance(exc, Rejected) and exc.status >= 500
