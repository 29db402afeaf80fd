"""The Atropos-protocol load harness (`buffer_bench.py`, found by `bench.servers.SHARED_BENCH`) against each
server.

Each ingest level runs as its own harness call with the server's CPU time read around it: on a machine of
two cores the harness's client saturates a core before a fast server does, so groups/s alone understates the
server. Server CPU milliseconds per ingested group is the capacity figure that survives that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.servers import ATROPOS_VENV, ROOT, SHARED_BENCH, Target

HARNESS = SHARED_BENCH / "buffer_bench.py"
_TICK = os.sysconf("SC_CLK_TCK")


def harness_python() -> str:
    """The harness needs httpx and numpy (and orjson, optionally): the project venv has them all."""
    venv = ATROPOS_VENV / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[tuple[int, list[str]]]:
    """The live children of a process (uvicorn's workers), with their `/proc/PID/stat` fields."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            child = int(stat.parent.name)
            fields = _stat(child)
        except (OSError, ValueError):  # ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append((child, fields))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, its live children (uvicorn's workers) and its reaped children."""
    total = sum(int(f) for f in _stat(pid)[11:15])
    total += sum(sum(int(f) for f in fields[11:13]) for _, fields in children(pid))
    return total / _TICK


def minor_faults(pid: int) -> int:
    """Minor page faults of a process, its live children and its reaped ones: memory it touched for the first
    time (or again after giving it back to the kernel), which a VM charges for."""
    fields = _stat(pid)
    return int(fields[7]) + int(fields[8]) + sum(int(f[7]) for _, f in children(pid))


MSGPACK_TRANSPORT = "bench.harness_msgpack:MsgpackTransport"
GZIP_TRANSPORT = "json-gzip"
"""The harness's stock Atropos client: gzip-9 request bodies, gzip accepted on /batch."""


def run_harness(
    target: Target, phases: str, extra: list[str], timeout: float = 600, transport: str = "json"
) -> list[dict[str, Any]]:
    if not HARNESS.exists():
        raise SystemExit(f"{HARNESS} is missing: the load harness lives in ../shared/bench beside the checkout")
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = Path(f.name)
    # The binary plug-in imports rollbuf's encoder: run the harness in this environment, with this checkout.
    python, env = (
        (harness_python(), None) if transport == "json" else (sys.executable, {**os.environ, "PYTHONPATH": str(ROOT)})
    )
    cmd = [python, str(HARNESS), "--url", target.url, "--phases", phases, "--out", str(out), "--pid", str(target.pid),
           "--label", target.name, "--transport", transport, *extra]  # fmt: skip
    subprocess.run(cmd, check=False, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    out.unlink()
    return [{**r, "target": target.name} for r in records if r.get("phase") in ("ingest", "batch", "memory")]


def run_ingest(target: Target, clients: list[int], extra: list[str], transport: str = "json") -> list[dict[str, Any]]:
    """One harness call per client count, with the server's CPU time per acknowledged group."""
    out = []
    for k in clients:
        before = cpu_seconds(target.pid)
        records = run_harness(target, "ingest", ["--ingest-clients", str(k), *extra], transport=transport)
        used = cpu_seconds(target.pid) - before
        for r in records:
            ok = r.get("requests_ok") or 0
            # The harness also registers, resets and warms up: a few requests against hundreds measured.
            r["server_cpu_ms_per_group"] = round(used * 1e3 / ok, 2) if ok else None
        out += records
    return out
