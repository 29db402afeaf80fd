"""The service's exception tree. Routes raise these; one handler in `api.app` renders them.

Atropos rollout handlers drop data on any 4xx and retry 5xx, so the status code is a promise:
4xx means "this data is bad, resending it will never work"; 503 means "try again later".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Loc = Sequence[str | int]


class RollbufError(Exception):
    status_code = 400
    code = "bad_request"

    def __init__(self, detail: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers


class InvalidData(RollbufError):
    """Data that breaks a rule; `detail` has FastAPI's 422 shape, so clients parse one format."""

    status_code = 422
    code = "invalid"

    def __init__(self, loc: Loc, msg: str) -> None:
        super().__init__([{"loc": list(loc), "msg": msg, "type": "value_error"}])
        self.loc = tuple(loc)
        self.msg = msg

    def at(self, *prefix: str | int) -> InvalidData:
        """The same error located under a parent (the request body, an item of a list)."""
        return InvalidData((*prefix, *self.loc), self.msg)

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.loc))}: {self.msg}"


class Conflict(RollbufError):
    status_code = 409
    code = "conflict"


class NotFound(RollbufError):
    status_code = 404
    code = "not_found"


class Gone(RollbufError):
    status_code = 410
    code = "gone"


class BadEncoding(RollbufError):
    status_code = 400
    code = "bad_encoding"


class PayloadTooLarge(RollbufError):
    status_code = 413
    code = "payload_too_large"


class Unavailable(RollbufError):
    """Try again later: queue full, store busy. Atropos handlers retry 5xx, so this never loses data."""

    status_code = 503
    code = "unavailable"

    def __init__(self, detail: Any, retry_after: float = 1.0) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, round(retry_after)))})
