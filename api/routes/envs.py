"""The rollout handlers' endpoints: register, submit scored groups, read their status."""

from __future__ import annotations

import contextvars
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from api.binary import check_body
from api.body import INLINE_PARSE, off_loop, parse_json, read_body
from api.deps import ServiceDep, SettingsDep
from api.errors import InvalidData
from api.json_groups import read_groups
from api.logs import request_env
from api.records import MSGPACK, dumps, is_msgpack
from api.schema import (
    EnvIdentifier,
    EnvRegistered,
    EnvStatus,
    ErrorBody,
    RegisterEnv,
    ScoredData,
    ScoredListReply,
    ScoredReply,
)
from api.service import Service, Submission, group_key
from api.state import RunState

router = APIRouter(tags=["environments"])

_ENV_ID = TypeAdapter(EnvIdentifier)
_ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorBody, "description": "Body too large"},
    422: {"model": ErrorBody, "description": "Invalid data: `detail[].loc` names the field, `msg` the rule"},
    503: {"model": ErrorBody, "description": "Queue full: retry after `Retry-After` seconds; nothing was stored"},
}


def _body_doc(schema: dict[str, Any], binary: str | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if binary:
        content[MSGPACK] = {"schema": {"type": "string", "format": "binary", "description": binary}}
    return {"requestBody": {"required": True, "content": content}}


def _binary_submissions(
    raw: bytes, run: RunState, service: Service, *, many: bool, idempotency_key: str | None = None
) -> list[Submission]:
    """Groups sent as msgpack records (docs/binary-format.md), validated under the JSON path's rules."""
    limits = service.ingest_limits(run)
    groups = check_body(raw, many=many, env_ids={e.env_id for e in run.envs}, current_step=run.step, limits=limits)
    subs = []
    for i, g in enumerate(groups):
        key = idempotency_key or group_key(g.record.env_id, g.record.group_id)
        subs.append(Submission.of(g.record, g.payload, key, g.sent_policy_step, ("body", i) if many else ("body",)))
    return subs


def _json_submissions(
    raw: bytes, run: RunState, service: Service, *, many: bool, idempotency_key: str | None = None
) -> list[Submission]:
    """Groups sent as JSON, parsed and validated."""
    return service.prepare(read_groups(raw, many=many), run, idempotency_key)


async def _decode(
    raw: bytes, request: Request, run: RunState, service: Service, *, many: bool, idempotency_key: str | None = None
) -> list[Submission]:
    """The body's groups, validated: on the event loop for a small body, in a worker thread for a large one
    (other requests go on meanwhile). The env named in the body is kept for the request's log line."""
    decode = _binary_submissions if is_msgpack(request.headers.get("content-type")) else _json_submissions
    ctx = contextvars.copy_context()
    try:
        return await off_loop(
            len(raw),
            INLINE_PARSE,
            ctx.run,
            partial(decode, raw, run, service, many=many, idempotency_key=idempotency_key),
        )
    finally:
        request_env.set(ctx.get(request_env))


@router.post("/register-env", responses={200: {"model": EnvRegistered}, 422: {"model": ErrorBody}})
async def register_env(body: RegisterEnv, service: ServiceDep) -> dict[str, Any]:
    """Register a rollout handler; before the trainer's first /batch it is told to wait."""
    registered = await service.register_env(body)
    if registered is None:
        return {"status": "wait for trainer to start"}
    return registered.model_dump(exclude_none=True)


@router.post("/disconnect-env")
async def disconnect_env(body: EnvIdentifier, service: ServiceDep) -> dict[str, str]:
    """Mark an env as gone: its minimum allocation no longer holds batches back. Its queued data stays."""
    error = await service.disconnect_env(body.env_id)
    return {"status": "success"} if error is None else {"status": "failure", "error": error}


@router.get(
    "/status-env",
    response_model=EnvStatus,
    openapi_extra=_body_doc(EnvIdentifier.model_json_schema()),
    responses={404: {"model": ErrorBody}},
)
async def status_env(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    env_id: Annotated[int | None, Query(description="The env's id; Atropos clients send it as a JSON body.")] = None,
) -> EnvStatus:
    """An env's view of the queue: step, its backlog, its weight. Takes `?env_id=` or a JSON body."""
    if env_id is None:
        raw = await read_body(request, max_bytes=4096, max_decompressed=4096)
        if not raw:
            raise InvalidData(("query", "env_id"), 'env_id is required, as ?env_id= or a JSON body {"env_id": N}')
        env_id = parse_json(_ENV_ID, raw).env_id
    return await service.env_status(env_id)


@router.post(
    "/scored_data",
    response_model=ScoredReply,
    response_model_exclude_none=True,
    openapi_extra=_body_doc(ScoredData.model_json_schema(), "One group record (docs/binary-format.md)"),
    responses=_ERRORS,
)
async def scored_data(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """Submit one scored group, as JSON or msgpack. A group id or Idempotency-Key makes retries safe."""
    raw = await read_body(request, max_bytes=settings.max_body_bytes, max_decompressed=settings.max_decompressed_bytes)
    key = f"k:{idempotency_key}" if idempotency_key else None
    run = await service.run_state()
    subs = await _decode(raw, request, run, service, many=False, idempotency_key=key)
    [reply] = await service.store_submissions(subs, run)
    return Response(dumps(reply.model_dump(exclude_none=True)), media_type="application/json")


@router.post(
    "/scored_data_list",
    response_model=ScoredListReply,
    response_model_exclude_none=True,
    openapi_extra=_body_doc(
        {"type": "array", "items": ScoredData.model_json_schema()}, "A msgpack array of group records"
    ),
    responses=_ERRORS,
)
async def scored_data_list(request: Request, service: ServiceDep, settings: SettingsDep) -> Response:
    """Submit several groups at once, as JSON or msgpack: all are stored, or (on any invalid group) none."""
    raw = await read_body(request, max_bytes=settings.max_body_bytes, max_decompressed=settings.max_decompressed_bytes)
    run = await service.run_state()
    replies = await service.store_submissions(await _decode(raw, request, run, service, many=True), run)
    buffered = [r for r in replies if r.status == "buffered"]
    duplicates = sum(1 for r in replies if r.duplicate)
    out = ScoredListReply(
        groups_processed=len(replies),
        buffered=len(buffered) or None,
        last_buffer_size=buffered[-1].buffer_size if buffered else None,
        duplicates=duplicates or None,
    )
    return Response(dumps(out.model_dump(exclude_none=True)), media_type="application/json")
