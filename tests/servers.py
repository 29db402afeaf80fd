"""Real rollbuf server processes for integration tests: started on a free loopback port, ready when GET /
answers, stopped through their own process group (never by name)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    port: int
    store: str
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group and reap it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)


def start_server(
    store: str,
    log: Path,
    port: int | None = None,
    *extra: str,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """`prefix`: what the command runs under (`ip netns exec NS`: the server in another network namespace);
    `env`: variables added to this process's environment for the server (`ROLLBUF_*` settings)."""
    port = port or free_port()
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "api",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--store",
        store,
        "--log-level",
        "warning",
        *extra,
    ]
    if host != "127.0.0.1":
        cmd.append("--allow-unauthenticated")  # a private test network, torn down with the test
    with log.open("ab") as out:
        environ = None if env is None else {**os.environ, **env}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
    server = ServerProcess(f"http://{host}:{port}", port, store, proc, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling interval while waiting for readiness, not a wait for readiness itself
    server.kill()
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s:\n{log.read_text()}")


@contextmanager
def running_server(store: str, log: Path, *extra: str, env: Mapping[str, str] | None = None) -> Iterator[ServerProcess]:
    server = start_server(store, log, None, *extra, env=env)
    try:
        yield server
    finally:
        server.kill(signal.SIGTERM)
