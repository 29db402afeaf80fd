"""What can go wrong when a trainer talks to the buffer, as exceptions a trainer can act on.

```
TrainerClientError
 ├─ ServerUnreachable(url, tries)     connect/read failures on every one of `tries` attempts
 ├─ NotRegistered                     /batch before /register (or after /reset_data): register again
 └─ ServerError(status, code, detail, response)
     ├─ Unavailable                   429/5xx: retried after Retry-After, raised when retries run out
     └─ Rejected                      other 4xx: the request is wrong; never retried
         └─ BatchGone(step)           410: batch N was acknowledged (N+1 was asked for) and is gone
```

`is_retryable(exc)` is the one predicate the clients' retry loops use.
"""

from __future__ import annotations

from typing import Any

import httpx


class TrainerClientError(Exception):
    """Base of every error `trainer_client` raises."""


class ServerUnreachable(TrainerClientError):
    def __init__(self, url: str, tries: int, cause: BaseException) -> None:
        super().__init__(f"{url} unreachable after {tries} tries: {type(cause).__name__}: {cause}")
        self.url = url
        self.tries = tries
        self.cause = cause


class NotRegistered(TrainerClientError):
    """The server has no trainer registration: call `register(...)` first."""


class ServerError(TrainerClientError):
    """An HTTP error reply; `detail` is the server's explanation (for 422, a list naming fields and rules)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status = response.status_code
        self.code: str | None = None
        self.detail: Any = response.text
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            self.detail = body.get("detail", body)
            self.code = body.get("code")
        super().__init__(f"{self.status} from {response.request.method} {response.request.url.path}: {self.detail}")

    @property
    def retry_after(self) -> float | None:
        """Seconds the server asked to wait (Retry-After), if it said."""
        value = self.response.headers.get("retry-after", "")
        try:
            return max(0.0, float(value))
        except ValueError:
            return None


class Unavailable(ServerError):
    """The server is overloaded or failing (429, 5xx); the request may succeed later."""


class Rejected(ServerError):
    """The server refused the request as it is (4xx): sending it again will not help."""


class BatchGone(Rejected):
    def __init__(self, response: httpx.Response, step: int) -> None:
        super().__init__(response)
        self.step = step


def error_for(response: httpx.Response, step: int | None = None) -> ServerError:
    """The exception for an error reply (status >= 400)."""
    if response.status_code == 410 and step is not None:
        return BatchGone(response, step)
    if response.status_code == 429 or response.status_code >= 500:
        return Unavailable(response)
    return Rejected(response)


def is_retryable(exc: BaseException) -> bool:
    """Whether sending the same request again may succeed: timeouts, dropped connections, 429 and 5xx.

    Retrying a GET /batch?step=N is always safe (the server serves batch N again). Protocol errors in the
    request itself (an invalid URL, an unsupported scheme) are not retried.
    """
    if isinstance(exc, Unavailable):
        return True
    if isinstance(exc, httpx.TransportError):
        return not isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.ProxyError)
    return False
