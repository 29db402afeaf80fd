"""`create_app(settings)`: the FastAPI application, its lifespan-owned store and its one error handler."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse

from api.auth import require_api_key
from api.errors import RollbufError
from api.records import MSGPACK_TYPES
from api.routes import admin, envs, trainer
from api.service import QueueLimits, Service
from api.settings import Settings
from api.store import make_store

log = logging.getLogger("rollbuf")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = make_store(settings.store)
        app.state.service = Service(store, limits=queue_limits(settings))
        log.info("rollbuf store: %s", settings.store)
        try:
            yield
        finally:
            await store.close()

    app = FastAPI(
        title="rollbuf",
        summary="Experience buffer for LLM RL, wire-compatible with the AtroposLib API.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.add_middleware(
        GZipMiddleware,
        minimum_size=1000,
        compresslevel=settings.gzip_level,
        exclude_content_types=MSGPACK_TYPES,
    )
    app.add_exception_handler(RollbufError, _render_error)  # type: ignore[arg-type]
    app.include_router(admin.health)
    secured = [Depends(require_api_key)]
    app.include_router(admin.router, dependencies=secured)
    app.include_router(trainer.router, dependencies=secured)
    app.include_router(envs.router, dependencies=secured)
    return app


def queue_limits(settings: Settings) -> QueueLimits:
    return QueueLimits(
        max_groups=settings.max_queue_groups,
        max_tokens=settings.max_queue_tokens,
        max_env_groups=settings.max_env_queue_groups,
        max_env_tokens=settings.max_env_queue_tokens,
        max_group_seqs=settings.max_group_seqs,
        retry_after=settings.retry_after,
    )


async def _render_error(request: Request, exc: RollbufError) -> JSONResponse:
    if exc.status_code >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    return JSONResponse({"detail": exc.detail, "code": exc.code}, status_code=exc.status_code, headers=exc.headers)
