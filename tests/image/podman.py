"""podman driven from the tests: the flags this kind of machine needs, and containers and volumes that are
stopped and removed by their own id, whatever the test did."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

GLOBAL_FLAGS = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")
"""crun refuses these machines' hybrid cgroups (v1 controllers); runc with cgroupfs works without systemd."""
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
"""podman's default ulimits are above what a process here may set; these are below."""
READY_TIMEOUT_S = 60.0


class PodmanError(RuntimeError):
    pass


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *GLOBAL_FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def inspect(kind: str, ref: str) -> dict[str, Any]:
    out: list[dict[str, Any]] = json.loads(podman(kind, "inspect", ref).stdout)
    return out[0]


@dataclass
class Container:
    id: str
    url: str

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = inspect("container", self.id)["State"]
        return state

    def logs(self) -> str:
        proc = podman("logs", self.id, check=False)
        return proc.stdout + proc.stderr

    def exec(self, *cmd: str) -> str:
        return podman("exec", self.id, *cmd).stdout

    def wait_ready(self, path: str = "/readyz") -> None:
        """Poll until `path` answers 200; fail at once if the container exits."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.state()["Running"]:
                raise PodmanError(f"container exited: {self.state()['ExitCode']}\n{self.logs()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling interval while waiting for readiness, not a wait for readiness itself
        raise PodmanError(f"not ready after {READY_TIMEOUT_S} s:\n{self.logs()}")


@contextmanager
def volume() -> Iterator[str]:
    """A named volume, removed afterwards (with `podman volume rm` of its own name)."""
    name = f"rollbuf-image-test-{uuid.uuid4().hex[:12]}"
    podman("volume", "create", name)
    try:
        yield name
    finally:
        podman("volume", "rm", "--force", name, check=False)


@contextmanager
def container(image: str, *, env: dict[str, str], volumes: Sequence[str] = ()) -> Iterator[Container]:
    """The image run detached with its own command, port 8000 published on a free loopback port; removed
    (forcibly, by id) afterwards. The image's health check runs only when asked (`podman healthcheck run`):
    podman's timer for it needs systemd, which these machines do not run."""
    args = ["run", "--detach", *LIMITS, "--publish", "127.0.0.1::8000", "--health-interval", "disable"]
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    for v in volumes:
        args += ["--volume", v]
    cid = podman(*args, image).stdout.strip()
    try:
        host_port = podman("port", cid, "8000/tcp").stdout.strip().rsplit(":", 1)[1]
        yield Container(cid, f"http://127.0.0.1:{host_port}")
    finally:
        podman("rm", "--force", "--time", "0", cid, check=False)
