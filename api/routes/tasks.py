"""Tasks leased from rollbuf (docs/tasks.md): datasets registered and paged in, leases taken, heartbeated and
given up by producers (the env role, as heartbeats), views for anyone with a key."""

from __future__ import annotations

from fastapi import APIRouter, Query

from api.keys.access import ANY_KEY, ENV_SIDE
from api.owners import RUN_WIDE, acts
from api.routes.deps import ActorDep, ServiceDep, SettingsDep
from api.routes.spec import route
from api.wire.rules import SAFE_INT_MAX
from api.wire.tasks import (
    DatasetSpec,
    DatasetView,
    LeaseReply,
    LeaseRequest,
    TaskFailure,
    TaskFailureReply,
    TaskHeartbeatReply,
    TaskPage,
    TaskRows,
    TaskTokens,
)

router = APIRouter(tags=["tasks"])


@route(
    router,
    "POST",
    "/tasks/datasets",
    ENV_SIDE,
    acts=acts("dataset"),
    body="ingest",
    statuses=(400, 404, 409, 422, 503),
    response_model=DatasetView,
)
async def register_dataset(
    body: DatasetSpec, service: ServiceDep, settings: SettingsDep, actor: ActorDep
) -> DatasetView:
    """Register a dataset: its tasks inline (`tasks`, more pages with POST /tasks/pages) or a JSONL or Parquet
    file the server reads (`path`, under `task_files_dir`; none without it: 409). A retry of the same
    registration is safe: while the file is read, it waits for that reading (from another server process: a 409
    saying how far it got); after a reading cut off, it goes on where it stopped. A key registers at most
    `task_max_datasets_per_key` datasets holding `task_max_bytes_per_key` of tasks (409 beyond)."""
    return await service.tasks.register(settings, body, actor)


@route(
    router,
    "POST",
    "/tasks/pages",
    ENV_SIDE,
    acts=acts("dataset"),
    body="ingest",
    statuses=(400, 404, 409, 422, 503),
    response_model=DatasetView,
)
async def add_page(body: TaskPage, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> DatasetView:
    """The next page of a dataset's tasks (`first`: the tasks stored so far, 409 past them; of a page sent again,
    only the tasks past those stored are stored); `last` seals it."""
    return await service.tasks.add_page(settings, body, actor)


@route(
    router,
    "POST",
    "/tasks/lease",
    ENV_SIDE,
    acts=acts("dataset"),
    body="json",
    statuses=(400, 404, 422, 503),
    response_model=LeaseReply,
)
async def lease(body: LeaseRequest, service: ServiceDep, settings: SettingsDep, actor: ActorDep) -> LeaseReply:
    """Up to `n` tasks (at most `task_page_size`, and those that fit `task_lease_max_bytes` of task data, one at
    least), each leased for `task_lease_s` unless heartbeated: tasks whose lease expired or that are retried come
    first, then the cursor's next. Send each task's group with its `token` as `group_id`."""
    return await service.tasks.lease(settings, body, actor)


@route(
    router,
    "POST",
    "/tasks/heartbeat",
    ENV_SIDE,
    acts=acts("task_lease"),
    body="json",
    statuses=(400, 422, 503),
    response_model=TaskHeartbeatReply,
)
async def heartbeat(
    body: TaskTokens, service: ServiceDep, settings: SettingsDep, actor: ActorDep
) -> TaskHeartbeatReply:
    """Extend leases; null for those lost."""
    return await service.tasks.heartbeat(settings, body.tokens, actor)


@route(
    router,
    "POST",
    "/tasks/fail",
    ENV_SIDE,
    acts=acts("task_lease"),
    body="json",
    statuses=(400, 422, 503),
    response_model=TaskFailureReply,
)
async def fail(body: TaskFailure, service: ServiceDep, actor: ActorDep) -> TaskFailureReply:
    """End a lease without a group: failed with `reason` (the dataset's retry policy applies), or handed back."""
    return await service.tasks.fail(body, actor)


@route(
    router,
    "GET",
    "/tasks",
    ANY_KEY,
    acts=acts("dataset", others=RUN_WIDE),
    statuses=(422,),
    response_model=list[DatasetView],
)
async def datasets(
    service: ServiceDep,
    settings: SettingsDep,
    actor: ActorDep,
    after: str | None = Query(None, max_length=64, description="Datasets named after this: the last page's last."),
    limit: int | None = Query(None, ge=1, le=SAFE_INT_MAX, description="Most datasets (at most views_max_datasets)."),
) -> list[DatasetView]:
    """The datasets this key sees, by name, a page at a time (`views_max_datasets`; an empty page after the last):
    each one's cursor and how many tasks are in each state."""
    cap = settings.views_max_datasets
    return await service.tasks.datasets(actor, after=after, limit=min(limit or cap, cap))


@route(
    router,
    "GET",
    "/tasks/rows",
    ANY_KEY,
    acts=acts("dataset", others=RUN_WIDE),
    statuses=(404, 422),
    response_model=TaskRows,
)
async def rows(
    service: ServiceDep,
    settings: SettingsDep,
    actor: ActorDep,
    dataset: str = Query(description="The dataset's name."),
    after_epoch: int = Query(
        -1, ge=-1, le=SAFE_INT_MAX, description="Tasks after this (epoch, index): the last page's `next`."
    ),
    after_index: int = Query(-1, ge=-1, le=SAFE_INT_MAX, description="See `after_epoch`."),
    limit: int = Query(1000, ge=1, le=SAFE_INT_MAX, description="Most tasks (at most `task_page_size`)."),
) -> TaskRows:
    """A page of a dataset's tasks handed out so far, by (epoch, index), each with its fate."""
    return await service.tasks.rows(settings, dataset, (after_epoch, after_index), limit, actor)
