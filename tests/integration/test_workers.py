"""`rollbuf serve --workers N`: several server processes on one port sharing one SQLite file."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.integration.test_server_process import drain
from tests.servers import running_server

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_two_workers_share_one_queue(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    with running_server(store, tmp_path / "server.log", "--workers", "2") as server:
        assert len(children(server.proc.pid)) >= 2, "uvicorn did not start two worker processes"
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/register", json=registration(batch_size=8)).status_code == 200
            c.get("/batch", params={"step": 0})
            env_ids = [c.post("/register-env", json=env(f"e{i}", group_size=4)).json()["env_id"] for i in range(2)]
            assert env_ids == [0, 1], "env ids are shared, not per process"

        acked: list[str] = []
        lock = threading.Lock()

        def produce(worker: int) -> None:
            # A fresh connection per request, so the kernel spreads them over both processes.
            for i in range(25):
                gid = f"w{worker}-{i}"
                body = group(4, env_id=env_ids[worker % 2], seed=i, group_id=gid)
                r = httpx.post(server.url + "/scored_data", json=body, timeout=30)
                assert r.status_code == 200, r.text
                with lock:
                    acked.append(gid)

        threads = [threading.Thread(target=produce, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/status").json()["queue_size"] == len(acked) == 200
            served, step = drain(c, 0)
            assert sorted(served) == sorted(acked), "every group served exactly once"
            assert c.get("/status").json()["current_step"] == step == 100


def test_memory_store_refuses_workers(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="workers=2 needs a store the processes share"):
        with running_server("memory://", tmp_path / "server.log", "--workers", "2"):
            pass
