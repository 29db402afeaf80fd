"""Groups whose rollouts arrive one by one (docs/rollouts.md): opened, posted a rollout at a time, heartbeated,
their missing slots leased to siblings, sealed (the env role, as heartbeats); views for anyone with a key."""

from __future__ import annotations

from fastapi import APIRouter, Query

from api.keys.access import ANY_KEY, ENV_SIDE
from api.owners import RUN, RUN_WIDE, acts
from api.routes.deps import ActorDep, ServiceDep, SettingsDep
from api.routes.spec import route
from api.wire.rollouts import (
    GroupView,
    OpenRequest,
    PostReply,
    RolloutHeartbeat,
    RolloutHeartbeatReply,
    RolloutPost,
    SealRequest,
    SlotLeaseReply,
    SlotLeaseRequest,
    SlotPrefix,
    TurnPost,
    TurnReply,
)
from api.wire.rules import GROUP_ID_MAX, SAFE_INT_MAX

router = APIRouter(tags=["rollouts"])


@route(
    router,
    "POST",
    "/rollouts/open",
    ENV_SIDE,
    acts=acts("env", "open_group"),
    body="json",
    statuses=(400, 403, 404, 409, 422, 503),
    response_model=GroupView,
)
async def open_group(body: OpenRequest, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> GroupView:
    """Open a group of `group_size` rollouts for one task; post them with POST /rollouts/post as they end."""
    return await service.rollouts.open(body, settings, actor)


@route(
    router,
    "POST",
    "/rollouts/post",
    ENV_SIDE,
    acts=acts("open_group"),
    body="ingest",
    statuses=(400, 404, 409, 422, 503),
    response_model=PostReply,
)
async def post_rollout(body: RolloutPost, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> PostReply:
    """One rollout, acknowledged durably (the same content again: `duplicate`; from another producer after the
    first: `redone`, the first kept; other content from its producer: 409), once it meets every rule its sealed
    group will meet at ingest (422 naming the field otherwise). The last of G seals the group."""
    return await service.rollouts.post(body, settings, actor)


@route(
    router,
    "POST",
    "/rollouts/turn",
    ENV_SIDE,
    acts=acts("open_group"),
    body="ingest",
    statuses=(400, 404, 409, 422, 503),
    response_model=TurnReply,
)
async def post_turn(body: TurnPost, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> TurnReply:
    """One turn of a slot's rollout, acknowledged durably as it ends (the same turn again: `duplicate`; another
    content, a turn out of order, a producer the slot's lease passed from, a slot acknowledged: 409), once the slot's
    turns with it meet every rule its rollout will meet at its seal (422 naming the field). A producer that takes the
    slot's lease gets its turns and continues from them."""
    return await service.rollouts.turn(body, settings, actor)


@route(
    router,
    "POST",
    "/rollouts/seal",
    ENV_SIDE,
    acts=acts("open_group"),
    body="json",
    statuses=(400, 404, 409, 422, 503),
    response_model=GroupView,
)
async def seal(body: SealRequest, service: ServiceDep, actor: ActorDep) -> GroupView:
    """Seal the group now with what is in (at least `min_group_size`), with the group's scores if scored as one."""
    return await service.rollouts.seal(body, actor)


@route(
    router,
    "POST",
    "/rollouts/lease",
    ENV_SIDE,
    acts=acts("open_group"),
    body="json",
    statuses=(400, 413, 422, 503),
    response_model=SlotLeaseReply,
)
async def lease(body: SlotLeaseRequest, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> SlotLeaseReply:
    """Up to `n` missing slots of this key's groups whose producer stopped heartbeating, each for
    `rollout_lease_s` (of the envs named in `envs` only, if given)."""
    return SlotLeaseReply(leases=await service.rollouts.lease(body, settings, actor))


@route(
    router,
    "POST",
    "/rollouts/heartbeat",
    ENV_SIDE,
    acts=acts("open_group"),
    body="json",
    statuses=(400, 422, 503),
    response_model=RolloutHeartbeatReply,
)
async def heartbeat(
    body: RolloutHeartbeat, service: ServiceDep, settings: SettingsDep, actor: ActorDep
) -> RolloutHeartbeatReply:
    """Extend what this producer holds of these groups (the missing slots of its own, the slots it leased)."""
    return RolloutHeartbeatReply(expires_at=await service.rollouts.heartbeat(body, settings.rollout_lease_s, actor))


@route(router, "GET", "/rollouts", ANY_KEY, acts=RUN, response_model=dict[str, int])
async def totals(service: ServiceDep) -> dict[str, int]:
    """Counters: groups opened, open now, sealed (partial), expired (by why), slots acknowledged, left out,
    redispatched to siblings, redone (a second rollout of a slot, dropped), refused, unfinished (groups a sweep
    could not read or finish, once per server process)."""
    return await service.rollouts.totals()


@route(
    router,
    "GET",
    "/rollouts/group",
    ANY_KEY,
    acts=acts("open_group", others=RUN_WIDE),
    statuses=(404, 422),
    response_model=GroupView,
)
async def group(
    service: ServiceDep,
    actor: ActorDep,
    group_id: str = Query(min_length=1, max_length=GROUP_ID_MAX, description="The group's id."),
) -> GroupView:
    """One group: its state, slots done and leased, what was left out and why (an env key sees its own)."""
    return await service.rollouts.group(group_id, actor, ("query", "group_id"))


@route(
    router,
    "GET",
    "/rollouts/turns",
    ANY_KEY,
    acts=acts("open_group", others=RUN_WIDE),
    statuses=(404, 422),
    response_model=SlotPrefix,
)
async def turns(
    service: ServiceDep,
    settings: SettingsDep,
    actor: ActorDep,
    group_id: str = Query(min_length=1, max_length=GROUP_ID_MAX, description="The group's id."),
    slot: int = Query(ge=0, le=SAFE_INT_MAX, description="The slot."),
    start: int = Query(0, ge=0, le=SAFE_INT_MAX, description="The first turn to return."),
) -> SlotPrefix:
    """A slot's acknowledged turns from `start`, as many as fit `rollout_max_prefix_reply_bytes` (one at least;
    `complete`: they reach the last), and the last snapshot: what a lease left out when they were too large."""
    return await service.rollouts.turns(group_id, slot, start, settings, actor, ("query", "group_id"))
