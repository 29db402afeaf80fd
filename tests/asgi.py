"""The app in-process behind an httpx client, with settings changed for one test (the `client` fixture serves
the defaults)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from api.app import create_app
from api.config.settings import Settings


@asynccontextmanager
async def serving(settings: Settings, **update: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`settings` with `update`, served through its lifespan (the store opened and closed)."""
    app = create_app(settings.model_copy(update=update))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c
