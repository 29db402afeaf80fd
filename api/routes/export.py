"""GET /export: one table of the run's ledger and kept groups as a Parquet file, streamed (docs/ledger.md).

pyarrow is an optional extra: the route imports the export only when it is called, and answers 501
(`not_installed`) naming the extra when pyarrow is missing, so that the service itself never needs it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from api import export
from api.errors import NotInstalled, Unavailable
from api.keys.access import TRAINER_SIDE
from api.owners import RUN
from api.routes.deps import ServiceDep, SettingsDep
from api.routes.spec import route

router = APIRouter(tags=["trainer"])

Table = Literal["sequences", "groups", "steps", "tasks", "rollouts"]


class Streams:
    """Exports under way in this process, bounded by `max_exports`."""

    def __init__(self) -> None:
        self.active = 0


def _streams(request: Request) -> Streams:
    streams: Streams | None = getattr(request.app.state, "exports", None)
    if streams is None:
        streams = request.app.state.exports = Streams()
    return streams


@route(
    router,
    "GET",
    "/export",
    TRAINER_SIDE,
    acts=RUN,  # the run's data, as the trainer reads it
    statuses=(422, 501, 503),
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The table as a Parquet file, streamed (one row group at a time, the footer last).",
            "content": {export.PARQUET: {"schema": {"type": "string", "format": "binary"}}},
        },
    },
)
async def export_table(
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    table: Annotated[
        Table,
        Query(
            description="`sequences`: one row per kept sequence; `groups`: the ledger's group rows; `steps`: "
            "its step rows; `tasks`: every task handed out, with its fate (docs/tasks.md); `rollouts`: every group "
            "opened for per-rollout submission, with its slots (docs/rollouts.md)."
        ),
    ] = "sequences",
) -> StreamingResponse:
    """The run's data as a dataset: the ledger's groups or steps, or every sequence of the groups the store still
    holds, with its group, env, policy step, and the step that trained it or why it was dropped. Read it with
    pyarrow, `datasets.load_dataset("parquet", ...)`, pandas, Polars or DuckDB. `rollbuf export` writes all three."""
    if not export.available():
        raise NotInstalled(export.MISSING)
    from api.export.stream import parquet_stream

    streams = _streams(request)
    if streams.active >= settings.max_exports:
        raise Unavailable(
            f"{streams.active} exports are under way; the limit (max_exports) is {settings.max_exports}",
            settings.retry_after,
        )
    streams.active += 1

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in parquet_stream(table, service.store):
                yield chunk
        finally:
            streams.active -= 1

    headers = {"Content-Disposition": f'attachment; filename="{table}.parquet"'}
    return StreamingResponse(body(), media_type=export.PARQUET, headers=headers)
