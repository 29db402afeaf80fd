"""Dataset files the server reads (`path` of POST /tasks/datasets, docs/tasks.md): where it may read, and how.

Where: only under the operator's `task_files_dir` (unset: nowhere), so that a key holder cannot make the server
read an arbitrary file: the path is resolved (`..` and symbolic links followed) and must land on a regular file
inside the resolved root. How: a page at a time from one open file, never the whole file, each task at most
`task_max_bytes`: JSONL (one JSON value a line, blank lines skipped) or, for a name ending in `.parquet`, Parquet
(one task a row, a JSON object of its columns; needs pyarrow, the `export` extra), read a record batch at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import IO, Any

from api.errors import InvalidData

WHERE = ("body", "path")
PARQUET_SUFFIX = ".parquet"


def resolve(root: Path | None, path: str) -> Path:
    """`path` (relative to `root`) as a regular file inside `root`, or 422 naming the rule it breaks."""
    if root is None:
        raise InvalidData(WHERE, "this server reads no dataset files (task_files_dir is unset)")
    base = root.resolve()
    resolved = (base / path).resolve()  # an absolute `path` replaces base: then it must still be inside it
    if not resolved.is_relative_to(base):
        raise InvalidData(WHERE, f"{path!r} is not under task_files_dir")
    if not resolved.is_file():
        raise InvalidData(WHERE, f"no file {path!r} under task_files_dir")
    return resolved


def _too_big(index: int, max_bytes: int) -> InvalidData:
    return InvalidData(WHERE, f"task {index} is over {max_bytes} bytes (task_max_bytes)")


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
                json.loads(text)
            except ValueError as exc:
                raise InvalidData(WHERE, f"task {index} is not JSON: {exc}") from None
            yield text
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
                yield text
            index += 1


class TaskFile:
    """An open dataset file, read a page at a time from task `skip` on (a retried registration resumes there)."""

    def __init__(self, path: Path, skip: int, page: int, max_bytes: int) -> None:
        self._handle: IO[bytes] | None = None
        self._tasks: Iterator[str]
        if path.name.endswith(PARQUET_SUFFIX):
            self._tasks = _parquet(path, skip, page, max_bytes)
        else:
            self._handle = path.open("rb")
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
