"""An httpx transport over the standard library's `http.client`, for bodies of tens of megabytes.

httpx's own HTTP/1.1 stack (httpcore + h11) receives a body in 64 KiB steps and copies every byte about
five times on the way; for a 25 MB batch that is ~37 ms on loopback where `http.client` reads the whole
body into one `bytes` in ~10 ms, as fast as a raw socket (bench/transport.py). This transport keeps
httpx's API (timeouts, errors, MockTransport-compatible clients) and only replaces the wire. It keeps
one idle connection per origin for reuse.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from typing import Any

import httpx


class StdlibTransport(httpx.BaseTransport):
    """HTTP/1.1 with keep-alive via `http.client`; https uses the default SSL context."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeout: dict[str, float | None] = request.extensions.get("timeout", {})
        with self._lock:
            conn = self._idle.pop(origin, None)
        fresh = conn is None
        if conn is None:
            conn = self._connect(origin, timeout.get("connect"), request)
        target = url.raw_path.decode("ascii")
        try:
            assert conn.sock is not None
            conn.sock.settimeout(timeout.get("write"))
            conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.raw:
                conn.putheader(name.decode("latin-1"), value.decode("latin-1"))
            conn.endheaders(request.read() or None)
            conn.sock.settimeout(timeout.get("read"))
            reply = conn.getresponse()
            body = reply.read()  # straight into one bytes object: no chunking, no extra copies
        except TimeoutError as exc:
            conn.close()
            raise httpx.ReadTimeout(f"no reply within the read timeout: {exc}", request=request) from exc
        except (http.client.HTTPException, OSError) as exc:
            conn.close()
            if not fresh and isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError):
                return self.handle_request(request)  # the server closed an idle keep-alive connection: reconnect
            raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}", request=request) from exc
        if reply.will_close:
            conn.close()
        else:
            with self._lock:
                old = self._idle.pop(origin, None)
                self._idle[origin] = conn
            if old is not None:
                old.close()
        return httpx.Response(
            reply.status,
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.getheaders()],
            stream=httpx.ByteStream(body),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    @staticmethod
    def _connect(
        origin: tuple[str, str, int], timeout: float | None, request: httpx.Request
    ) -> http.client.HTTPConnection:
        scheme, host, port = origin
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme!r}", request=request)
        kwargs: dict[str, Any] = {"timeout": timeout}
        conn = (
            http.client.HTTPSConnection(host, port, **kwargs)
            if scheme == "https"
            else http.client.HTTPConnection(host, port, **kwargs)
        )
        try:
            conn.connect()
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port}: {exc}", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"connecting to {host}:{port}: {exc}", request=request) from exc
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle.values()), {}
        for conn in idle:
            conn.close()


class AsyncStdlibTransport(httpx.AsyncBaseTransport):
    """`StdlibTransport` for `httpx.AsyncClient`: each request runs in a worker thread. A cancelled request
    finishes in its thread (at most its read timeout) before the connection is reused."""

    def __init__(self) -> None:
        self._sync = StdlibTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return await asyncio.to_thread(self._sync.handle_request, request)

    async def aclose(self) -> None:
        self._sync.close()
