"""The stand-in inference server (`demos/standin_inference.py`) as a real process for tests: on a free loopback
port, ready when `/v1/models` answers, its faults set through `/control`, stopped by its process group. Test
instrumentation beside `servers.py`: `kill()` stops it as a crash would and `revive()` starts it again on the same
port (an inference server restarting under a producer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.servers import READY_TIMEOUT_S, free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class StandIn:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path = Path("/dev/null")
    port: int = 0

    def kill(self) -> None:
        """SIGKILL its process group: the inference server is gone (a crash, a restart in progress)."""
        _kill(self.proc)

    def revive(self) -> None:
        """Start it again on the same port (its faults and counts start afresh)."""
        self.proc = _start(self.log, self.port)

    def control(self, **faults: Any) -> None:
        httpx.post(self.url + "/control", json=faults, timeout=10).raise_for_status()

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=10).json()  # type: ignore[no-any-return]


def _start(log: Path, port: int) -> subprocess.Popen[bytes]:
    """The stand-in as a process on `port`, returned once /v1/models answers."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "demos.standin_inference", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the stand-in inference server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the stand-in inference server not ready after {READY_TIMEOUT_S} s:\n{log.read_text()}")
        time.sleep(0.05)  # polling interval while waiting for readiness


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # requests it holds on purpose would stall a graceful stop
    proc.wait(timeout=30)


@contextmanager
def running_standin(log: Path, **faults: Any) -> Iterator[StandIn]:
    """The stand-in as a process on a free port, ready when /v1/models answers; killed by its process group.
    `kill()` stops it as a crash would, `revive()` starts it again on the same port (a vLLM restart)."""
    port = free_port()
    server = StandIn(f"http://127.0.0.1:{port}", _start(log, port))
    server.log, server.port = log, port
    try:
        if faults:
            server.control(**faults)
        yield server
    finally:
        _kill(server.proc)
