"""One pure-ASGI middleware per request: its id (X-Request-ID echoed, or made), its duration into
`rollbuf_request_duration_seconds{route,method}`, and a debug log line. Pure ASGI because Starlette's
`BaseHTTPMiddleware` costs a task and a stream per request on the ingest hot path."""

from __future__ import annotations

import itertools
import logging
import secrets
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.logs import request_env, request_id
from api.meters import REQUEST_SECONDS, sample_process

log = logging.getLogger("rollbuf.request")

HEADER = b"x-request-id"
MAX_ID_LEN = 128
_ID_PREFIX = secrets.token_hex(4)
_ID_COUNTER = itertools.count()
"""Request ids made here: this process's random prefix and a counter (16 hex digits, unique within the process
and unlikely to repeat across processes). `secrets.token_hex` per request was a system call on every request."""
UNMATCHED = "(unmatched)"
"""The route label of requests no route matched: a scanner's random paths never become label values."""


def _incoming_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == HEADER:
            text: str = value.decode("latin-1")
            if 0 < len(text) <= MAX_ID_LEN and text.isprintable():
                return text
            return None
    return None


class ObserveRequests:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = _incoming_id(scope) or f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFF:08x}"
        rid_token = request_id.set(rid)
        env_token = request_env.set(None)
        status = 500
        raw_id = rid.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (HEADER, raw_id)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            now = time.perf_counter()
            elapsed = now - start
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED
            method = scope["method"]
            REQUEST_SECONDS.labels(template, method, str(status)).observe(elapsed)
            sample_process(time.monotonic())
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s %d %.1f ms request_id=%s", method, scope["path"], status, elapsed * 1000, rid)
            request_env.reset(env_token)
            request_id.reset(rid_token)
