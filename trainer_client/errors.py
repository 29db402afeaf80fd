"""What can go wrong when a trainer talks to the buffer: the shared tree (`client_core.errors`) and the
errors only a trainer meets.

```
ClientError (= TrainerClientError)
 ├─ TransportError                    no HTTP answer (retried)
 ├─ ServerError(status, detail, code)   another 5xx: retried
 │   ├─ Unavailable                   429/503: retried after Retry-After, raised when the deadline passes
 │   └─ Rejected                      other 4xx: the request is wrong; never retried
 │       └─ BatchGone(step)           410: batch N was acknowledged (N+1 was asked for) and is gone
 ├─ RetriesExhausted
 │   └─ ServerUnreachable(url, tries) no answer on any try until the retry deadline
 └─ NotRegistered                     /batch before /register (or after /reset_data): register again
```
"""

from __future__ import annotations

import httpx

from client_core.errors import (
    ClientError,
    Rejected,
    RetriesExhausted,
    ServerError,
    Unavailable,
    error_for_status,
    is_retryable,
    reply_body,
)

TrainerClientError = ClientError
"""The trainer side's base, which is the shared one: `except TrainerClientError` catches every error."""

__all__ = [
    "BatchGone",
    "ClientError",
    "NotRegistered",
    "Rejected",
    "RetriesExhausted",
    "ServerError",
    "ServerUnreachable",
    "NoProgress",
    "TrainerClientError",
    "Unavailable",
    "error_for",
    "is_retryable",
]


class ServerUnreachable(RetriesExhausted):
    """No HTTP answer on any of `tries` tries until the retry deadline; `cause` (and `__cause__`) is the
    last transport error."""

    def __init__(self, url: str, tries: int, cause: BaseException) -> None:
        super().__init__(f"{url} unreachable after {tries} tries: {cause}")
        self.url = url
        self.tries = tries
        self.cause = cause


class NotRegistered(ClientError):
    """The server has no trainer registration: call `register(...)` first."""


class BatchGone(Rejected):
    """410 for `?step=N`: batch N was acknowledged (N+1 was asked for) and is gone."""

    def __init__(self, error: ServerError, step: int) -> None:
        super().__init__(error.status, error.detail, error.code)
        self.step = step


def error_for(response: httpx.Response, step: int | None = None) -> ServerError:
    """The exception for an error reply (status >= 400); a 410 for `?step=` is BatchGone."""
    error = error_for_status(response.status_code, reply_body(response), response.headers.get("Retry-After"))
    if response.status_code == 410 and step is not None:
        return BatchGone(error, step)
    return error


class NoProgress(TrainerClientError):
    """The server said for `no_progress_timeout` s that nothing can arrive (its `stall_reason`: no live producer
    for the run's envs, or every live one held back waiting for the trainer); the message is its reason."""

    def __init__(self, reason: str, waited: float) -> None:
        super().__init__(f"no batch can come: for {waited:.0f} s the server has said: {reason}")
        self.reason = reason
        self.waited = waited
