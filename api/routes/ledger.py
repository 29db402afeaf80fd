"""Reading the ledger back: what a step trained on, and what became of a group (docs/ledger.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from api.keys.access import TRAINER_SIDE
from api.ledger.replies import LedgerGroupsReply, LedgerStepReply
from api.owners import RUN
from api.routes.deps import ServiceDep
from api.routes.spec import route
from api.wire.records import dumps

router = APIRouter(tags=["ledger"])

MAX_STEP = 2**63 - 1
"""The largest step a store holds (a signed 64-bit integer): a larger one is 422, never a store's overflow."""
LEDGER_EXAMPLE = "conformance"
"""The group id the description's example names (tests/integration/test_openapi_conformance.py sends one)."""
DATA = Query(description="Include each retained group's data, as GET /batch serves it (`retain_steps`, `retain_bytes`)")


@route(
    router,
    "GET",
    "/ledger/steps/{step}",
    TRAINER_SIDE,
    acts=RUN,
    statuses=(404, 422),
    response_class=Response,
    responses={200: {"model": LedgerStepReply, "description": "The batch's row and its groups'"}},
)
async def ledger_step(
    service: ServiceDep,
    step: Annotated[
        int, Path(ge=0, le=MAX_STEP, description="The batch's step", openapi_examples={"first": {"value": 0}})
    ],
    data: Annotated[bool, DATA] = False,
) -> Response:
    """What batch `step` held: its groups (in batch order) with their envs, policy steps, sizes and scores, the
    mix by env, the staleness histogram, when it was formed and committed."""
    return Response(dumps(await service.ledger.step(step, data=data)), media_type="application/json")


@route(
    router,
    "GET",
    "/ledger/groups/{group_id:path}",
    TRAINER_SIDE,
    acts=RUN,
    statuses=(404, 422),
    response_class=Response,
    responses={200: {"model": LedgerGroupsReply, "description": "The groups' rows"}},
)
async def ledger_group(
    service: ServiceDep,
    group_id: Annotated[
        str,
        Path(
            description="The handler's group id, URL-encoded", openapi_examples={"a group": {"value": LEDGER_EXAMPLE}}
        ),
    ],
    data: Annotated[bool, DATA] = False,
) -> Response:
    """What became of the group sent under `group_id` (URL-encoded; it may hold `/`): queued, side-buffered
    ("held"), served in step N (and whether that batch is committed) or dropped, and why."""
    rows = await service.ledger.named(group_id, data=data)
    return Response(dumps({"groups": rows}), media_type="application/json")
