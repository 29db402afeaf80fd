"""`rollbuf demo` end to end, as a user runs it: a process that serves, produces, trains and balances its books."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("workers", [0, 1])
def test_demo_runs_and_accounts_for_every_group(workers: int) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "api", "demo", "--steps", "6", "--workers", str(workers)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("done in") and "6 batches of 32 sequences" in line for line in lines), out.stdout
    [accounting] = [line for line in lines if line.startswith("accounting:")]
    assert accounting.endswith(": ok"), accounting
    for env in ("add", "mul", "calculator", "tool_chat"):
        assert any(line.split()[:1] == [env] for line in lines), f"no mix line for {env}:\n{out.stdout}"
    [chat] = [line for line in lines if line.startswith("tool_chat:")]  # its tool metrics, from the batches
    assert " tool calls (" in chat and "template mismatches 0" in chat and "calculate ran 0 " not in chat, chat
