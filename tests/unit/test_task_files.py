"""Dataset files (api/tasks/files.py): the server reads only under its `task_files_dir`, a page at a time, each
task bounded, resuming where the stored tasks end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from api.errors import InvalidData
from api.tasks.files import TaskFile, resolve


def test_no_root_reads_nothing(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text("1\n")
    with pytest.raises(InvalidData, match="task_files_dir is unset"):
        resolve(None, str(tmp_path / "d.jsonl"))


def test_paths_that_leave_the_root_are_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "secret.jsonl"
    (root / "sub").mkdir(parents=True)
    outside.write_text("1\n")
    (root / "sub" / "d.jsonl").write_text("1\n")
    (root / "link.jsonl").symlink_to(outside)
    (root / "inside.jsonl").symlink_to(root / "sub" / "d.jsonl")
    os.mkfifo(root / "fifo.jsonl")
    assert resolve(root, "sub/d.jsonl") == (root / "sub" / "d.jsonl").resolve()
    assert resolve(root, str(root / "sub" / "d.jsonl")) == (root / "sub" / "d.jsonl").resolve(), "absolute, inside"
    assert resolve(root, "inside.jsonl") == (root / "sub" / "d.jsonl").resolve(), "a link that stays inside"
    for path in ("../secret.jsonl", str(outside), "link.jsonl", "sub/../../secret.jsonl", "/etc/passwd"):
        with pytest.raises(InvalidData, match="not under task_files_dir"):
            resolve(root, path)
    for path in ("sub", "fifo.jsonl", "missing.jsonl", ""):
        with pytest.raises(InvalidData, match="no file"):
            resolve(root, path)


def pages(path: Path, skip: int, page: int, max_bytes: int = 1000) -> list[list[str]]:
    out = []
    with TaskFile(path, skip, page, max_bytes) as f:
        while got := f.next_page():
            out.append(got)
            if len(got) < page:
                break
    return out


def test_jsonl_pages_resume_and_bounds(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"q": {i}}}\n\n' for i in range(7)))
    assert [len(p) for p in pages(path, 0, 3)] == [3, 3, 1]
    assert [json.loads(t)["q"] for p in pages(path, 5, 3) for t in p] == [5, 6], "resumes at task 5 (blanks skipped)"
    path.write_text('1\n"' + "x" * 2000 + '"\n')
    with pytest.raises(InvalidData, match="task 1 is over 1000 bytes"):
        pages(path, 0, 10)
    path.write_text("x" * 10_000_000)  # no line break: refused after max_bytes, never read whole
    with pytest.raises(InvalidData, match="task 0 is over 1000 bytes"):
        pages(path, 0, 10)
    path.write_text("1\n{nope\n")
    with pytest.raises(InvalidData, match="task 1 is not JSON"):
        pages(path, 0, 10)


def test_parquet_rows_are_tasks(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": [f"p{i}" for i in range(10)], "level": [i % 3 for i in range(10)]})
    pq.write_table(table, path, row_group_size=4)
    read = [json.loads(t) for p in pages(path, 0, 3) for t in p]
    assert read == [{"prompt": f"p{i}", "level": i % 3} for i in range(10)]
    assert [json.loads(t)["prompt"] for p in pages(path, 5, 3) for t in p] == [f"p{i}" for i in range(5, 10)]
    assert pages(path, 10, 3) == []
    (tmp_path / "not.parquet").write_text("1\n")
    with pytest.raises(InvalidData, match="not a Parquet file"):
        pages(tmp_path / "not.parquet", 0, 3)
