"""`create_app(settings)`: the composition root (`api/layers.py`): the FastAPI application, its lifespan-owned
store and service, its routes, and its one error handler."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from api.batches.formation import FormationRules
from api.config.groups import built
from api.config.settings import Settings, door_hosts, door_keys, inflight_per_client, log_keys
from api.errors import HTTP_CODES, RollbufError, error_body
from api.export import PARQUET
from api.http import connections
from api.http.frontdoor import Door, FrontDoor
from api.http.inflight import BodyBudget
from api.http.middleware import ObserveRequests
from api.http.openapi import declare_body_limits, declare_limits, drop_auth
from api.http.stopping import on_stop_signal
from api.ingest.queue_limits import QueueLimits
from api.keys import keyring
from api.ledger.drop_bias import Thresholds
from api.ledger.drop_bias_watch import BiasWatch
from api.ledger.rules import LedgerSettings
from api.logs import log_client_gone, log_error, log_validation_errors
from api.meters import TimedStore
from api.producers.stored import ProducerSettings
from api.rollouts.service import SweepSettings
from api.routes import ops
from api.routes.direct import DirectLane
from api.routes.table import ROUTERS, TABLE
from api.run.blobs import BlobLimits, BlobTier
from api.run.kept import ReadAhead
from api.service import Service
from api.store import make_store
from api.views import wandb_stats
from api.wire.records import MSGPACK_TYPES

log = logging.getLogger("rollbuf")
GZIP_MIN = 1000
"""Answers smaller than this are sent as they are (gzip would add more than it saves)."""

DESCRIPTION = """\
The AtroposLib API (a rollout handler or trainer written for Atropos works unchanged) plus rollbuf's
extensions. To try it here: **POST /register** with its example, **GET /batch** once (that starts the run),
then **POST /register-env** and **POST /scored_data** with theirs.

Every error reply has one shape (`ErrorBody`): `code`, `message`, `errors` (`loc` names the field, `msg` the
rule) and `detail` as FastAPI writes it. With an API key set, the operations marked with a lock need
`Authorization: Bearer <key>` (the Authorize button)."""


TELEMETRY_OFF: dict[str, Any] = {"tracing": False, "metrics": False, "logs": False}
"""FastAPI's OpenTelemetry instrumentation, off: it asks on every request whether a provider is configured (3%
of a small group's ingest when none is). It stays on where one is configured before the app is built, as
`opentelemetry-instrument` and an SDK set up at import do (docs/observability.md)."""
_DEFERRED = {"ProxyTracerProvider", "_ProxyMeterProvider", "ProxyLoggerProvider"}


def otel_configured() -> bool:
    """Whether an OpenTelemetry tracer, meter or logger provider is set (not the API's deferred stand-ins)."""
    from opentelemetry import _logs, metrics, trace

    providers = (trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider())
    return any(type(p).__name__ not in _DEFERRED for p in providers)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = make_store(settings.store)
        app.state.service = service = Service(
            TimedStore(store),
            limits=built(QueueLimits, settings),
            blobs=BlobTier.of(settings.store, built(BlobLimits, settings)),
            read_ahead=built(ReadAhead, settings),
            books=built(LedgerSettings, settings),
            rules=built(FormationRules, settings),
            bias=BiasWatch(built(Thresholds, settings)),
            producer_settings=built(ProducerSettings, settings),
            rollout_sweep=built(SweepSettings, settings),
        )
        await service.start()
        restore_signals = on_stop_signal(service.wakeups.close)  # long-polls answered at once on a stop
        log.info("rollbuf store: %s", store.url)  # without its password
        log_keys(settings, app.state.door.keys)
        stats_logger = None
        if wandb_stats.configured():
            stats_logger = wandb_stats.BufferStatsLogger(service.store, service.snapshot, settings.wandb_interval)
            stats_logger.start()
        app.state.wandb_stats = stats_logger
        stop_watching = keyring.watch(app.state.door.keys)  # a key file's changes are used without a request
        try:
            yield
        finally:
            stop_watching()
            restore_signals()
            if stats_logger is not None:
                await stats_logger.close()
            try:
                await service.close()
            finally:
                await store.close()

    # Swagger UI and ReDoc from files the fastapi-offline package ships: /docs works where training clusters
    # run, without internet (FastAPI's own pages load them from a CDN).
    app = FastAPIOffline(
        title="rollbuf",
        summary="Experience buffer for LLM RL, wire-compatible with the AtroposLib API.",
        description=DESCRIPTION,
        version="0.1.0",
        lifespan=lifespan,
        swagger_ui_parameters={"tryItOutEnabled": True},
        telemetry=None if otel_configured() else TELEMETRY_OFF,
    )
    app.state.settings = settings
    connections.configure(
        settings.max_header_bytes,
        settings.header_timeout,
        settings.body_timeout,
        settings.max_connections,
        settings.min_body_rate,
    )
    app.state.body_budget = BodyBudget(
        settings.max_inflight_bytes,
        settings.retry_after,
        per_holder=inflight_per_client(settings),
        reserve=settings.body_reserve_bytes,
    )
    app.add_middleware(
        GZipMiddleware,
        minimum_size=GZIP_MIN,
        compresslevel=settings.gzip_level,
        exclude_content_types=(*MSGPACK_TYPES, PARQUET),  # binary, already compressed
    )
    # Inside the front door, outside gzip: the ingest routes' requests go straight to their handlers.
    app.add_middleware(
        DirectLane, gzip_min=GZIP_MIN, gzip_level=settings.gzip_level, gzip_skip=(*MSGPACK_TYPES, PARQUET)
    )
    door = Door(
        door_keys(settings), door_hosts(settings), settings.allow_simple_content_types, settings.max_body_bytes, TABLE
    )
    app.state.door = door
    app.add_middleware(FrontDoor, door=door)  # before any route, any body read
    if settings.metrics:
        app.add_middleware(ObserveRequests)  # outermost: times the whole request, gzip and refusals included
    app.add_exception_handler(RollbufError, _render_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _render_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _render_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, _client_gone)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _render_crash)
    for router in ROUTERS:  # each route declares its roles, body and statuses (api.routes.spec)
        app.include_router(router)
    if settings.metrics:
        app.include_router(ops.prometheus)
    if door.keys is None:
        drop_auth(app)
    declare_limits(
        app,
        {
            ("/batch", "get", "world_size"): settings.max_world_size,
            ("/batch", "get", "rank"): settings.max_world_size - 1,
        },
    )
    declare_body_limits(
        app,
        {
            ("OpenRequest", "deadline_s", "maximum"): settings.rollout_max_deadline_s,
            ("TaskPage", "tasks", "maxItems"): settings.task_page_size,
            ("DatasetSpec", "tasks", "maxItems"): settings.task_page_size,
        },
    )
    return app


# One shape for every error reply (api.errors.error_body), whoever raised it.


async def _render_error(request: Request, exc: RollbufError) -> JSONResponse:
    if exc.status_code >= 500 and exc.status_code != 503:
        log.warning("%s %s: %s", request.method, request.url.path, exc.detail)
    else:
        log_error(request.method, request.url.path, exc)
    body = error_body(exc.code, exc.errors(), exc.detail)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _render_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's 422, logged: FastAPI's `detail` list, without echoing the input (a whole group, for a
    missing field)."""
    log_validation_errors(request.method, request.url.path, list(exc.errors()))
    errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    return JSONResponse(error_body("invalid", errors, errors), status_code=422)


async def _render_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own: unknown path (404), wrong method (405), unreadable body (400)."""
    code = HTTP_CODES.get(exc.status_code, "error")
    loc = ["body"] if exc.status_code == 400 else []
    body = error_body(code, [{"loc": loc, "msg": str(exc.detail), "type": code}], exc.detail)
    headers = exc.headers
    if exc.status_code == 405:  # Starlette names the first route of the path only (/weights: POST, not GET too)
        allowed = {m.upper() for m in request.app.openapi().get("paths", {}).get(request.url.path, {})}
        if allowed:
            headers = {**(headers or {}), "Allow": ", ".join(sorted(allowed))}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client hung up mid-body: nothing to answer it, nothing stored, one log line."""
    log_client_gone(request.method, request.url.path)
    return Response(status_code=400)


async def _render_crash(request: Request, exc: Exception) -> JSONResponse:
    """A bug: the same shape, nothing of the exception's text (Starlette logs the traceback)."""
    msg = "internal server error; the server log has the traceback"
    return JSONResponse(error_body("internal", [{"loc": [], "msg": msg}], msg), status_code=500)
