"""Dataset files the server reads (`path` of POST /tasks/datasets, docs/tasks.md): where it may read, and how.

Where: only under the operator's `task_files_dir` (unset: nowhere), so that a key holder cannot make the server
read an arbitrary file: the path is resolved (`..` and symbolic links followed) and must land on a regular file
inside the resolved root. How: a page at a time from one open file, never the whole file, each task at most
`task_max_bytes`: JSONL (one JSON value a line, blank lines skipped) or, for a name ending in `.parquet`, Parquet
(one task a row, a JSON object of its columns; needs pyarrow, the `export` extra), read a record batch at a time.
Each task is held to the rules of tasks sent inline (`api.run.printable.check_printable`): every lease hands it
out as JSON, so what no reply can carry is refused when the dataset is registered, naming the task.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import IO, Any

from api.errors import Conflict, InvalidData, NotFound
from api.run.printable import MAX_META_DEPTH, check_printable

WHERE = ("body", "path")
PARQUET_SUFFIX = ".parquet"


def resolve(root: Path | None, path: str) -> Path:
    """`path` (relative to `root`) as a regular file inside `root`, or 422 naming the rule it breaks: any text
    is answered so (a NUL byte, a name too long for the file system, a loop of symbolic links)."""
    if root is None:
        raise Conflict("this server reads no dataset files (task_files_dir is unset)", loc=WHERE)
    if "\x00" in path:
        raise InvalidData(WHERE, "a path cannot hold a NUL byte")
    base = root.resolve()
    try:
        resolved = (base / path).resolve()  # an absolute `path` replaces base: then it must still be inside it
        inside = resolved.is_relative_to(base)
        found = inside and resolved.is_file()
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a loop of symbolic links (Python 3.11)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a loop of symbolic links"
        raise InvalidData(WHERE, f"{path!r} cannot be looked up under task_files_dir: {why}") from None
    if not inside:
        raise InvalidData(WHERE, f"{path!r} is not under task_files_dir")
    if not found:
        raise NotFound(f"no file {path!r} under task_files_dir", loc=WHERE)
    return resolved


def _too_big(index: int, max_bytes: int) -> InvalidData:
    return InvalidData(WHERE, f"task {index} is over {max_bytes} bytes (task_max_bytes)")


_WALK = re.compile(r"\\u[dD][89a-fA-F]|\d{19}|[eE][+-]?\d{3}|NaN|Infinity")
"""What a task's JSON text holds if its value may break a rule that parsing lets through: a surrogate's escape (a lone
one is a string no reply can carry), 19 digits in a row (an integer past 64 bits, or a number that is infinite as a
float), an exponent of 3 digits (1e400), NaN or Infinity. A text without any, and with fewer brackets than
MAX_META_DEPTH (so nested less deep), is held to the rules without walking its value."""


_UNREAD = object()


def checked(text: str, index: int, value: Any = _UNREAD) -> str:
    """`text`, the JSON of task `index`, once its value (`value`, or `text` parsed, only if needed) meets the rules
    of a task sent inline; else 422 naming the task and where in it."""
    if text.count("[") + text.count("{") < MAX_META_DEPTH and not _WALK.search(text):
        return text
    try:
        check_printable({"tasks": [json.loads(text) if value is _UNREAD else value]})  # the depth inline tasks have
    except InvalidData as exc:
        inside = ".".join(map(str, exc.loc[2:]))
        raise InvalidData(WHERE, f"task {index}{' at ' + inside if inside else ''}: {exc.msg}") from None
    return text


def _jsonl(f: IO[bytes], skip: int, max_bytes: int) -> Iterator[str]:
    index = 0
    while True:
        raw = f.readline(max_bytes + 2)  # a line over the bound is refused, never read whole
        if not raw:
            return
        line = raw.strip()
        if not line:
            continue
        if len(line) > max_bytes or (len(raw) > max_bytes + 1 and not raw.endswith(b"\n")):
            raise _too_big(index, max_bytes)
        if index >= skip:
            try:
                text = line.decode("utf-8")
                value = json.loads(text)
            except ValueError as exc:
                raise InvalidData(WHERE, f"task {index} is not JSON: {exc}") from None
            except RecursionError:  # the parser's own bound, far past the rule's
                raise InvalidData(WHERE, f"task {index}: nested deeper than {MAX_META_DEPTH} levels") from None
            yield checked(text, index, value)
        index += 1


def _parquet(path: Path, skip: int, batch: int, max_bytes: int) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # the optional `export` extra
    except ImportError:
        raise InvalidData(WHERE, "Parquet datasets need pyarrow (the export extra): send JSONL") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own types for a file that is not Parquet
        raise InvalidData(WHERE, f"{path.name} is not a Parquet file: {exc}") from None
    index, first = 0, 0
    while first < f.metadata.num_row_groups and index + f.metadata.row_group(first).num_rows <= skip:
        index += f.metadata.row_group(first).num_rows  # row groups wholly before `skip` are never read
        first += 1
    groups = list(range(first, f.metadata.num_row_groups))
    if not groups:
        return
    for record_batch in f.iter_batches(batch_size=batch, row_groups=groups):
        for row in record_batch.to_pylist():
            if index >= skip:
                text = json.dumps(row, separators=(",", ":"), default=str)
                if len(text) > max_bytes:
                    raise _too_big(index, max_bytes)
                yield checked(text, index)
            index += 1


class TaskFile:
    """An open dataset file, read a page at a time from task `skip` on (a retried registration resumes there)."""

    def __init__(self, path: Path, skip: int, page: int, max_bytes: int) -> None:
        self._handle: IO[bytes] | None = None
        self._tasks: Iterator[str]
        if path.name.endswith(PARQUET_SUFFIX):
            self._tasks = _parquet(path, skip, page, max_bytes)
        else:
            try:
                self._handle = path.open("rb")
            except OSError as exc:
                raise InvalidData(WHERE, f"{path.name} cannot be read: {exc.strerror}") from None
            self._tasks = _jsonl(self._handle, skip, max_bytes)
        self._page = page

    def next_page(self) -> list[str]:
        """The next page (fewer than a page: the file ends there)."""
        return list(islice(self._tasks, self._page))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def __enter__(self) -> TaskFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
