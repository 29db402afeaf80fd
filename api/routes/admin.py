"""Health, debugging and reset endpoints."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from api.http.openapi import ERROR_DESCRIPTIONS, ERROR_REF
from api.keys.access import PUBLIC, TRAINER_SIDE
from api.owners import RUN
from api.routes.deps import ServiceDep
from api.routes.spec import route
from api.wire.records import dumps, to_atropos

router = APIRouter(tags=["admin"])
health = APIRouter(tags=["operations"])
"""The health check, first of all routes."""

_EMPTY_EXAMPLE: dict[str, list[Any]] = {
    k: []
    for k in (
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "generation_params",
        "inference_logprobs",
        "messages",
        "images",
    )
}


@route(health, "GET", "/", PUBLIC, acts=RUN)
async def root() -> dict[str, str]:
    """Health check (Atropos tools call it)."""
    return {"message": "AtroposLib API"}


@route(router, "GET", "/latest_example", TRAINER_SIDE, acts=RUN)
async def latest_example(service: ServiceDep) -> Response:
    """The last group this server process queued, for eyeballing what envs send."""
    latest = service.ingest.latest
    body = _EMPTY_EXAMPLE if latest is None else to_atropos(latest)
    return Response(dumps(body), media_type="application/json")


@route(
    router,
    "GET",
    "/reset_data",
    TRAINER_SIDE,
    acts=RUN,  # Atropos trainers call it to start a run
    response_class=PlainTextResponse,
    responses={401: {"description": ERROR_DESCRIPTIONS[401], "content": {"application/json": {"schema": ERROR_REF}}}},
)
async def reset_data(service: ServiceDep) -> str:
    """Drop every queue, registration and the step: the next /register starts a new run."""
    await service.reset()
    return "Reset successful"
