"""The trainer's endpoints: register, poll batches, read the run's status."""

from __future__ import annotations

import asyncio
import time

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api.deps import ServiceDep, SettingsDep
from api.records import atropos_batch_json, dumps
from api.schema import ErrorBody, Info, RegisterReply, Registration, Status, WandbInfo
from api.service import BatchWaiting, FormedBatch

router = APIRouter(tags=["trainer"])

RECHECK_S = 0.5
"""Long-poll re-check interval: catches batches made possible by another server process sharing the store."""


@router.post("/register", response_model=RegisterReply, responses={409: {"model": ErrorBody}})
async def register(registration: Registration, service: ServiceDep) -> RegisterReply:
    """Register the trainer; the first registration sets the run's configuration."""
    return RegisterReply(uuid=await service.register_trainer(registration))


@router.get("/batch", responses={200: {"description": "`{batch: [group, ...]}`, or `{batch: null}` when none"}})
async def batch(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    wait: float = Query(0.0, ge=0, description="Hold the request up to this many seconds until a batch is ready."),
) -> Response:
    """Form and return the next batch, exactly `batch_size` sequences of whole groups."""
    deadline = time.monotonic() + min(wait, settings.max_batch_wait)
    while True:
        changed = service.data_changed()
        result = await service.next_batch()
        if isinstance(result, FormedBatch):
            body = await anyio.to_thread.run_sync(atropos_batch_json, result.records)
            return Response(body, media_type="application/json")
        if result.not_registered:
            return _json({"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []})
        remaining = deadline - time.monotonic()
        if remaining <= 0 or await request.is_disconnected():
            return _json(_no_batch(result))
        try:
            await asyncio.wait_for(changed.wait(), timeout=min(remaining, RECHECK_S))
        except TimeoutError:
            pass


def _no_batch(result: BatchWaiting) -> dict[str, object]:
    out: dict[str, object] = {"batch": None}
    if result.blocked:
        out["blocked_reason"] = result.reason
    return out


def _json(obj: object) -> Response:
    return Response(dumps(obj), media_type="application/json")


@router.get("/status", response_model=Status)
async def status(service: ServiceDep) -> Status:
    """Step, queue size, and why no batch can be formed (if something other than data is missing)."""
    return await service.status()


@router.get("/info", response_model=Info)
async def info(service: ServiceDep) -> Info:
    """The trainer's batch size and max token length; -1 before registration."""
    return await service.info()


@router.get("/wandb_info", response_model=WandbInfo)
async def wandb_info(service: ServiceDep) -> WandbInfo:
    """The trainer's wandb group and project."""
    run = await service.run_state()
    reg = run.registration
    return WandbInfo(group=reg.wandb_group if reg else None, project=reg.wandb_project if reg else None)
