"""The trainer's endpoints: register, poll batches, read the run's status."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import Response

from api.batches.outcomes import FormedBatch
from api.batches.sharding import Cost, rank_share, shard, subset
from api.errors import InvalidData
from api.http.body import accepts_gzip, gzip_compress
from api.http.frontdoor import still_admitted
from api.keys.access import ANY_KEY, TRAINER_SIDE
from api.owners import RUN
from api.routes.deps import ServiceDep, SettingsDep
from api.routes.spec import route
from api.views.status import capped
from api.wire.records import (
    MSGPACK,
    Buffer,
    atropos_batch_json,
    decode,
    decode_batch,
    dumps,
    encode,
    is_msgpack,
    msgpack_array_header,
    split_records,
    to_atropos,
)
from api.wire.schema import (
    REGISTRATION_EXAMPLE,
    BatchReply,
    CommitReply,
    CommitRequest,
    Info,
    RegisterReply,
    Registration,
    Status,
    WandbInfo,
)

router = APIRouter(tags=["trainer"])

CONTENT_TYPES = ["application/json", MSGPACK]
"""Advertised in /info: clients that see msgpack here may use the binary path."""
STEP_HEADER = "X-Rollbuf-Step"


@route(
    router,
    "POST",
    "/register",
    TRAINER_SIDE,
    acts=RUN,
    body="json",
    statuses=(400, 409, 422),
    response_model=RegisterReply,
)
async def register(
    registration: Annotated[
        Registration,
        Body(openapi_examples={"run": {"summary": "A run of 8-sequence batches", "value": REGISTRATION_EXAMPLE}}),
    ],
    service: ServiceDep,
) -> RegisterReply:
    """Register the trainer; the first registration sets the run's configuration."""
    return RegisterReply(uuid=await service.register_trainer(registration))


@route(
    router,
    "GET",
    "/batch",
    TRAINER_SIDE,
    acts=RUN,
    statuses=(409, 410, 422, 503),
    responses={
        200: {
            "model": BatchReply,
            "description": "`{batch: [group, ...]}`, or `{batch: null}` when none. With `Accept: application/msgpack`"
            " a batch comes as a msgpack array of group records (docs/binary-format.md); other replies stay JSON.",
            "content": {MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
            "headers": {
                STEP_HEADER: {"description": "The batch's step (with a batch).", "schema": {"type": "integer"}}
            },
        },
    },
)
async def batch(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    wait: Annotated[
        float, Query(ge=0, description="Hold the request up to this many seconds until a batch is ready.")
    ] = 0.0,
    step: Annotated[
        int | None,
        Query(
            ge=0,
            description="Ask for batch N; it is served again until it is acknowledged: N+1 asked for, or, with "
            '`acknowledge: "commit"`, a commit past N.',
        ),
    ] = None,
    rank: Annotated[
        int | None,
        Query(ge=0, description="This data-parallel rank: its share only. With `world_size`, and below it (422)."),
    ] = None,
    world_size: Annotated[
        int | None,
        Query(ge=1, description="Number of data-parallel ranks sharing each batch (at most `max_world_size`)."),
    ] = None,
    balance: Annotated[Cost, Query(description="Balance rank shares by tokens, or by squared lengths.")] = "tokens",
) -> Response:
    """Form and return the next batch, exactly `batch_size` sequences of whole groups."""
    if (rank is None) != (world_size is None) or (rank is not None and world_size is not None and rank >= world_size):
        raise InvalidData(("query", "rank"), "rank and world_size go together, with 0 <= rank < world_size")
    if world_size is not None and world_size > settings.max_world_size:
        raise InvalidData(
            ("query", "world_size"), f"world_size {world_size} exceeds the limit of {settings.max_world_size}"
        )
    share = None if rank is None or world_size is None else (rank, world_size, balance)
    binary = is_msgpack(request.headers.get("accept"))
    result = await service.batches.poll(
        step,
        as_json=not binary,
        wait=min(wait, settings.max_batch_wait),
        gone=request.is_disconnected,
        admitted=lambda: still_admitted(getattr(request.app.state, "door", None), request.scope),
        retry_after=settings.retry_after,
    )
    if not isinstance(result, FormedBatch):
        return _json(result)
    gzip_level = settings.gzip_level if accepts_gzip(request) else None
    return await _render(result, share, binary=binary, gzip_level=gzip_level)


async def _render(
    batch: FormedBatch, share: tuple[int, int, Cost] | None, *, binary: bool, gzip_level: int | None
) -> Response:
    headers = {STEP_HEADER: str(batch.step)}
    if not binary:
        body = await anyio.to_thread.run_sync(_render_json, batch, share, gzip_level)
        if gzip_level is not None:  # the gzip middleware passes an encoded body through as it is
            headers |= {"Content-Encoding": "gzip", "Vary": "Accept-Encoding"}
        return Response(body, media_type="application/json", headers=headers)
    if share is None:
        return Response(batch.records, media_type=MSGPACK, headers=headers)  # as stored: no re-encoding, no copy
    records = await anyio.to_thread.run_sync(binary_share, batch.records, *share)
    return Response(records, media_type=MSGPACK, headers=headers)


def binary_share(records: Buffer, rank: int, world_size: int, cost: Cost) -> bytes:
    """Rank `rank`'s share of a stored batch; whole groups are copied as stored, split ones re-encoded."""
    raw = split_records(records, array=True)
    recs = [decode(r) for r in raw]
    picks = shard([r.lengths for r in recs], world_size, cost)[rank]
    parts = [raw[g] if seqs is None else encode(subset(recs[g], seqs)) for g, seqs in picks]
    return b"".join([msgpack_array_header(len(parts)), *parts])


def _render_json(batch: FormedBatch, share: tuple[int, int, Cost] | None, gzip_level: int | None) -> bytes:
    if share is None:
        body = atropos_batch_json(batch.records)
    else:
        records = rank_share(decode_batch(batch.records), *share)
        body = dumps({"batch": [to_atropos(r) for r in records], "step": batch.step})
    # Atropos trainers accept gzip (requests and aiohttp do by default): ISA-L deflates a 15 MB batch in a
    # third of zlib's time at level 1, and smaller.
    return body if gzip_level is None else gzip_compress(body, gzip_level)


def _json(obj: object) -> Response:
    return Response(dumps(obj), media_type="application/json")


@route(router, "POST", "/commit", TRAINER_SIDE, acts=RUN, statuses=(400, 409, 422), response_model=CommitReply)
async def commit(body: CommitRequest, service: ServiceDep) -> CommitReply:
    """Acknowledge every batch before `step`: trained and saved, so they are freed (the trainer's checkpoint
    hook sends it; one commit for all data-parallel ranks). With `acknowledge: "commit"` this is how batches are
    acknowledged; a commit at or below the last one changes nothing, so retrying one is safe."""
    return await service.batches.commit(body.step)


@route(router, "GET", "/status", ANY_KEY, acts=RUN, response_model=Status)
async def status(service: ServiceDep, settings: SettingsDep) -> Response:
    """Step, queue size, and why no batch can be formed (if something other than data is missing)."""
    status = capped(await service.status(), settings.views_max_datasets, settings.views_max_producers)
    hidden = {"rollouts"} if status.rollouts is None else None  # runs without per-rollout groups: nothing new
    return Response(status.model_dump_json(exclude=hidden), media_type="application/json")


@route(router, "GET", "/info", ANY_KEY, acts=RUN, response_model=Info)
async def info(service: ServiceDep) -> Info:
    """The trainer's batch size and max token length (-1 before registration), the encodings spoken, and the
    read-ahead bound of commit mode."""
    info = await service.info()
    return info.model_copy(
        update={"content_types": CONTENT_TYPES, "max_read_ahead_batches": service.read_ahead.max_batches}
    )


@route(router, "GET", "/wandb_info", ANY_KEY, acts=RUN, response_model=WandbInfo)
async def wandb_info(service: ServiceDep) -> WandbInfo:
    """The trainer's wandb group and project."""
    run = await service.run_state()
    reg = run.registration
    return WandbInfo(group=reg.wandb_group if reg else None, project=reg.wandb_project if reg else None)
