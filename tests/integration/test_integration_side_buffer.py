"""The side buffer in a real server process on SQLite: held groups are acknowledged data, so they survive
kill -9; its bound refuses with 503 (a handler retries), and a group that completes a held one releases it."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.factories import env, group, registration
from tests.servers import start_server

HELD = 20


def test_held_groups_survive_kill_9_and_their_bound_refuses_with_503(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'rollbuf.db'}"
    log = tmp_path / "server.log"
    server = start_server(store, log, None, "--side-buffer-max-groups", str(HELD))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/register", json=registration(batch_size=8)).status_code == 200
            c.get("/batch", params={"step": 0})
            assert c.post("/register-env", json=env(group_size=8)).status_code == 200
            for i in range(HELD):  # sevens never add up to 8
                assert c.post("/scored_data", json=group(7, seed=i, group_id=f"h{i}")).json()["status"] == "buffered"
            full = c.post("/scored_data", json=group(7, seed=99, group_id="over"))
            assert full.status_code == 503 and "side_buffer_max_groups" in full.text
        server.kill(signal.SIGKILL)
        server = start_server(store, log, server.port, "--side-buffer-max-groups", str(HELD))
        with httpx.Client(base_url=server.url, timeout=30) as c:
            status = c.get("/status").json()
            assert (status["held_groups"], status["held_sequences"], status["queue_size"]) == (HELD, 7 * HELD, 0)
            one = c.post("/scored_data", json=group(1, seed=100, group_id="one"))
            assert one.json() == {"status": "buffered", "buffer_size": 7 * (HELD - 1)}  # the oldest seven + this one
            batch = c.get("/batch", params={"step": 0}).json()["batch"]
            assert [g["group_id"] for g in batch] == ["h0", "one"]
            assert c.get("/status").json()["held_groups"] == HELD - 1
    finally:
        server.kill(signal.SIGTERM)
