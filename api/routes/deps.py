"""Dependencies the routes declare: the service, the settings and the caller as its route lets it act, as
`Annotated` aliases.

They are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread, and two thread
hops per request cost more than the whole of parsing a group on the ingest path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

from api.config.settings import Settings
from api.http.frontdoor import actor_of, identity_of
from api.http.inflight import Hold
from api.keys.access import ANONYMOUS
from api.owners import Actor
from api.service import Service


async def get_service(request: Request) -> Service:
    return request.app.state.service  # type: ignore[no-any-return]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_actor(request: Request) -> Actor:
    """The caller, as the front door made it from its key and the route's declaration (`api.owners`)."""
    return actor_of(request.scope)


def holder(request: Request) -> str:
    """Whose share of the body budget a request takes: its key's name, or on a keyless server its address."""
    identity = identity_of(request.scope)
    if identity is not ANONYMOUS:
        return f"key {identity.name!r}"
    return f"client {request.client.host}" if request.client else "client ?"


async def body_hold(request: Request) -> AsyncIterator[Hold]:
    """The request's share of the process's body budget (`api.http.inflight`), given back when the request ends."""
    hold: Hold = request.app.state.body_budget.hold(holder(request))
    try:
        yield hold
    finally:
        hold.release()


ServiceDep = Annotated[Service, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
BodyHoldDep = Annotated[Hold, Depends(body_hold)]
ActorDep = Annotated[Actor, Depends(get_actor)]
