"""The rollout handlers' endpoints: register, submit scored groups, read their status."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import TypeAdapter

from api.config.settings import Settings
from api.errors import InvalidData
from api.http import body_cost
from api.http.body import parse_json, read_body
from api.http.frontdoor import actor_of
from api.ingest.gc_pause import collection_paused
from api.ingest.submissions import request_key
from api.ingest.submit import reply_fields
from api.keys.access import ANY_KEY, ENV_SIDE
from api.owners import RUN, RUN_WIDE, acts
from api.routes.deps import ServiceDep, SettingsDep, holder
from api.routes.direct import DirectRoute, served_by
from api.routes.spec import route
from api.run.offloop import INLINE_PARSE, off_loop
from api.service import Service
from api.store.offload import large
from api.wire.records import MSGPACK, dumps
from api.wire.schema import (
    ENV_EXAMPLE,
    GROUP_EXAMPLE,
    DisconnectReply,
    EnvIdentifier,
    EnvRegistered,
    EnvStatus,
    EnvWait,
    RegisterEnv,
    ScoredData,
    ScoredListReply,
    ScoredReply,
)

router = APIRouter(tags=["environments"], route_class=DirectRoute)

_ENV_ID = TypeAdapter(EnvIdentifier)
_INGEST_ERRORS = (400, 409, 413, 422, 503)


def _body_doc(
    schema: dict[str, Any], binary: str | None = None, example: Any = None, required: bool = True
) -> dict[str, Any]:
    json_body: dict[str, Any] = {"schema": schema}
    if example is not None:
        json_body["example"] = example
    content: dict[str, Any] = {"application/json": json_body}
    if binary:
        content[MSGPACK] = {"schema": {"type": "string", "format": "binary", "description": binary}}
    return {"requestBody": {"required": required, "content": content}}


@route(
    router,
    "POST",
    "/register-env",
    ENV_SIDE,
    acts=RUN,
    body="json",
    statuses=(400, 409, 422),
    response_model=EnvRegistered | EnvWait,
)
async def register_env(
    body: Annotated[RegisterEnv, Body(openapi_examples={"env": {"summary": "Groups of 2", "value": ENV_EXAMPLE}})],
    service: ServiceDep,
    request: Request,
) -> dict[str, Any]:
    """Register a rollout handler; before the trainer's first /batch it is told to wait."""
    registered = await service.register_env(body, actor_of(request.scope))
    if registered is None:
        return {"status": "wait for trainer to start"}
    return registered.model_dump(exclude_none=True)


# ANY_KEY: an env key disconnects its own envs; trainer and admin keys any env
@route(
    router,
    "POST",
    "/disconnect-env",
    ANY_KEY,
    acts=acts("env", others=RUN_WIDE),
    body="json",
    statuses=(400, 422),
    response_model=DisconnectReply,
    response_model_exclude_none=True,
)
async def disconnect_env(
    body: Annotated[
        EnvIdentifier, Body(openapi_examples={"env": {"summary": "The first env", "value": {"env_id": 0}}})
    ],
    service: ServiceDep,
    request: Request,
) -> dict[str, str]:
    """Mark an env as gone: its minimum allocation no longer holds batches back. Its queued data stays."""
    error = await service.disconnect_env(body.env_id, actor_of(request.scope))
    return {"status": "success"} if error is None else {"status": "failure", "error": error}


@route(
    router,
    "GET",
    "/status-env",
    ANY_KEY,
    acts=acts("env", others=RUN_WIDE),
    statuses=(400, 404, 413, 422),
    response_model=EnvStatus,
    openapi_extra=_body_doc(EnvIdentifier.model_json_schema(), example={"env_id": 0}, required=False),
)
async def status_env(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    env_id: Annotated[int | None, Query(description="The env's id; Atropos clients send it as a JSON body.")] = None,
) -> EnvStatus:
    """An env's view of the queue: step, its backlog, its weight. Takes `?env_id=` or a JSON body."""
    raw = await read_body(request, max_bytes=4096, max_decompressed=4096)
    if raw:  # a body that is sent must be valid, even beside ?env_id= (which wins)
        sent = parse_json(_ENV_ID, raw).env_id
        env_id = sent if env_id is None else env_id
    if env_id is None:
        raise InvalidData(("query", "env_id"), 'env_id is required, as ?env_id= or a JSON body {"env_id": N}')
    return await service.env_status(env_id, actor_of(request.scope))


IDEMPOTENCY_KEY_MAX = 200


def _idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header, checked as FastAPI checks the declared `Header` (a 422 past its length)."""
    key = request.headers.get("idempotency-key")
    if key is not None and len(key) > IDEMPOTENCY_KEY_MAX:
        raise RequestValidationError(
            [
                {
                    "type": "string_too_long",
                    "loc": ("header", "idempotency-key"),
                    "msg": f"String should have at most {IDEMPOTENCY_KEY_MAX} characters",
                    "ctx": {"max_length": IDEMPOTENCY_KEY_MAX},
                }
            ]
        )
    return key


async def _submitted(
    request: Request, answer: Callable[[list[ScoredReply]], Response], *, many: bool, key: str | None = None
) -> Response:
    """A submission's body read within the body limits and the process's byte budget, then stored, and the
    answer made of its replies. A large body is ingested and answered with the cyclic collector held off
    (`api.ingest.gc_pause`): its objects are gone before the collector is back, so no collection walks them. Its
    transaction is large (`api.store.offload`): a store that runs transactions on the event loop runs it off."""
    state = request.app.state
    settings: Settings = state.settings
    hold = state.body_budget.hold(holder(request))  # the caller's share: one key cannot hold it all
    try:
        raw = await read_body(
            request, max_bytes=settings.max_body_bytes, max_decompressed=settings.max_decompressed_bytes, hold=hold
        )
        content_type = request.headers.get("content-type")
        # Decoding costs several times the body's bytes: charged before it starts (api.http.body_cost).
        hold.charge(await off_loop(len(raw), INLINE_PARSE, body_cost.charge, raw, content_type, hold.bytes))
        service: Service = state.service
        big = len(raw) > INLINE_PARSE
        with collection_paused() if big else nullcontext(), large() if big else nullcontext():
            replies = await service.ingest.submit(raw, content_type, many=many, key=key, caller=actor_of(request.scope))
            response = answer(replies)
            del replies, raw
        return response
    finally:
        hold.release()


def _one(replies: list[ScoredReply]) -> Response:
    [reply] = replies
    return Response(dumps(reply_fields(reply)), media_type="application/json")


def _many(replies: list[ScoredReply]) -> Response:
    """The list's reply (`replies` are in request order: `duplicate_at` names the duplicates by index)."""
    buffered = [r for r in replies if r.status == "buffered"]
    duplicates = [i for i, r in enumerate(replies) if r.duplicate]
    out = ScoredListReply(
        groups_processed=len(replies),
        buffered=len(buffered) or None,
        last_buffer_size=buffered[-1].buffer_size if buffered else None,
        duplicates=len(duplicates) or None,
        duplicate_at=duplicates or None,
    )
    return Response(dumps(out.model_dump(exclude_none=True)), media_type="application/json")


async def submit_group(request: Request) -> Response:
    """POST /scored_data, served directly (`api.routes.direct`)."""
    return await _submitted(request, _one, many=False, key=request_key(_idempotency_key(request)))


async def submit_list(request: Request) -> Response:
    """POST /scored_data_list, served directly (`api.routes.direct`)."""
    return await _submitted(request, _many, many=True)


@route(
    router,
    "POST",
    "/scored_data",
    ENV_SIDE,
    acts=acts("env", "task_lease"),
    body="ingest",
    statuses=_INGEST_ERRORS,
    response_model=ScoredReply,
    response_model_exclude_none=True,
    openapi_extra=_body_doc(
        ScoredData.model_json_schema(), "One group record (docs/binary-format.md)", example=GROUP_EXAMPLE
    ),
)
@served_by(submit_group)
async def scored_data(
    request: Request,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=IDEMPOTENCY_KEY_MAX,
            description="Makes a retry safe without a group_id: the same key with the same group is stored once "
            "(`duplicate: true`); with a different group it is a 409.",
        ),
    ] = None,
) -> Response:
    """Submit one scored group, as JSON or msgpack. A group id or Idempotency-Key makes retries safe."""
    return await submit_group(request)


@route(
    router,
    "POST",
    "/scored_data_list",
    ENV_SIDE,
    acts=acts("env", "task_lease"),
    body="ingest",
    statuses=_INGEST_ERRORS,
    response_model=ScoredListReply,
    response_model_exclude_none=True,
    openapi_extra=_body_doc(
        {"type": "array", "items": ScoredData.model_json_schema()},
        "A msgpack array of group records",
        example=[GROUP_EXAMPLE | {"group_id": "example-1"}, GROUP_EXAMPLE | {"group_id": "example-2"}],
    ),
)
@served_by(submit_list)
async def scored_data_list(request: Request) -> Response:
    """Submit several groups at once, as JSON or msgpack: all are stored, or (on any invalid group) none."""
    return await submit_list(request)
