"""Dependencies the routes declare: the service and the settings, as `Annotated` aliases.

They are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread, and two thread
hops per request cost more than the whole of parsing a group on the ingest path.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.service import Service
from api.settings import Settings


async def get_service(request: Request) -> Service:
    return request.app.state.service  # type: ignore[no-any-return]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


ServiceDep = Annotated[Service, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
