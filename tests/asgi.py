"""The app in-process behind an httpx client, with settings changed for one test (the `client` fixture serves
the defaults)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from api.app import create_app
from api.config.settings import Settings
from api.service import Service


@asynccontextmanager
async def serving(settings: Settings, **update: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`settings` with `update`, served through its lifespan (the store opened and closed)."""
    async with serving_app(settings, **update) as (c, _):
        yield c


@asynccontextmanager
async def serving_app(settings: Settings, **update: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """`serving`, with the app: for a test that must reach past HTTP (`service_of`), as another replica would."""
    app = create_app(settings.model_copy(update=update))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c, app


def service_of(app: FastAPI) -> Service:
    """The app's service (built in its lifespan)."""
    service: Service = app.state.service
    return service
