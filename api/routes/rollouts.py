"""Groups whose rollouts arrive one by one (docs/rollouts.md): opened, posted a rollout at a time, heartbeated,
their missing slots leased to siblings, sealed (the env role, as heartbeats); views for anyone with a key."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query

from api.keys.access import ANY_KEY, ENV_SIDE
from api.ledger.recorder import recorder
from api.owners import RUN, RUN_WIDE, Actor, acts
from api.rollouts import service as rs
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
)
from api.wire.rules import GROUP_ID_MAX

router = APIRouter(tags=["rollouts"])


@route(router, "POST", "/rollouts/open", ENV_SIDE, acts=acts("env", "open_group"), body="json",
       statuses=(400, 403, 404, 409, 422, 503), response_model=GroupView)  # fmt: skip
async def open_group(body: OpenRequest, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> GroupView:
    """Open a group of `group_size` rollouts for one task; post them with POST /rollouts/post as they end."""
    service.rollouts_in_use()
    now = time.time()
    limits, known = service.limits, service.known_run
    return await service.store.transact(
        lambda txn: rs.open_txn(txn, body, now, settings, actor, limits=limits, known=known)
    )


@route(router, "POST", "/rollouts/post", ENV_SIDE, acts=acts("open_group"), body="ingest",
       statuses=(400, 404, 409, 422, 503), response_model=PostReply)  # fmt: skip
async def post_rollout(body: RolloutPost, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> PostReply:
    """One rollout, acknowledged durably (the same content again: `duplicate`; from another producer after the
    first: `redone`, the first kept; other content from its producer: 409), once it meets every rule its sealed
    group will meet at ingest (422 naming the field otherwise). The last of G seals the group."""
    service.rollouts_in_use()
    now = time.time()
    books = recorder(service.books)
    limits, known = service.limits, service.known_run
    reply, sealing = await service.store.transact(
        lambda txn: rs.post_txn(txn, body, now, settings, books, actor, limits=limits, known_run=known)
    )
    if sealing:
        await rs.finish(service, body.group_id)
        reply = reply.model_copy(update={"group": await _view(service, body.group_id, actor)})
    return reply


@route(router, "POST", "/rollouts/seal", ENV_SIDE, acts=acts("open_group"), body="json",
       statuses=(400, 404, 409, 422, 503), response_model=GroupView)  # fmt: skip
async def seal(body: SealRequest, service: ServiceDep, actor: ActorDep) -> GroupView:
    """Seal the group now with what is in (at least `min_group_size`), with the group's scores if scored as one."""
    service.rollouts_in_use()
    now = time.time()
    if await service.store.transact(lambda txn: rs.seal_txn(txn, body, now, actor)):
        await rs.finish(service, body.group_id)
    return await _view(service, body.group_id, actor)


@route(router, "POST", "/rollouts/lease", ENV_SIDE, acts=acts("open_group"), body="json",
       statuses=(400, 413, 422, 503), response_model=SlotLeaseReply)  # fmt: skip
async def lease(body: SlotLeaseRequest, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> SlotLeaseReply:
    """Up to `n` missing slots of this key's groups whose producer stopped heartbeating, each for
    `rollout_lease_s` (of the envs named in `envs` only, if given)."""
    service.rollouts_in_use()
    await rs.sweep(service, settings.rollout_sweep_limit)
    now = time.time()
    n = min(body.n, settings.rollout_sweep_limit)
    leases = await service.store.transact(
        lambda txn: rs.lease_txn(txn, body.producer_id, n, now, settings, body.envs, actor)
    )
    return SlotLeaseReply(leases=leases)


@route(router, "POST", "/rollouts/heartbeat", ENV_SIDE, acts=acts("open_group"), body="json",
       statuses=(400, 422, 503), response_model=RolloutHeartbeatReply)  # fmt: skip
async def heartbeat(
    body: RolloutHeartbeat, service: ServiceDep, settings: SettingsDep, actor: ActorDep
) -> RolloutHeartbeatReply:
    """Extend what this producer holds of these groups (the missing slots of its own, the slots it leased)."""
    service.rollouts_in_use()
    now = time.time()
    out = await service.store.transact(
        lambda txn: rs.heartbeat_txn(txn, body.producer_id, body.group_ids, now, settings.rollout_lease_s, actor)
    )
    return RolloutHeartbeatReply(expires_at=out)


@route(router, "GET", "/rollouts", ANY_KEY, acts=RUN, response_model=dict[str, int])
async def totals(service: ServiceDep) -> dict[str, int]:
    """Counters: groups opened, open now, sealed (partial), expired (by why), slots acknowledged, left out,
    redispatched to siblings, redone (a second rollout of a slot, dropped), refused, unfinished (groups a sweep
    could not read or finish, once per server process)."""
    return await service.store.read(rs.totals_txn)


@route(router, "GET", "/rollouts/group", ANY_KEY, acts=acts("open_group", others=RUN_WIDE), statuses=(404, 422),
       response_model=GroupView)  # fmt: skip
async def group(
    service: ServiceDep,
    actor: ActorDep,
    group_id: str = Query(min_length=1, max_length=GROUP_ID_MAX, description="The group's id."),
) -> GroupView:
    """One group: its state, slots done and leased, what was left out and why (an env key sees its own)."""
    return await _view(service, group_id, actor, ("query", "group_id"))


async def _view(
    service: ServiceDep, key: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "group_id")
) -> GroupView:
    return rs.view(await service.store.read(lambda txn: rs.group_of(txn, key, actor, loc)))
