"""The Atropos-protocol load harness against each server: rollbuf's own (`bench/harness.py`, in process) by
default; `use_harness("shared")` (`--harness shared` of `python -m bench` and `bench.ab`) runs the shared
`buffer_bench.py` instead, found by `bench.servers.SHARED_BENCH` beside the checkout, as an outside cross-check.
Both take the same flags and write records of the same fields.

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

from bench import harness
from bench.servers import ATROPOS_VENV, ROOT, SHARED_BENCH, Target

SHARED_HARNESS = SHARED_BENCH / "buffer_bench.py"
HARNESSES = ("rollbuf", "shared")
_harness = "rollbuf"
_TICK = os.sysconf("SC_CLK_TCK")


def use_harness(name: str) -> None:
    """Which harness `run_harness` runs from now on: `rollbuf` (`bench/harness.py`) or `shared` (exits when
    `buffer_bench.py` is not beside the checkout)."""
    global _harness
    if name not in HARNESSES:
        raise SystemExit(f"unknown harness {name!r}: one of {', '.join(HARNESSES)}")
    if name == "shared" and not SHARED_HARNESS.exists():
        raise SystemExit(f"{SHARED_HARNESS} is missing: --harness shared needs it beside the checkout")
    _harness = name


def harness_python() -> str:
    """The shared harness needs httpx and numpy (and orjson, optionally): the project venv has them all."""
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


MSGPACK_TRANSPORT = "msgpack"
"""Submissions in rollbuf's binary encoding (the shared harness: through `bench/harness_msgpack.py`)."""
GZIP_TRANSPORT = "json-gzip"
"""The stock Atropos client: gzip-9 request bodies, gzip accepted on /batch."""


def run_harness(
    target: Target, phases: str, extra: list[str], timeout: float = 600, transport: str = "json"
) -> list[dict[str, Any]]:
    """The harness's `phases` (comma-separated) against `target` with flags `extra`: the records of the ingest,
    batch and memory phases, each with the target's name."""
    if _harness == "rollbuf":
        records = harness.run_sync(target.url, phases.split(","), extra, transport, target.pid, target.name, timeout)
    else:
        records = _run_shared(target, phases, extra, timeout, transport)
    return [{**r, "target": target.name} for r in records if r.get("phase") in ("ingest", "batch", "memory")]


def _run_shared(target: Target, phases: str, extra: list[str], timeout: float, transport: str) -> list[dict[str, Any]]:
    if transport == MSGPACK_TRANSPORT:
        transport = "bench.harness_msgpack:MsgpackTransport"
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        out = Path(f.name)
    # The binary plug-in imports rollbuf's encoder: run the harness in this environment, with this checkout.
    python, env = (
        (harness_python(), None) if transport == "json" else (sys.executable, {**os.environ, "PYTHONPATH": str(ROOT)})
    )
    cmd = [
        python,
        str(SHARED_HARNESS),
        "--url",
        target.url,
        "--phases",
        phases,
        "--out",
        str(out),
        "--pid",
        str(target.pid),
        "--label",
        target.name,
        "--transport",
        transport,
        *extra,
    ]
    subprocess.run(cmd, check=False, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    out.unlink()
    return records


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
