"""Routes served without FastAPI's per-request machinery: documented from their endpoint's signature like any
other route (OpenAPI, the route's name in metrics), but each request goes straight to a plain
`handler(request) -> Response` that reads what it needs itself.

For the ingest routes only: there FastAPI's dependency solving, its exit stack and its parameter checks cost
more of the event loop than validating a small group does. A handler so served checks its own
headers and raises the errors the app renders (its exception handlers still apply).

`DirectLane` goes one step further: a request for such a route is handed to its handler from the middleware
stack, past Starlette's routing (a regex per route, ~70 of them), the gzip middleware, the exception
middleware and FastAPI's exit stack, which together cost the event loop about as much as the handler's own
work on a small group. What those layers do for these routes, it does itself: the route in the scope (the
metrics' label), the app's exception handlers, gzip of a large answer."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi.routing import APIRoute, iter_route_contexts
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.body import gzip_compress

Handler = Callable[[Request], Awaitable[Response]]
F = TypeVar("F", bound=Callable[..., Any])
_HANDLERS: dict[Callable[..., Any], Handler] = {}


def served_by(handler: Handler) -> Callable[[F], F]:
    """Mark a route's endpoint as served by `handler` (on a router whose `route_class` is `DirectRoute`)."""

    def mark(endpoint: F) -> F:
        _HANDLERS[endpoint] = handler
        return endpoint

    return mark


class DirectRoute(APIRoute):
    """An `APIRoute` whose marked endpoints (`served_by`) are served by their plain handler."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = _HANDLERS.get(self.endpoint)
        return handler if handler is not None else super().get_route_handler()


Lane = dict[tuple[str, str], tuple[DirectRoute, Handler]]


class DirectLane:
    """Pure-ASGI middleware, placed inside the front door and outside everything else (gzip included): a
    request whose method and path are a direct route's goes to that route's handler; any other request, and
    any under a `root_path`, goes on down the stack. Unhandled exceptions propagate as they would from the
    router (the server-error middleware answers them)."""

    def __init__(self, app: ASGIApp, *, gzip_min: int, gzip_level: int, gzip_skip: tuple[str, ...]) -> None:
        self.app = app
        self.gzip_min = gzip_min
        self.gzip_level = gzip_level
        self.gzip_skip = frozenset(gzip_skip)
        self.lane: Lane | None = None
        self.handlers: dict[Any, Callable[..., Any]] = {}

    def _build(self, scope: Scope) -> Lane:
        """The direct routes by (method, path), and the app's exception handlers but the last-resort one
        (`Exception` / 500 is the server-error middleware's, as in `FastAPI.build_middleware_stack`)."""
        app = scope["app"]
        lane: Lane = {}
        for ctx in iter_route_contexts(app.routes):  # as routing sees them: included routers' prefixes applied
            route = ctx.original_route
            handler = _HANDLERS.get(getattr(route, "endpoint", None))  # type: ignore[arg-type]
            if isinstance(route, DirectRoute) and handler is not None and ctx.path and not ctx.param_convertors:
                for method in ctx.methods or ():
                    lane[(method, ctx.path)] = (route, handler)
        self.handlers = {k: v for k, v in app.exception_handlers.items() if k not in (500, Exception)}
        self.lane = lane
        return lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        lane = self.lane if self.lane is not None else self._build(scope)
        found = lane.get((scope["method"], scope["path"]))
        if found is None:
            await self.app(scope, receive, send)
            return
        route, handler = found
        scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, {}
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await self._rendered(request, exc)
        await self._gzipped(scope, response)(scope, receive, send)

    async def _rendered(self, request: Request, exc: Exception) -> Response:
        """`exc` answered by the app's handler for it, as Starlette's exception middleware would; re-raised
        when only the last-resort handler applies."""
        handler = self.handlers.get(exc.status_code) if isinstance(exc, HTTPException) else None
        if handler is None:
            handler = next((self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None)
        if handler is None:
            raise exc
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        exc.__traceback__ = None  # reused exception instances would accumulate tracebacks
        assert isinstance(response, Response)
        return response

    def _gzipped(self, scope: Scope, response: Response) -> Response:
        """The gzip middleware's rule on a whole answer: large enough, not binary, the client accepts gzip."""
        body = getattr(response, "body", b"")  # a streamed answer is left as it is
        if len(body) < self.gzip_min or "content-encoding" in response.headers:
            return response
        if response.headers.get("content-type", "").split(";", 1)[0].strip().lower() in self.gzip_skip:
            return response
        accept = next((v for k, v in scope["headers"] if k == b"accept-encoding"), b"")
        if b"gzip" not in accept:
            return response
        response.body = gzip_compress(bytes(body), self.gzip_level)
        response.headers["content-encoding"] = "gzip"
        response.headers["content-length"] = str(len(response.body))
        response.headers.add_vary_header("Accept-Encoding")
        return response
