"""A real `rollbuf serve` on loopback: the Atropos flow over TCP, and kill -9 in the middle of a load."""

from __future__ import annotations

import gzip
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import running_server, start_server

pytestmark = pytest.mark.integration


def post_gz(client: httpx.Client, path: str, obj: Any) -> httpx.Response:
    body = gzip.compress(json.dumps(obj).encode())
    return client.post(path, content=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})


def drain(c: httpx.Client, step: int) -> tuple[list[str], int]:
    """Serve batches from `step` until the queue is empty (a filler group completes a last half batch); return
    the group ids served and the next step."""
    served: list[str] = []
    while True:
        r = c.get("/batch", params={"step": step}).json()
        if not r["batch"]:
            if c.get("/status").json()["queue_size"] == 0:
                return [g for g in served if not g.startswith("filler-")], step
            filler = group(4, env_id=0, seed=10**6 + step, group_id=f"filler-{step}")
            assert c.post("/scored_data", json=filler).status_code == 200
            continue
        served.extend(g["group_id"] for g in r["batch"])
        step += 1


def test_atropos_flow_over_tcp(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        assert c.post("/register", json=registration(batch_size=8)).status_code == 200
        assert c.get("/batch").json() == {"batch": None}
        env_id = c.post("/register-env", json=env(group_size=4)).json()["env_id"]
        r = post_gz(c, "/scored_data_list", [group(4, env_id=env_id, seed=i) for i in range(4)])
        assert r.json() == {"status": "received", "groups_processed": 4}
        assert c.request("GET", "/status-env", json={"env_id": env_id}).json()["self_queue_size"] == 4
        for _ in range(2):
            batch = c.get("/batch", headers={"Accept-Encoding": "gzip"}).json()["batch"]
            assert sum(len(g["tokens"]) for g in batch) == 8
        assert c.get("/status").json() == {**c.get("/status").json(), "current_step": 2, "queue_size": 0}


def test_kill_9_mid_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'buffer.db'}"
    log = tmp_path / "server.log"
    server = start_server(store, log)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            c.post("/register", json=registration(batch_size=8, starting_step=3))
            c.get("/batch", params={"step": 3})
            env_ids = [c.post("/register-env", json=env(f"e{i}", group_size=4)).json()["env_id"] for i in range(2)]
            for i in range(4):
                assert c.post("/scored_data", json=group(4, env_id=0, seed=i, group_id=f"pre{i}")).status_code == 200
            served_before = [g["group_id"] for g in c.get("/batch", params={"step": 3}).json()["batch"]]
            assert len(served_before) == 2

        acked: list[str] = []
        attempted: list[str] = []
        lock = threading.Lock()
        enough = threading.Event()

        def produce(worker: int) -> None:
            with httpx.Client(base_url=server.url, timeout=5) as c:
                for i in range(10_000):
                    gid = f"w{worker}-{i}"
                    with lock:
                        attempted.append(gid)
                    try:
                        r = c.post("/scored_data", json=group(4, env_id=env_ids[worker % 2], seed=i, group_id=gid))
                    except httpx.TransportError:
                        return  # the server died under us: this one was never acknowledged
                    if r.status_code == 200:
                        with lock:
                            acked.append(gid)
                            if len(acked) >= 150:
                                enough.set()

        workers = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
        for t in workers:
            t.start()
        assert enough.wait(timeout=120), "producers made no progress"
        server.kill()  # SIGKILL, mid-load
        for t in workers:
            t.join(timeout=30)

        server = start_server(store, log)
        with httpx.Client(base_url=server.url, timeout=10) as c:
            status = c.get("/status").json()
            assert status["current_step"] == 4, "the step survives"
            assert c.get("/info").json()["batch_size"] == 8, "the registration survives"
            for env_id in env_ids:
                assert c.request("GET", "/status-env", json={"env_id": env_id}).status_code == 200
            # batch 3 was formed but not acknowledged: still there, the same
            again = [g["group_id"] for g in c.get("/batch", params={"step": 3}).json()["batch"]]
            assert again == served_before
            # Everything stored, read back by serving it: every acknowledged group is there, once.
            stored, step = drain(c, 4)
            assert len(stored) == len(set(stored)), "a group was served twice"
            missing = set(acked) - set(stored)
            assert not missing, f"acknowledged groups lost in the crash: {sorted(missing)[:5]}"
            assert {"pre2", "pre3"} <= set(stored)
            assert set(stored) <= {"pre2", "pre3", *attempted}, "the store invented a group"
            # A client retrying everything it attempted after the crash: what is stored comes back as a duplicate
            # and is not stored again; what was lost unacknowledged is stored now.
            for gid in attempted:
                worker, i = gid[1:].split("-")
                body = group(4, env_id=env_ids[int(worker) % 2], seed=int(i), group_id=gid)
                r = c.post("/scored_data", json=body)
                assert r.status_code == 200
                assert r.json().get("duplicate", False) == (gid in stored), gid
            retried, _ = drain(c, step)
        assert not set(retried) & set(stored), "a retried group was stored twice"
        assert set(stored) | set(retried) >= set(attempted)
    finally:
        server.kill()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_answers_waiting_long_polls_at_once(tmp_path: Path, workers: int) -> None:
    """SIGTERM while trainers long-poll `/batch?wait=`: each is answered (no batch) as the server stops, and the
    process exits without waiting out `--shutdown-timeout` (uvicorn waited for them to its end, then cut them
    off unanswered with an error line). Every worker process hears the signal (`--workers 2`)."""
    log = tmp_path / "server.log"
    store = f"sqlite:///{tmp_path / 'rollbuf.db'}"  # a store the worker processes share
    server = start_server(store, log, None, "--shutdown-timeout", "120", "--workers", str(workers))
    try:
        with httpx.Client(base_url=server.url, timeout=180) as c:
            assert c.post("/register", json=registration(batch_size=8)).status_code == 200
            replies: list[httpx.Response | BaseException] = []

            def poll() -> None:
                try:
                    with httpx.Client(base_url=server.url, timeout=180) as own:
                        replies.append(own.get("/batch", params={"wait": 60}))
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    replies.append(exc)

            pollers = [threading.Thread(target=poll) for _ in range(3)]
            for t in pollers:
                t.start()
            deadline = time.monotonic() + 30
            while "rollbuf_waiting_long_polls 3.0" not in c.get("/metrics").text:
                assert time.monotonic() < deadline, "the long-polls never waited"
                time.sleep(0.05)  # polling interval
        server.kill(signal.SIGTERM)  # reaps it (bounded: 30 s, well under the 120 s shutdown timeout)
        for t in pollers:
            t.join(timeout=30)
        assert len(replies) == 3 and all(isinstance(r, httpx.Response) for r in replies), replies
        assert all(r.status_code == 200 and not r.json()["batch"] for r in replies if isinstance(r, httpx.Response))
        assert server.proc.returncode in (0, -signal.SIGTERM), log.read_text()  # uvicorn re-raises the signal
        assert "timeout graceful shutdown exceeded" not in log.read_text()
    finally:
        server.kill()


def test_a_server_never_takes_another_process_on_its_port_for_itself(tmp_path: Path) -> None:
    """Parallel tests each pick a free port, and two can pick the same one: a server that found its port answered
    by another process (here a plain HTTP server holding it) is not ready; a server started on a port of its own
    choosing moves to another port, and one started on a given port says that port is taken."""
    import http.server

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    other = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    try:
        with pytest.raises(RuntimeError, match=f"another process listens on the server's port \\({taken}\\)"):
            start_server("memory://", tmp_path / "given.log", taken)
        server = start_server("memory://", tmp_path / "chosen.log")
        try:
            assert server.port != taken and httpx.get(server.url + "/healthz").status_code == 200
        finally:
            server.kill(signal.SIGTERM)
    finally:
        other.shutdown()
        other.server_close()
