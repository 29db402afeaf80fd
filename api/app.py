"""`create_app(settings)`: the FastAPI application, its lifespan-owned store and its one error handler."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse

from api import wandb_stats
from api.auth import require_api_key
from api.errors import RollbufError
from api.logs import log_error, log_validation_errors
from api.metrics import TimedStore
from api.middleware import ObserveRequests
from api.records import MSGPACK_TYPES
from api.routes import admin, envs, ops, trainer
from api.service import QueueLimits, Service
from api.settings import Settings
from api.store import make_store

log = logging.getLogger("rollbuf")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = make_store(settings.store)
        app.state.service = service = Service(TimedStore(store), limits=queue_limits(settings))
        log.info("rollbuf store: %s", store.url)  # without its password
        stats_logger = None
        if wandb_stats.configured():
            stats_logger = wandb_stats.BufferStatsLogger(service.store, service.snapshot, settings.wandb_interval)
            stats_logger.start()
        app.state.wandb_stats = stats_logger
        try:
            yield
        finally:
            if stats_logger is not None:
                await stats_logger.close()
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
    if settings.metrics:
        app.add_middleware(ObserveRequests)  # outermost: times the whole request, gzip included
    app.add_exception_handler(RollbufError, _render_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _log_validation_error)  # type: ignore[arg-type]
    app.include_router(admin.health)
    app.include_router(ops.probes)
    secured = [Depends(require_api_key)]
    app.include_router(admin.router, dependencies=secured)
    app.include_router(trainer.router, dependencies=secured)
    app.include_router(envs.router, dependencies=secured)
    app.include_router(ops.router, dependencies=secured)
    if settings.metrics:
        app.include_router(ops.prometheus, dependencies=secured)
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
    if exc.status_code >= 500 and exc.status_code != 503:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    else:
        log_error(request.method, request.url.path, exc)
    return JSONResponse({"detail": exc.detail, "code": exc.code}, status_code=exc.status_code, headers=exc.headers)


async def _log_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own 422, unchanged, with the refusal logged."""
    log_validation_errors(request.method, request.url.path, list(exc.errors()))
    return await request_validation_exception_handler(request, exc)
