"""Servers under test, as real processes on free loopback ports, stopped through their own process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def save_rows(prefix: str, rows: list[dict[str, Any]]) -> Path:
    """`rows` as JSON lines in `bench/results/<prefix>-<time>.jsonl` (git-ignored); the path, relative to the
    checkout, for the report's last line."""
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    out = out_dir / time.strftime(f"{prefix}-%Y%m%dT%H%M%S.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out.relative_to(ROOT)


ATROPOS_VENV = ROOT / ".bench-venv"
SHARED_BENCH = next(
    (d / "shared" / "bench" for d in ROOT.parents if (d / "shared" / "bench").is_dir()),
    ROOT.parent / "shared" / "bench",
)
"""The shared harness's directory: beside the checkout, or beside the directory of worktrees holding it."""


@dataclass
class Target:
    name: str
    url: str
    pid: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(name: str, cmd: list[str], port: int, log: Path, ready_path: str = "/", cwd: Path = ROOT) -> Iterator[Target]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: see {log}")
            try:
                if httpx.get(url + ready_path, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after 60 s: see {log}")
            time.sleep(0.1)
        yield Target(name, url, proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def rollbuf(store: str, log: Path, workers: int = 1) -> tuple[str, list[str], int]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "api",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--store",
        store,
        "--log-level",
        "warning",
        "--workers",
        str(workers),
    ]
    suffix = f" x{workers}" if workers > 1 else ""
    return f"rollbuf[{store.split(':')[0]}{suffix}]", cmd, port


def atropos(log: Path) -> tuple[str, list[str], int] | None:
    """The Atropos server from the side virtualenv, or None when it is not installed."""
    uvicorn = ATROPOS_VENV / "bin" / "uvicorn"
    if not uvicorn.exists():
        return None
    port = _free_port()
    cmd = [
        str(uvicorn),
        "atroposlib.api.server:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return "atropos", cmd, port


def keeping_sink() -> tuple[str, list[str], int]:
    """A do-nothing endpoint that keeps every body it reads (`bench/keeping_sink.py`)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "bench.keeping_sink:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return "keeping sink", cmd, port


def ceiling(log: Path) -> tuple[str, list[str], int]:
    """The do-nothing server (`bench/do_nothing.py`): the ingest ceiling of this client, HTTP and framework."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "bench.do_nothing:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return "do-nothing", cmd, port


def register_trainer(url: str, batch_size: int = 64, max_token_len: int = 512) -> None:
    """Register the bench's trainer on `url` and poll once (Atropos gates `/register-env` on the trainer's first
    `/batch`), so the producers under measure can start."""
    registration = {
        "wandb_group": "bench",
        "wandb_project": "bench",
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "checkpoint_dir": "c",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 1,
    }
    with httpx.Client(base_url=url) as http:
        http.post("/register", json=registration).raise_for_status()
        http.get("/batch")
