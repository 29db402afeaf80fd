"""The operator's endpoints: liveness, readiness, Prometheus metrics, the live dashboard
(docs/observability.md)."""

from __future__ import annotations

import asyncio
import logging
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from api.errors import Unavailable
from api.keys.access import ANY_KEY, PUBLIC
from api.keys.keyring import KeyFile
from api.owners import RUN
from api.routes.deps import ServiceDep, SettingsDep
from api.routes.spec import route
from api.views import metrics
from api.wire.records import dumps

log = logging.getLogger("rollbuf")

READY_TIMEOUT_S = 2.0
"""/readyz answers 503 when the store takes longer than this for one read."""

probes = APIRouter(tags=["operations"])
"""Open when auth is on: orchestrators probe without credentials, and the dashboard page holds no data."""
router = APIRouter(tags=["operations"])
"""Behind the API key when one is set."""
prometheus = APIRouter(tags=["operations"])
"""/metrics, behind the API key when one is set (Prometheus sends it with `authorization:` in its scrape config)."""


@route(probes, "GET", "/healthz", PUBLIC, acts=RUN)
async def healthz() -> dict[str, str]:
    """Liveness: the process answers (it does not touch the store)."""
    return {"status": "ok"}


@route(
    probes,
    "GET",
    "/readyz",
    PUBLIC,
    acts=RUN,
    statuses=(503,),
    responses={200: {"description": "Ready.", "content": {"application/json": {"example": {"status": "ok"}}}}},
)
async def readyz(request: Request, service: ServiceDep) -> JSONResponse:
    """Readiness: the store answers a read within 2 s, and takes writes as far as it knows (a full disk, a
    failing checkpoint); 503 otherwise."""
    try:
        await asyncio.wait_for(service.ping(), READY_TIMEOUT_S)
    except Exception as exc:  # any failure of the store means "not ready", never a 500
        reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        log.warning("readyz: the store does not answer: %s", reason)
        raise Unavailable(f"the store does not answer: {reason}", retry_after=READY_TIMEOUT_S) from None
    trouble = service.store.not_ready()
    if trouble:
        raise Unavailable(f"the store cannot take writes: {trouble}", retry_after=READY_TIMEOUT_S)
    door = getattr(request.app.state, "door", None)
    keyfile = door.keys if door is not None and isinstance(door.keys, KeyFile) else None
    if keyfile is not None and keyfile.error is not None:
        # Ready (the last good keys serve), but an operator must see that a rotation did not take.
        warning = f"api_keys_file cannot be used ({keyfile.error}): the last good keys stay in use"
        return JSONResponse({"status": "ok", "warnings": [warning]})
    return JSONResponse({"status": "ok"})


@route(
    prometheus,
    "GET",
    "/metrics",
    ANY_KEY,
    acts=RUN,
    response_class=Response,
    responses={200: {"content": {metrics.CONTENT_TYPE: {}}}},
)
async def prometheus_metrics(service: ServiceDep, settings: SettingsDep) -> Response:
    """Prometheus exposition: the run's counters and gauges from the store, this replica's timings."""
    body = await service.metrics(settings.metrics_max_envs, settings.views_max_producers, settings.views_max_datasets)
    return Response(body, media_type=metrics.CONTENT_TYPE)


@route(probes, "GET", "/dashboard", PUBLIC, acts=RUN, response_class=HTMLResponse)  # the page: no data
async def dashboard() -> HTMLResponse:
    """A live page for people: step, rates, queues and mix, staleness, drops, backpressure."""
    return HTMLResponse(_DASHBOARD)


@route(router, "GET", "/dashboard/data", ANY_KEY, acts=RUN)
async def dashboard_data(service: ServiceDep, settings: SettingsDep) -> Response:
    """What the dashboard polls: one consistent snapshot of the buffer, per env for at most `metrics_max_envs`
    envs (the rest summed, as /metrics does)."""
    body = await service.dashboard_data(
        settings.metrics_max_envs, settings.views_max_producers, settings.views_max_datasets
    )
    return Response(dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"})


_DASHBOARD = resources.files("api").joinpath("dashboard.html").read_text(encoding="utf-8")
