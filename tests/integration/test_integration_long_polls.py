"""A long-poll on one server process is woken by data another process sharing the store queued, without
re-checking on a timer: SQLite's watcher (`data_version`) and PostgreSQL's LISTEN."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import pg
from tests.factories import env, group, registration
from tests.servers import running_server
from tests.small_run import parse_metrics

pytestmark = pytest.mark.integration
WAITING = ("rollbuf_waiting_long_polls", ())


def woken_across_processes(store: str, tmp_path: Path) -> None:
    with running_server(store, tmp_path / "a.log") as a, running_server(store, tmp_path / "b.log") as b:
        with httpx.Client(base_url=a.url, timeout=60) as ca, httpx.Client(base_url=b.url) as cb:
            assert ca.post("/register", json=registration(batch_size=4)).status_code == 200
            ca.get("/batch")
            env_id = cb.post("/register-env", json=env(group_size=4)).json()["env_id"]
            got: list[httpx.Response] = []
            poll = threading.Thread(target=lambda: got.append(ca.get("/batch", params={"wait": 50})))
            poll.start()
            deadline = time.monotonic() + 60  # a hang guard: the poll reaches its wait in milliseconds
            while not _waiting(a.url):
                assert time.monotonic() < deadline, "the long-poll never waited"
                time.sleep(0.02)  # polling interval
            assert cb.post("/scored_data", json=group(4, env_id=env_id)).status_code == 200  # through B
            poll.join(timeout=50)
            assert got and got[0].json()["batch"] is not None, "A's long-poll was not woken"


def _waiting(url: str) -> bool:
    with httpx.Client(base_url=url) as c:
        return parse_metrics(c.get("/metrics").text).get(WAITING, 0) == 1


def test_sqlite(tmp_path: Path) -> None:
    woken_across_processes(f"sqlite:///{tmp_path / 'shared.db'}", tmp_path)


def test_postgresql(tmp_path: Path) -> None:
    with pg.database() as name:
        woken_across_processes(pg.url_of(name), tmp_path)
