"""A full disk is "not now", not a bug, against a real `rollbuf serve` on SQLite: ingest answers 503 +
Retry-After (it answered 500 `database or disk is full`), /readyz says why, one log line per episode, and
once space comes back the same process goes on, with everything it acknowledged. The disk is a small tmpfs,
so the test needs root (CI runs as root: there it never skips)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import running_server

pytestmark = pytest.mark.integration
DISK = "16m"
"""Room for the empty store (~3 MiB), the groups written before it fills and, once space returns, the WAL's
checkpoint into the file (it grows the file by what the WAL holds: on 6 MiB it could not, and /readyz stayed 503)."""
ROOM = 2 << 20
"""What the store may still write once the filler is in: a few groups' worth."""
READY_AGAIN_S = 60.0
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
    episodes = 1
    with running_server(f"sqlite:///{small_disk / 'rollbuf.db'}", tmp_path / "server.log") as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/register", json=registration(batch_size=8, max_token_len=4096)).status_code == 200
            c.get("/batch")
            env_id = c.post("/register-env", json=env(group_size=8, max_token_length=4096)).json()["env_id"]
            # Something else takes the disk but for room for a few groups (the empty store already holds about
            # 3 MiB: a 64 KiB page per table, and the WAL), so that some writes are acknowledged before it fills.
            filler.write_bytes(b"\0" * max(0, shutil.disk_usage(small_disk).free - ROOM))
            acknowledged = 0
            refused = None
            for i in range(400):
                r = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=i))
                if r.status_code != 200:
                    refused = r
                    break
                acknowledged += 1
            assert refused is not None, "the disk never filled"
            assert acknowledged > 0, "the disk was full before the first group"
            assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
            assert refused.json()["code"] == "store_unavailable" and "full" in refused.json()["message"]
            fill_up(small_disk / "rest")  # what a rolled-back write freed, taken too: the disk stays full
            # A handler retrying into the full disk: 503 each time, not a log line each. A retry may still go
            # through: SQLite reuses space its files already hold (WAL frames a rolled-back write left, free
            # pages), so a 200 here is a durable write, counted as acknowledged, and it ends the episode (the
            # next refusal starts another, logged again). Such space is finite: refusals keep coming.
            refusals, episodes, last_ok = 0, 1, False
            for i in range(400):
                again = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=1_000 + i))
                if again.status_code == 200:
                    acknowledged, last_ok = acknowledged + 1, True
                    continue
                assert again.status_code == 503 and again.headers["Retry-After"], again.text
                assert again.json()["code"] == "store_unavailable", again.text
                refusals, episodes, last_ok = refusals + 1, episodes + last_ok, False
                if refusals == 20:
                    break
            assert refusals == 20, f"{refusals} refusals in 400 retries into a full disk"
            # /readyz says so while no write went through since one was refused. A background write (the refusals'
            # counts) may still find room, a checkpoint that emptied the WAL having given some back, and end the
            # episode: then that room is taken too and a refused write starts another. With a bound.
            more = []
            for i in range(20):
                ready = c.get("/readyz")
                if ready.status_code == 503:
                    break
                more.append(small_disk / f"more-{i}")
                fill_up(more[-1])
                again = c.post("/scored_data", json=group(8, length=1024, env_id=env_id, seed=2_000 + i))
                acknowledged += again.status_code == 200
                episodes += 1
            assert ready.status_code == 503 and "full" in ready.json()["message"], ready.text
            filler.unlink()  # space comes back: the same process goes on
            for taken in (small_disk / "rest", *more):
                taken.unlink()
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
    assert log.count("disk is full") <= 6 * episodes and "Traceback" not in log, log
