"""Routes served without FastAPI's per-request machinery: documented from their endpoint's signature like any
other route (OpenAPI, the route's name in metrics), but each request goes straight to a plain
`handler(request) -> Response` that reads what it needs itself.

For the ingest routes only: there FastAPI's dependency solving, its exit stack and its parameter checks cost
more of the event loop than validating a small group does (issue 38). A handler so served checks its own
headers and raises the errors the app renders (its exception handlers still apply)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

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
