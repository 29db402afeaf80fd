"""The HTTP connection layer `rollbuf serve` runs: uvicorn's httptools protocol with the bounds it lacks.

uvicorn's default parser has no limit on a request's head (one 100 MB header was read whole, its cost growing
with the square of its size, before any auth), no timeout while a head or a body is coming in (headers one
byte per second, or a body that never ends, held a connection forever) and none on a connection that never
sends anything; and nothing bounds the connections held (1,100 idle ones used up a 1,024-descriptor limit,
and innocent clients got resets). Here: a head is at most `max_header_bytes` (431 past it), must be complete
within `header_timeout` of its first byte or of the connection (408), a body may pause at most `body_timeout`
between two chunks and must average `min_body_rate` (it must have arrived within `body_timeout` plus its bytes
over that rate: 408 beyond, so a body dribbled a byte every 20 s ends within `body_timeout`), and past
`max_connections` a connection is closed to make room for a new one, whatever its state: the one idle longest,
else the one sending its head or body slowest (bytes per second since it began). A connection whose request is
whole and waits for its answer (a long-poll) is the server's to finish and is never closed for room.
Refusals use the service's one error shape.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.config.groups import REQUESTS
from api.errors import error_body

log = logging.getLogger("rollbuf")

RESERVED_FDS = 64
"""Descriptors kept free of connections: the store's files, logs, the listening socket."""
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class ConnectionLimits:
    """The bounds, set once per process from the settings (`configure`); until then, the settings' defaults."""

    max_header_bytes = REQUESTS.max_header_bytes
    header_timeout = REQUESTS.header_timeout
    body_timeout = REQUESTS.body_timeout
    max_connections = REQUESTS.max_connections
    min_body_rate = REQUESTS.min_body_rate


def configure(
    max_header_bytes: int,
    header_timeout: float,
    body_timeout: float,
    max_connections: int,
    min_body_rate: int = REQUESTS.min_body_rate,
) -> int:
    """Set this process's bounds; `max_connections` is lowered to what the descriptor limit leaves. Returns it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(16, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else max_connections
    ConnectionLimits.max_header_bytes = max_header_bytes
    ConnectionLimits.header_timeout = header_timeout
    ConnectionLimits.body_timeout = body_timeout
    ConnectionLimits.min_body_rate = min_body_rate
    ConnectionLimits.max_connections = min(max_connections, room)
    return ConnectionLimits.max_connections


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with head, time and connection bounds (see the module's docstring)."""

    _last_evict_log: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._idle_since = time.monotonic()
        self._began = self._idle_since  # when the head or body now arriving began
        self._body_bytes = 0
        self._in_body = False

    # --- connections ---
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()
        if len(self.connections) > ConnectionLimits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        return (self.cycle is None or self.cycle.response_complete) and (self._in_head or self._head_bytes == 0)

    def _progress(self, now: float) -> float | None:
        """Bytes per second of the head or body now arriving; None for a connection waiting on the server (its
        request whole, its answer not yet sent: never closed for room)."""
        if self._in_body:
            return self._body_bytes / max(now - self._began, 1e-3)
        if self._in_head and self._head_bytes:
            return self._head_bytes / max(now - self._began, 1e-3)
        return None

    def _make_room(self) -> None:
        others = [c for c in self.connections if isinstance(c, BoundedHttpToolsProtocol) and c is not self]
        idle = [c for c in others if c._idle()]
        now = time.monotonic()
        if idle:
            victim, why = min(idle, key=lambda c: c._idle_since), "the longest idle"
        else:
            sending = [(rate, c) for c in others if (rate := c._progress(now)) is not None]
            if not sending:
                return  # every connection waits on the server: this one waits its turn in the kernel's buffers
            victim, why = min(sending, key=lambda rc: rc[0])[1], "the slowest sending a request"
        if now - BoundedHttpToolsProtocol._last_evict_log > 10:
            BoundedHttpToolsProtocol._last_evict_log = now
            log.warning("%d connections (max_connections): closing %s to make room", len(self.connections), why)
        victim.transport.close()

    # --- the head ---
    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > ConnectionLimits.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, "headers_too_large", f"request head over {ConnectionLimits.max_header_bytes} bytes")
        elif self._in_body:
            self._too_slow(time.monotonic())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._began = time.monotonic()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.more_body:
            self._in_body = True
            self._body_bytes = 0
            self._began = time.monotonic()
            self._arm_body_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(ConnectionLimits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            if self._head_bytes:
                self._refuse(408, "timeout", f"request head not complete within {ConnectionLimits.header_timeout:g} s")
            else:
                self.transport.close()  # a connection that never sent anything: nothing to answer

    # --- the body ---
    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_bytes += len(body)
        self._arm_body_timer()

    def _too_slow(self, now: float) -> bool:
        """Refuse (408) a body behind `min_body_rate` (see the module); True if it was."""
        allowed = ConnectionLimits.body_timeout + self._body_bytes / ConnectionLimits.min_body_rate
        if now - self._began <= allowed or self.transport.is_closing() or self.flow.read_paused:
            return False
        msg = (
            f"request body too slow: {self._body_bytes} bytes in {now - self._began:.0f} s, below the minimum rate "
            f"(min_body_rate {ConnectionLimits.min_body_rate} bytes/s "
            f"after body_timeout {ConnectionLimits.body_timeout:g} s)"
        )
        log.info("%s", msg)
        if self.cycle is not None and not self.cycle.response_started:
            self._refuse(408, "timeout", msg)
        else:
            self.transport.close()
        return True

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0

    def _arm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(ConnectionLimits.body_timeout, self._body_timed_out)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server is behind, not the client: wait on
            self._arm_body_timer()
            return
        if self._too_slow(time.monotonic()):
            return
        log.info("closing a connection whose body paused over %g s (body_timeout)", ConnectionLimits.body_timeout)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = time.monotonic()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    # --- refusals in the service's error shape ---
    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "bad_request", msg)

    def _refuse(self, status: int, code: str, msg: str) -> None:
        body = orjson.dumps(error_body(code, [{"loc": ["header"], "msg": msg, "type": code}], msg))
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], len(body))
        )
        self.transport.write(head + body)
        self.transport.close()
        self._cancel_timers()
