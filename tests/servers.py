"""Real rollbuf server processes for integration tests: started on a free loopback port, ready when GET /
answers, stopped through their own process group (never by name)."""

from __future__ import annotations

import contextlib
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


def listeners(port: int) -> set[int]:
    """The processes listening on this TCP port in this network namespace (Linux's /proc): which server answers a
    port is a fact, not a guess, when parallel tests start servers on ports each found free a moment before."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    sockets.add(f"socket:[{fields[9]}]")
    pids = set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in fds.iterdir()):
                pids.add(int(fds.parent.name))
    return pids


def ours(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Whether the process listening on `port` is `proc` or one of its process group (uvicorn's workers)."""
    for pid in listeners(port):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == proc.pid:
                return True
    return False


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
    chosen = port is None
    for _ in range(PORT_TRIES if chosen else 1):
        server = _start(store, log, port or free_port(), extra, host, prefix, env)
        if server is not None:
            return server
    raise RuntimeError(f"another process listens on the server's port ({port or f'{PORT_TRIES} ports tried'})")


PORT_TRIES = 5


def _start(
    store: str,
    log: Path,
    port: int,
    extra: Sequence[str],
    host: str,
    prefix: Sequence[str],
    env: Mapping[str, str] | None,
) -> ServerProcess | None:
    """The server on `port` once it answers, or None when another process holds the port (one another test took
    between `free_port` and this server's bind): the server could not bind it, or another server answered there
    first (then this one is stopped)."""
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
        logged = out.tell()
        environ = None if env is None else {**os.environ, **env}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environ)
    server = ServerProcess(f"http://{host}:{port}", port, store, proc, log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if b"address already in use" in log.read_bytes()[logged:]:
                return None
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            answered = httpx.get(server.url + "/", timeout=1.0).status_code == 200
        except httpx.TransportError:
            answered = False
        if answered:
            if prefix or ours(proc, port):  # another namespace's sockets are not in this one's /proc/net
                return server
            server.kill()
            return None
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
