"""`register_dataset`: a plain dataset of tasks registered with rollbuf from the producer's side (docs/tasks.md, "A
dataset"), its rows from a Python iterable or a JSONL file on this machine.

The rows are sent a page at a time (POST /tasks/datasets with the first page, then POST /tasks/pages), each page
within the server's bounds: at most `task_page_size` tasks, read from the `maxItems` the server declares in its
`/openapi.json`, and at most `page_bytes` of task JSON, far below its `max_body_bytes`. So a dataset of any size
is registered without a request the server must refuse, and never held in memory whole.

Running it again is safe, whole or a page at a time: a registration already made is answered as it was, a page
is sent from the number of tasks the server says it holds (a page sent again stores nothing twice), and a dataset
sealed already is left as it is. The rows must then be the same, in the same order: the server does not compare
the tasks it holds with those sent again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import orjson

from api.wire.tasks import DatasetView
from client_core.errors import ClientError
from rollout_client.client import RolloutClient

DEFAULT_PAGE = 1000
"""Tasks a page where the server's description does not say (its `task_page_size` by default)."""
PAGE_BYTES = 16 << 20
"""Most bytes of task JSON a page (one task at least): a sixteenth of the server's default `max_body_bytes`."""
JSON = {"Content-Type": "application/json"}


async def register_dataset(
    client: RolloutClient,
    name: str,
    tasks: Iterable[Any] | os.PathLike[str],
    *,
    env: str | None = None,
    epochs: int | None = 1,
    order: Literal["sequential", "shuffled", "weighted"] = "sequential",
    seed: int = 0,
    max_retries: int = 0,
    levels: Mapping[str, float] | None = None,
    level_key: str = "level",
    page: int | None = None,
    page_bytes: int = PAGE_BYTES,
) -> DatasetView:
    """Register dataset `name` with `tasks` (any JSON values: an object's `prompt`, `answer` and `id` become the
    `Task` that `LeasedTasks` hands out, its other fields `Task.meta`), and seal it; its view as the server holds it.

    `tasks`: an iterable of rows (a generator is read once, a page at a time), or the path of a JSONL file on this
    machine (one JSON value a line, blank lines skipped). A file the server reads itself, under its
    `task_files_dir`, is registered with `path` instead (POST /tasks/datasets).

    `env`: the name of the env whose producers lease these tasks. The server shows it and does not enforce it
    (any producer of the key may lease them), but it counts at the run's end: an env named by a dataset is fed by
    that dataset from the start, so once every dataset is done and nothing else can come, the run is finished
    (`/batch` says `finished`, producers' `LeasedTasks` run out) even before that env sent a group under a lease.
    Without it, a connected env that never sent a leased group keeps the run open while its producer is live.

    `epochs` (None: forever), `order`, `seed`, `max_retries`, `levels` and `level_key`: as POST /tasks/datasets
    takes them (docs/tasks.md). `page`: most tasks a page (default: the server's `task_page_size`, from its
    `/openapi.json`); `page_bytes`: most bytes of task JSON a page.

    Safe to run again with the same rows (see the module's docstring): the requests are retried as `client`
    retries (`retry_deadline`), and a registration cut off midway goes on where the server's tasks end. A
    registration of `name` with another spec is a 409 (`Rejected`); a row that is not JSON (NaN, a set) is a
    ValueError naming its index, or its line in a file, before anything more is sent."""
    spec: dict[str, Any] = {
        "name": name,
        "env": env,
        "epochs": epochs,
        "order": order,
        "seed": seed,
        "max_retries": max_retries,
        "levels": None if levels is None else dict(levels),
        "level_key": level_key,
    }
    size = page if page is not None else await server_page_size(client)
    if size < 1 or page_bytes < 1:
        raise ValueError(f"page and page_bytes must be at least 1, got {size} and {page_bytes}")
    pages = Pages(_rows_of(tasks), size, page_bytes)
    first = pages.take(0)
    view = await _post(client, "/tasks/datasets", {**spec, "tasks": first, "last": pages.ended})
    while not view.sealed:
        tasks_page = pages.take(view.size)
        body = {"dataset": name, "first": view.size, "tasks": tasks_page, "last": pages.ended}
        view = await _post(client, "/tasks/pages", body)
    return view


async def server_page_size(client: RolloutClient) -> int:
    """The server's `task_page_size`, as its `/openapi.json` declares it (`maxItems` of a page's tasks);
    `DEFAULT_PAGE` where it cannot be read."""
    try:
        schema = await client._call("GET", "/openapi.json")
        declared = schema["components"]["schemas"]["TaskPage"]["properties"]["tasks"]["maxItems"]
    except (ClientError, KeyError, TypeError):
        return DEFAULT_PAGE
    return declared if isinstance(declared, int) and declared > 0 else DEFAULT_PAGE


async def _post(client: RolloutClient, path: str, body: dict[str, Any]) -> DatasetView:
    """POST `body` (its tasks JSON texts already) with `client`'s retries: the dataset's view in the reply."""
    content = orjson.dumps({**body, "tasks": [orjson.Fragment(t) for t in body["tasks"]]})
    return DatasetView.model_validate(await client._call("POST", path, content=content, headers=JSON))


class Pages:
    """The rows as JSON texts, taken a page at a time from any index at or after the last page's first: rows
    before it are skipped (the server holds them), the last page is kept (the server may hold only part of it,
    when a registration made before stored fewer), and one row is read ahead to know whether a page is the last."""

    def __init__(self, rows: Iterator[str], size: int, max_bytes: int) -> None:
        self._rows = rows
        self._size = size
        self._max_bytes = max_bytes
        self._buf: list[str] = []
        self._base = 0
        """The index of `_buf[0]`."""
        self._exhausted = False
        self.ended = False
        """The page last taken ends the rows."""

    def take(self, first: int) -> list[str]:
        """The page of rows from index `first`: at most `size` rows and `max_bytes` bytes (one row at least)."""
        if first < self._base:
            raise ValueError(f"the server holds {first} tasks, fewer than the {self._base} it said before")
        drop = min(first - self._base, len(self._buf))
        del self._buf[:drop]
        self._base += drop
        while self._base < first:  # the server holds more rows than were read: skip those
            if not self._pull():
                raise ValueError(f"the dataset holds {first} tasks, more than the {self._base} rows given")
            self._buf.clear()
            self._base += 1
        taken, used = 0, 0
        while True:
            if taken == len(self._buf) and not self._pull():
                self.ended = True
                return self._buf[:taken]
            cost = len(self._buf[taken].encode())
            if taken == self._size or (taken and used + cost > self._max_bytes):
                self.ended = False
                return self._buf[:taken]
            taken, used = taken + 1, used + cost

    def _pull(self) -> bool:
        if self._exhausted:
            return False
        row = next(self._rows, None)
        if row is None:
            self._exhausted = True
            return False
        self._buf.append(row)
        return True


def _rows_of(tasks: Iterable[Any] | os.PathLike[str]) -> Iterator[str]:
    if isinstance(tasks, str | bytes):
        raise TypeError("tasks is a str: pass the rows, or a file's path as a pathlib.Path")
    if isinstance(tasks, os.PathLike):
        return _file_rows(Path(tasks))
    return _encoded(tasks)


def _encoded(rows: Iterable[Any]) -> Iterator[str]:
    for i, row in enumerate(rows):
        try:
            yield json.dumps(row, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"task {i} is not JSON: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON the server takes")


def _file_rows(path: Path) -> Iterator[str]:
    """A JSONL file's lines, each checked as JSON (NaN and Infinity refused, as the server refuses them)."""
    with path.open(encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            text = line.strip()
            if not text:
                continue
            try:
                json.loads(text, parse_constant=_no_constant)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
            yield text
