"""The image built from the Dockerfile and run as a user would (`make image-test`; tests/image/conftest.py):
it serves on its defaults given a key, is healthy, runs unprivileged, keeps acknowledged data on /data across
a replaced container, stops promptly on SIGTERM, and stays small."""

from __future__ import annotations

import socket
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.image import standin
from tests.image.build import Built
from tests.image.conftest import REPORT
from tests.image.podman import LIMITS, Container, container, inspect, podman, volume

pytestmark = pytest.mark.image

KEY = "image-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
UID = 10001
"""The image's `rollbuf` user (Dockerfile)."""
STOP_TIMEOUT_S = 10
"""`docker stop`'s (and podman's) default grace between SIGTERM and SIGKILL."""
MAX_OWN_BYTES = 200 * 1000**2
"""The image's own layers, over its base: the virtual environment (numpy, uvloop, psycopg, simdjson ...) is
about 150 MB; a pip cache or a build toolchain would push it past this."""


@pytest.fixture
def data() -> Iterator[str]:
    with volume() as name:
        yield f"{name}:/data"


@pytest.fixture
def served(image: Built, data: str) -> Iterator[Container]:
    with container(image.tag, env={"ROLLBUF_API_KEY": KEY}, volumes=[data]) as c:
        c.wait_ready()
        yield c


def test_refuses_to_listen_without_a_key(image: Built) -> None:
    name = f"rollbuf-image-test-nokey-{uuid.uuid4().hex[:12]}"
    try:
        proc = podman("run", "--rm", "--name", name, *LIMITS, image.tag, check=False, timeout=60)
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)  # had it started serving after all
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ROLLBUF_API_KEY" in proc.stderr


def test_serves_on_its_defaults_with_a_key(served: Container) -> None:
    assert httpx.get(served.url + "/readyz").status_code == 200
    assert httpx.get(served.url + "/status").status_code == 401
    assert httpx.get(served.url + "/status", headers=AUTH).status_code == 200
    assert "rollbuf.db" in served.exec("ls", "/data").split()


def test_the_images_own_health_check_passes(image: Built, served: Container) -> None:
    check = inspect("image", image.tag)["Healthcheck"]
    assert "/readyz" in " ".join(check["Test"])
    assert podman("healthcheck", "run", served.id, check=False).returncode == 0


def test_runs_as_a_user_that_owns_data(served: Container) -> None:
    status = dict(line.split(":", 1) for line in served.exec("cat", "/proc/1/status").splitlines())
    assert status["Uid"].split() == [str(UID)] * 4, "the server process runs as rollbuf, not root"
    owners = served.exec("stat", "-c", "%u:%g %n", "/data", "/data/rollbuf.db").splitlines()
    assert owners == [f"{UID}:{UID} /data", f"{UID}:{UID} /data/rollbuf.db"]


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_an_acknowledged_group_outlives_its_container(image: Built, data: str, end: str) -> None:
    with container(image.tag, env={"ROLLBUF_API_KEY": KEY}, volumes=[data]) as first:
        first.wait_ready()
        with httpx.Client(base_url=first.url, headers=AUTH, timeout=10) as c:
            assert c.post("/register", json=registration(batch_size=4)).status_code == 200
            assert c.get("/batch", params={"step": 0}).json()["batch"] is None  # the trainer has started
            env_id = c.post("/register-env", json=env("math", group_size=4)).json()["env_id"]
            r = c.post("/scored_data", json=group(4, env_id=env_id, group_id=f"acked-before-{end}"))
            assert r.status_code == 200
        if end == "stop":
            podman("stop", "--time", str(STOP_TIMEOUT_S), first.id)
        else:
            podman("kill", "--signal", "KILL", first.id)
    with container(image.tag, env={"ROLLBUF_API_KEY": KEY}, volumes=[data]) as second:
        second.wait_ready()
        batch = httpx.get(second.url + "/batch", params={"step": 0}, headers=AUTH, timeout=10).json()["batch"]
        assert [g["group_id"] for g in batch] == [f"acked-before-{end}"]


def test_sigterm_stops_it_within_the_grace_period(served: Container) -> None:
    start = time.monotonic()
    podman("stop", "--time", str(STOP_TIMEOUT_S), served.id)
    took = time.monotonic() - start
    state = served.state()
    assert state["ExitCode"] == 0, f"not a clean exit on SIGTERM (137: killed after {STOP_TIMEOUT_S} s)"
    assert took < STOP_TIMEOUT_S
    assert "Application shutdown complete" in served.logs()
    REPORT.append(f"SIGTERM to exit: {took:.1f} s (bound {STOP_TIMEOUT_S} s)")


def test_small_with_no_build_leftovers(image: Built) -> None:
    size = int(inspect("image", image.tag)["Size"])
    base = int(inspect("image", standin.tag())["Size"])
    own, whole = (size - base) / 1e6, size / 1e6
    REPORT.append(f"image {whole:.0f} MB: its own layers {own:.0f} MB over the stand-in base's {base / 1e6:.0f} MB")
    assert size - base < MAX_OWN_BYTES
    leftovers = "ls -d /root/.cache /src /opt/rollbuf/bin/pip /opt/rollbuf/lib/python3.11/site-packages/setuptools $(command -v gcc cc make) 2>/dev/null; true"  # noqa: E501
    found = podman("run", "--rm", *LIMITS, "--entrypoint", "sh", image.tag, "-c", leftovers).stdout.split()
    assert found == []


def test_labels_name_the_version_it_runs(image: Built) -> None:
    labels = inspect("image", image.tag)["Config"]["Labels"]
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    installed = podman(
        "run", "--rm", *LIMITS, image.tag, "python", "-c", "import importlib.metadata as m; print(m.version('rollbuf'))"
    ).stdout.strip()
    assert labels["org.opencontainers.image.version"] == installed == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]


def _requests_read_on_8000(c: Container) -> int:
    """Established connections to the server's port 8000 whose request bytes the server has read (receive
    queue empty): requests in its hands, from /proc/net/tcp inside the container."""
    rows = [line.split() for line in c.exec("cat", "/proc/net/tcp").splitlines()[1:]]
    return sum(1 for r in rows if r[1].endswith(":1F40") and r[3] == "01" and r[4].endswith(":00000000"))


def test_sigterm_stops_it_within_the_grace_period_during_a_long_poll(served: Container) -> None:
    """A pending `GET /batch?wait=30` is cancelled after `shutdown_timeout` (5 s), so the stop is SIGTERM's
    clean exit 0 inside the runtime's grace period, not its kill (137)."""
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=10) as c:
        assert c.post("/register", json=registration(batch_size=4)).status_code == 200
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as poll:
        poll.sendall(f"GET /batch?step=0&wait=30 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        deadline = time.monotonic() + 10
        while _requests_read_on_8000(served) < 1:
            assert time.monotonic() < deadline, "the long-poll never reached the server"
            time.sleep(0.05)  # polling interval
        start = time.monotonic()
        podman("stop", "--time", str(STOP_TIMEOUT_S), served.id)
        took = time.monotonic() - start
    assert served.state()["ExitCode"] == 0, f"killed after {took:.1f} s (exit 137), not stopped by SIGTERM"
