"""The shared Atropos-protocol load harness (../shared/bench/buffer_bench.py) against each server."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.servers import ATROPOS_VENV, ROOT, Target

HARNESS = ROOT.parent / "shared" / "bench" / "buffer_bench.py"


def harness_python() -> str:
    """The harness needs httpx and numpy (and orjson, optionally): the project venv has them all."""
    venv = ATROPOS_VENV / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_harness(target: Target, phases: str, extra: list[str], timeout: float = 600) -> list[dict[str, Any]]:
    if not HARNESS.exists():
        raise SystemExit(f"{HARNESS} is missing: the load harness lives in ../shared/bench beside the checkout")
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = Path(f.name)
    cmd = [harness_python(), str(HARNESS), "--url", target.url, "--phases", phases, "--out", str(out),
           "--pid", str(target.pid), "--label", target.name, *extra]  # fmt: skip
    subprocess.run(cmd, check=False, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    out.unlink()
    return [{"target": target.name, **r} for r in records if r.get("phase") in ("ingest", "batch", "memory")]
