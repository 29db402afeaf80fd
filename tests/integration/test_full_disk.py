"""A full disk is "not now", not a bug, against a real `rollbuf serve` on SQLite: ingest answers 503 +
Retry-After (it answered 500 `database or disk is full`), /readyz says why, one log line per episode, and
once space comes back the same process goes on, with everything it acknowledged. The disk is a small tmpfs,
so the test needs root (CI runs as root: there it never skips)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import running_server

pytestmark = pytest.mark.integration
DISK = "6m"
READY_AGAIN_S = 30.0
"""Bound on /readyz turning 200 once space is back (the checkpoint thread retries every second)."""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root: the full-disk test must run there")
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill_up(path: Path) -> None:
    """Write `path` until the disk has no byte left."""
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def test_a_full_disk_is_503_and_readyz_says_so_until_space_returns(small_disk: Path, tmp_path: Path) -> None:
    filler = small_disk / "filler"
    with running_server(f"sqlite:///{small_disk / 'rollbuf.db'}", tmp_path / "server.log") as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/register", json=registration(batch_size=8, max_token_len=4096)).status_code == 200
            c.get("/batch")
            env_id = c.post("/register-env", json=env(group_size=8, max_token_length=4096)).json()["env_id"]
            filler.write_bytes(b"\0" * (3 << 20))  # half the disk gone to something else
            acknowledged = 0
            refused = None
            for i in range(400):
                r = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=i))
                if r.status_code != 200:
                    refused = r
                    break
                acknowledged += 1
            assert refused is not None, "the disk never filled"
            assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
            assert refused.json()["code"] == "store_unavailable" and "full" in refused.json()["message"]
            fill_up(small_disk / "rest")  # what a rolled-back write freed, taken too: the disk stays full
            for i in range(20):  # a handler retrying into the full disk: 503 each time, not a log line each
                again = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=i))
                assert again.status_code == 503, again.text
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "full" in ready.json()["message"], ready.text
            filler.unlink()  # space comes back: the same process goes on
            (small_disk / "rest").unlink()
            r = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=10_000))
            assert r.status_code == 200, r.text
            # Writes clear at once; a WAL checkpoint that failed on the full disk clears on its thread's next round
            # (within a second of the write), and /readyz says 503 until then: polled, with a bound.
            deadline = time.monotonic() + READY_AGAIN_S
            while (ready := c.get("/readyz")).status_code != 200:
                assert time.monotonic() < deadline, f"/readyz still {ready.status_code}: {ready.text}"
                time.sleep(0.05)  # polling interval, not a wait for the result
            assert c.get("/status").json()["queue_size"] == acknowledged + 1
    log = (tmp_path / "server.log").read_text()
    # Lines per episode, not per attempt: the write's warning, /readyz's, one rate-limited refusal line per route
    # and reason (POST /scored_data; /readyz for the write), and, when a WAL checkpoint round fell inside the
    # episode, the checkpoint's warning and /readyz's refusal for it (a loaded machine makes that likely).
    assert log.count("disk is full") <= 6 and "Traceback" not in log, log
