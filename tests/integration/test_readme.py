"""The README's quick start, run as written against a real server: a newcomer's first copy-paste must work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import running_server

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's quick start has no python block"
    return match.group(1)


def test_quick_start_runs_against_a_server(tmp_path: Path) -> None:
    code = quick_start()
    assert 'URL = "http://127.0.0.1:8000"' in code
    with running_server("memory://", tmp_path / "server.log") as server:
        code = code.replace('URL = "http://127.0.0.1:8000"', f'URL = "{server.url}"')
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=README.parent
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["0", "(8,", "3)"], ["1", "(8,", "3)"]], done.stdout
