"""docs/ledger-export.md's example runs as written: `rollbuf demo --export run-export` (with `--steps 6` instead of
40, for time), then the notebook-style Python block, which reads the three tables and plots the run's mix and
drops with matplotlib."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def example() -> tuple[list[str], str]:
    """The example's shell commands (not `pip`) and its Python block."""
    text = (ROOT / "docs" / "ledger-export.md").read_text()
    section = text.split("## Example: a run's mix and drops", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    python = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    commands = [line for line in bash.splitlines() if line.strip() and not line.startswith("pip ")]
    return commands, python


def test_the_export_example_runs_as_written(tmp_path: Path) -> None:
    commands, python = example()
    assert commands == ["rollbuf demo --export run-export"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in commands:
        args = shlex.split(command)
        assert args[0] == "rollbuf"
        done = subprocess.run(
            [sys.executable, "-m", "api", *args[1:], "--steps", "6"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    ran = subprocess.run(
        [sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert re.fullmatch(r"6 steps, \d+ groups dropped, \d+ sequences trained on\n", ran.stdout), ran.stdout
    assert (tmp_path / "run-mix.png").stat().st_size > 10_000


def test_the_export_columns_the_page_names_are_the_files_columns() -> None:
    """A page that names a column the file lacks (`id` for `group`, `reason` for `drop_reason`) misleads every
    query written from it. Each file's row of the page's table names exactly its columns, in order (what is in
    parentheses explains)."""
    from api.export.table import groups_schema, sequences_schema, steps_schema

    text = (ROOT / "docs" / "ledger-export.md").read_text()
    for name, schema in (("sequences", sequences_schema()), ("groups", groups_schema()), ("steps", steps_schema())):
        [row] = [line for line in text.splitlines() if line.startswith(f"| `{name}.parquet` |")]
        cell = row.rstrip(" |").rsplit(" | ", 1)[1]
        while re.search(r"\([^()]*\)", cell):
            cell = re.sub(r"\([^()]*\)", "", cell)
        named = [n for n in re.findall(r"`([a-z_]+)`", cell)]
        assert named == schema.names, f"{name}.parquet: the page names {named}, the file has {schema.names}"
