"""`rollbuf demo --learn`, short: a randomly initialised policy trained through the real service must get
better at its task. The assertion is on reward, never on time. It is what catches a loss misaligned with
the batch: shifting the loss mask or the old logprobs by one token keeps the reward at chance (the
mutations are recorded in docs/training.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60


def test_reward_rises_from_chance(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "api",  # `rollbuf demo`: the service's command finds the demo through its entry-point group
        "demo",
        "--learn",
        "--steps",
        str(STEPS),
        "--quiet",
        "--report",
        str(report_path),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(report_path.read_text())
    assert report["steps"] == STEPS and len(report["rows"]) == STEPS
    assert [r["step"] for r in report["rows"]] == list(range(STEPS))  # every batch once, in order
    assert all(r["max_staleness"] <= 1 for r in report["rows"])  # the server's bound held
    assert report["initial_reward"] < 0.2  # chance: 1/12 per position
    assert report["final_reward"] >= report["initial_reward"] + 0.3, report["rows"]
    # the docs' plot is made from such a report by a command
    png = tmp_path / "curve.png"
    subprocess.run([sys.executable, "-m", "demos.plot", str(report_path), str(png)], cwd=ROOT, check=True, timeout=120)
    assert png.read_bytes().startswith(b"\x89PNG")
