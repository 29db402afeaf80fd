"""The front door: every request is checked here, on its headers alone, before any route runs or any byte of
its body is read (docs/security.md).

In order: the `Host` (DNS rebinding: a page whose name resolves to 127.0.0.1 must not reach a loopback
server), browser-originated cross-site requests (an `Origin` of another site, `Sec-Fetch-Site: cross-site`:
a web page opened on the machine must not reset the run or inject groups), the caller's key and role
(`api.keys.access`), a body type a browser may send cross-site without asking (`text/plain`, forms) on the
routes that take JSON, and the body's size: declared sizes past the route's limit are refused before
reading, and a body that keeps coming past it is cut off. Pure ASGI, like `api.http.middleware`.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body
from api.keys.access import ANONYMOUS, PUBLIC, Identity, Key, RouteTable, identify
from api.owners import ANYONE, Actor, actor

SMALL_BODY = 64 * 1024
"""Body limit of every route but the ingest ones: registrations and env ids are a few hundred bytes."""
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
"""Body types a browser sends cross-site without a CORS preflight."""
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True, slots=True)
class Door:
    """What the front door enforces, from the settings."""

    keys: Callable[[], list[Key]] | None
    """The current keys (a reloadable file's), or None: no keys, every caller may do everything."""
    allowed_hosts: tuple[str, ...] | None
    """`Host` names accepted (`*.example.com` for subdomains), or None: any."""
    allow_simple_types: bool
    max_ingest_body: int
    routes: RouteTable
    """Each route's roles and body rule, as declared beside it (`api.routes.table`)."""


@functools.lru_cache(maxsize=1024)
def loopback_host(host: str) -> bool:
    """`localhost`, `*.localhost`, or a loopback address (with or without a port, IPv6 in brackets).
    Remembered: a keyless loopback server asks it of every request's `Host`, and parsing an address costs
    more than the rest of the front door (the cache is bounded: a `Host` is the client's to choose)."""
    name = _hostname(host)
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str | None, allowed: tuple[str, ...] | None) -> bool:
    if allowed is None:
        return True
    if host is None:
        return False
    name = _hostname(host)
    for pattern in allowed:
        if pattern == "*" or pattern == name or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
        if pattern == "loopback" and loopback_host(host):
            return True
    return False


def cross_site(headers: dict[bytes, bytes], host: str | None) -> str | None:
    """Why the request comes from another site's page, or None. Atropos clients send neither header."""
    site = headers.get(b"sec-fetch-site")
    if site in (b"cross-site", b"same-site"):
        return f"Sec-Fetch-Site: {site.decode('latin-1')}"
    origin = headers.get(b"origin")
    if origin is not None and origin != b"null":
        origin_host = origin.decode("latin-1").split("://", 1)[-1]
        if host is None or origin_host.lower() != host.lower():
            return f"Origin {origin.decode('latin-1')!r}"
    elif origin == b"null":
        return "Origin null"
    return None


class FrontDoor:
    def __init__(self, app: ASGIApp, door: Door) -> None:
        self.app = app
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        door = self.door
        headers = dict(scope["headers"])
        method, path = scope["method"], scope["path"]
        raw_host = headers.get(b"host")
        host = None if raw_host is None else raw_host.decode("latin-1")
        rule, acts = door.routes.declared(method, path)
        body = door.routes.body(path)
        if not host_allowed(host, door.allowed_hosts):
            await _refuse(
                send, 421, "misdirected", f"Host {host!r} is not one this server answers to", ["header", "host"]
            )
            return
        if rule != PUBLIC and (why := cross_site(headers, host)):
            await _refuse(send, 403, "forbidden", f"cross-site request refused ({why})", ["header", "origin"])
            return
        identity = ANONYMOUS
        if door.keys is not None and rule != PUBLIC:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            found = identify(door.keys(), token.strip() if scheme.lower() == "bearer" else None)
            if found is None:
                await _refuse(
                    send,
                    401,
                    "unauthorized",
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    ["header", "authorization"],
                    {"www-authenticate": "Bearer"},
                )
                return
            if found.role not in rule:
                roles = " or ".join(sorted(rule))
                await _refuse(
                    send,
                    403,
                    "forbidden",
                    f"{method} {path} needs a key of role {roles}; {found.name!r} is {found.role}",
                    ["header", "authorization"],
                )
                return
            identity = found
        state = scope.setdefault("state", {})
        state["identity"], state["actor"] = identity, actor(identity, acts)
        if body != "small" and not door.allow_simple_types:
            ctype = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
            if ctype in SIMPLE_TYPES:
                await _refuse(
                    send,
                    415,
                    "unsupported_media_type",
                    f"Content-Type {ctype} is refused on {path} (a "
                    "browser sends it cross-site without asking): send application/json",
                    ["header", "content-type"],
                )
                return
        limit = door.max_ingest_body if body == "ingest" else SMALL_BODY
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(
                send,
                413,
                "payload_too_large",
                f"request body of {int(declared)} bytes exceeds the limit of {limit} for {path}",
                ["body"],
            )
            return
        await self.app(scope, *_bounded(receive, send, limit, path))


def _bounded(receive: Receive, send: Send, limit: int, path: str) -> tuple[Receive, Send]:
    """`receive` cut off past `limit` body bytes (answered 413 here, the app then sees a disconnect) and a
    `send` that drops what the app answers after that."""
    received = 0
    refused = False
    started = False

    async def bounded_receive() -> Message:
        nonlocal received, refused
        if refused:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                refused = True
                if not started:
                    await _refuse(
                        send,
                        413,
                        "payload_too_large",
                        f"request body exceeds the limit of {limit} bytes for {path}",
                        ["body"],
                    )
                return {"type": "http.disconnect"}
        return message

    async def guarded_send(message: Message) -> None:
        nonlocal started
        if refused:
            return
        if message["type"] == "http.response.start":
            started = True
        await send(message)

    return bounded_receive, guarded_send


async def _refuse(
    send: Send, status: int, code: str, msg: str, loc: list[Any], extra: dict[str, str] | None = None
) -> None:
    body = orjson.dumps(error_body(code, [{"loc": loc, "msg": msg, "type": code}], msg))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def still_admitted(door: Door | None, scope: Scope) -> bool:
    """Whether the request's key still admits it (a long request asks again at each step: a key revoked or
    rotated in the key file meanwhile ends it). True without keys."""
    if door is None or door.keys is None or identity_of(scope) is ANONYMOUS:
        return True
    auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    found = identify(door.keys(), token.strip() if scheme.lower() == "bearer" else None)
    rule = door.routes.admits(scope["method"], scope["path"])
    return found is not None and (rule == PUBLIC or found.role in rule)


def actor_of(scope: Scope) -> Actor:
    """The caller as the route's declaration lets it act (`api.owners`): set by the front door; in an app built
    without the door, the anonymous caller, who acts on everything."""
    found = scope.get("state", {}).get("actor")
    return found if isinstance(found, Actor) else ANYONE


def identity_of(scope: Scope) -> Identity:
    """The caller the front door let in (ANONYMOUS without keys, or in an app built without the door)."""
    found = scope.get("state", {}).get("identity")
    return found if isinstance(found, Identity) else ANONYMOUS
