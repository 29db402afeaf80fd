"""Producers and weights: the trainer announces which weights are live, producers heartbeat, anyone reads both."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from api.http.frontdoor import actor_of
from api.keys.access import ANY_KEY, ENV_SIDE, TRAINER_SIDE
from api.owners import RUN, acts
from api.routes.deps import ServiceDep, SettingsDep
from api.routes.spec import route
from api.wire.producers import Heartbeat, HeartbeatReply, ProducerView, WeightsAnnounce, WeightsReply, WeightSyncReply
from api.wire.rules import PRODUCER_ID_MAX, SAFE_INT_MAX

router = APIRouter(tags=["producers"])


@route(router, "POST", "/weights", TRAINER_SIDE, acts=RUN, statuses=(400, 409, 422), response_model=WeightsReply)
async def announce_weights(body: WeightsAnnounce, service: ServiceDep) -> WeightsReply:
    """The weights of trainer step `step` are live on the inference servers (the trainer sends it after each
    weight sync). Producers read it in `/status-env` and heartbeat replies, and stamp it on the groups they start
    from then on; `max_staleness` is judged against it. Never goes back: an older step changes nothing."""
    return await service.producers.announce_weights(body.step)


@route(router, "GET", "/weights", ANY_KEY, acts=RUN, response_model=WeightsReply)
async def weights(service: ServiceDep) -> WeightsReply:
    """The step of the weights announced live last (null before any)."""
    return await service.producers.weights()


@route(
    router, "POST", "/weights/pending", TRAINER_SIDE, acts=RUN, statuses=(400, 409, 422), response_model=WeightSyncReply
)
async def begin_weights(body: WeightsAnnounce, service: ServiceDep) -> WeightSyncReply:
    """A weight sync to `step` begins (the trainer sends it before pushing weights; POST /weights ends it).
    Producers of envs with `on_new_weights="drain"` learn it from `/status-env` or their heartbeat's reply, start
    no new group of those envs, finish the episodes in flight and report drained in their heartbeat. The reply
    says which live producers the sync still waits for (`waiting_on`); `drained` once none. A retry is safe."""
    return await service.producers.begin_weights(body.step)


@route(router, "GET", "/weights/pending", ANY_KEY, acts=RUN, response_model=WeightSyncReply)
async def weight_sync(service: ServiceDep) -> WeightSyncReply:
    """The weight sync begun and not yet announced (`pending_step`, null when none) and the live producers it
    still waits for."""
    return await service.producers.weight_sync()


@route(
    router,
    "POST",
    "/producers/heartbeat",
    ENV_SIDE,
    acts=acts("env", "producer"),
    statuses=(400, 403, 404, 409, 422, 503),
    response_model=HeartbeatReply,
)
async def heartbeat(body: Heartbeat, request: Request, service: ServiceDep) -> HeartbeatReply:
    """A producer is alive: its envs, in flight, rate, failures, weights, what holds it back. One not heard of
    for `producer_gone_after` s is gone (/status, /metrics; a waiting trainer's `stall_reason`)."""
    return await service.producers.heartbeat(body, actor_of(request.scope))


@route(router, "GET", "/producers", ANY_KEY, acts=RUN, statuses=(422,), response_model=list[ProducerView])
async def producers(
    service: ServiceDep,
    settings: SettingsDep,
    after: str | None = Query(
        None, max_length=PRODUCER_ID_MAX, description="Producers whose id sorts after this: the last page's last."
    ),
    limit: int | None = Query(None, ge=1, le=SAFE_INT_MAX, description="Most producers (at most views_max_producers)."),
) -> list[ProducerView]:
    """The producers that heartbeat, live or gone, with their last-seen time, by id, a page at a time
    (`views_max_producers`; an empty page after the last)."""
    views = sorted((await service.producers.report()).producers, key=lambda p: p.producer_id)
    cap = min(limit or settings.views_max_producers, settings.views_max_producers)
    return [p for p in views if after is None or p.producer_id > after][:cap]
