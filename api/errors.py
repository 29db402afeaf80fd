"""The service's exception tree. Routes raise these; one handler in `api.app` renders them.

Atropos rollout handlers drop data on any 4xx and retry 5xx, so the status code is a promise:
4xx means "this data is bad, resending it will never work"; 503 means "try again later".

Every error reply, these and FastAPI's own (pydantic's 422, 404, 405, 400), has one shape (`error_body`,
`api.wire.schema.ErrorBody`): `code`, `message`, `errors` (each with `loc`, `msg`, `type`), and `detail` as
FastAPI writes it (the list of errors for a 422, a string otherwise), which Atropos-era clients read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Loc = Sequence[str | int]


class RollbufError(Exception):
    status_code = 400
    code = "bad_request"
    loc: tuple[str | int, ...] = ()
    """Where the problem is (`body`, `query`, `header`, then the field), when it is in one place."""

    def __init__(self, detail: Any, headers: dict[str, str] | None = None, loc: Loc | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers
        if loc is not None:
            self.loc = tuple(loc)

    def errors(self) -> list[dict[str, Any]]:
        """The `errors` of the reply: one, at `loc`, whose rule is the message."""
        return [{"loc": list(self.loc), "msg": str(self.detail), "type": self.code}]


class InvalidData(RollbufError):
    """Data that breaks a rule; `detail` has FastAPI's 422 shape, so clients parse one format."""

    status_code = 422
    code = "invalid"

    def __init__(self, loc: Loc, msg: str) -> None:
        super().__init__([{"loc": list(loc), "msg": msg, "type": "value_error"}])
        self.loc = tuple(loc)
        self.msg = msg

    def errors(self) -> list[dict[str, Any]]:
        return list(self.detail)

    def at(self, *prefix: str | int) -> InvalidData:
        """The same error located under a parent (the request body, an item of a list)."""
        return InvalidData((*prefix, *self.loc), self.msg)

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.loc))}: {self.msg}"


class Conflict(RollbufError):
    """What the request says contradicts what is stored (another content for an acknowledged slot, another spec
    for an opened group): the same request again cannot succeed."""

    status_code = 409
    code = "conflict"


class Forbidden(RollbufError):
    """The caller's key may not do this (its role, or another key's env)."""

    status_code = 403
    code = "forbidden"


class NotFound(RollbufError):
    """What the request names does not exist (a group, a dataset, a ledger row)."""

    status_code = 404
    code = "not_found"


class Gone(RollbufError):
    """What the request names existed and is no longer kept (a batch acknowledged or committed past)."""

    status_code = 410
    code = "gone"


class BadEncoding(RollbufError):
    """The body is not in the encoding its headers name (Content-Encoding, Content-Type)."""

    status_code = 400
    code = "bad_encoding"
    loc = ("body",)


class PayloadTooLarge(RollbufError):
    """The body is larger than its bound (`max_body_bytes`; decompressed, `max_decompressed_bytes`)."""

    status_code = 413
    code = "payload_too_large"
    loc = ("body",)


class Unavailable(RollbufError):
    """Try again later: queue full, store busy. Atropos handlers retry 5xx, so this never loses data."""

    status_code = 503
    code = "unavailable"

    def __init__(self, detail: Any, retry_after: float = 1.0) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, round(retry_after)))})


class NotInstalled(RollbufError):
    """The server lacks an optional extra this route needs (the export's pyarrow): installing it is the fix."""

    status_code = 501
    code = "not_installed"


HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    410: "gone",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid",
    500: "internal",
    501: "not_installed",
    503: "unavailable",
}
"""`code` of an error raised by FastAPI or Starlette rather than by rollbuf, by HTTP status."""


def error_body(code: str, errors: list[dict[str, Any]], detail: Any) -> dict[str, Any]:
    """The one shape of every error reply; `message` is the errors in one line (`loc: msg; ...`)."""
    items: list[dict[str, Any]] = []
    lines: list[str] = []
    for e in errors:
        loc, msg = list(e.get("loc", ())), str(e.get("msg", ""))
        items.append({"loc": loc, "msg": msg, "type": str(e.get("type", code))})
        lines.append(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg)
    return {"code": code, "message": "; ".join(lines), "errors": items, "detail": detail}
