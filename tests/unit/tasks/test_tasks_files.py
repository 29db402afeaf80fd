"""Dataset files (api/tasks/files.py): the server reads only under its `task_files_dir`, a page at a time, each
task bounded, resuming where the stored tasks end; any path and any line is answered (a task, or a 422 naming the
path), fuzzed with hypothesis."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.errors import Conflict, InvalidData, NotFound, RollbufError
from api.run.printable import check_printable
from api.tasks import files
from api.tasks.files import TaskFile, resolve


def test_no_root_reads_nothing(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text("1\n")
    with pytest.raises(Conflict, match="task_files_dir is unset"):
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
    for path in ("sub", "fifo.jsonl", "missing.jsonl", ""):  # no regular file: as unknown as one missing
        with pytest.raises(NotFound, match="no file"):
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


text = st.text(st.characters(categories=["Cs", "Ll", "Nd", "Cc"]), max_size=4)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
nested = st.integers(25, 40).map(lambda depth: "[" * depth + "0" + "]" * depth)
"""JSON text nested around the bound (MAX_META_DEPTH): some pass, some do not."""
lines = (
    json_values.map(json.dumps)  # NaN and Infinity as Python writes them, lone surrogates as `\ud800` escapes
    | nested
    | st.integers(0, 200_000).map(lambda depth: "[" * depth + "]" * depth)
    | st.sampled_from(["1e400", "-1e400", "[1E+999]", '{"a": 1e308}', "123456789012345678901234567890"])
)


def read_line(line: bytes) -> list[str]:
    return list(files._jsonl(io.BytesIO(line + b"\n"), 0, 10_000_000))


@settings(max_examples=300, deadline=None)
@given(lines.map(str.encode) | st.binary(max_size=20))
def test_a_dataset_line_is_a_task_every_lease_can_carry_or_is_refused_naming_it(line: bytes) -> None:
    """Any line (lone surrogates at any depth, nesting to 200,000, NaN, integers past 64 bits, numbers that are
    infinite as floats, bytes that are not UTF-8) is a task or a 422 naming `path` and the task: a task is a JSON
    value every lease reply can carry (strict JSON, valid Unicode, 64-bit integers, nested at most as deep as a task
    sent inline may be)."""
    try:
        tasks = read_line(line)
    except InvalidData as exc:
        assert exc.loc == ("body", "path") and exc.msg.startswith("task 0"), exc.msg
        return
    if not tasks:
        return  # a blank line
    [task] = tasks
    value = json.loads(task)
    json.dumps(value, allow_nan=False, ensure_ascii=False).encode()
    check_printable({"tasks": [value]})  # the rule of tasks sent inline holds


@settings(max_examples=300, deadline=None)
@given(json_values | nested.map(json.loads))
def test_a_task_text_skips_the_walk_only_when_the_walk_would_find_nothing(value: Any) -> None:
    """`checked` walks a task's value only when its text may hide a break of the rules: it refuses exactly what
    the rule of tasks sent inline refuses."""
    text = json.dumps(value)
    try:
        check_printable({"tasks": [value]})
    except InvalidData:
        with pytest.raises(InvalidData):
            files.checked(text, 0, value)
        return
    assert files.checked(text, 0, value) == text


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("root")
    (root / "d.jsonl").write_text("1\n")
    (root / "loop").symlink_to(root / "loop")
    return root


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=8)
    | st.text(st.sampled_from("a/.\x00\ud800\udc80"), max_size=8)
    | st.just("a" * 300)
    | st.sampled_from(["loop", "loop/x", "d.jsonl", "d.jsonl\x00", "x/" * 3000])
)
def test_a_path_resolves_inside_the_root_or_is_a_422_naming_it(root: Path, path: str) -> None:
    """Any text as a dataset `path` (NUL bytes, lone surrogates, names too long for the file system, a loop of
    symbolic links) is a file under the root or a 4xx naming `path`."""
    try:
        found = resolve(root, path)
    except RollbufError as exc:
        assert exc.loc == ("body", "path") and 400 <= exc.status_code < 500, exc
        return
    assert found.is_relative_to(root.resolve()) and found.is_file()
