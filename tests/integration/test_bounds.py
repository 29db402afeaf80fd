"""Request bytes held across requests are bounded, against a real `rollbuf serve`: bodies that declare more
than the budget leaves are answered 503 before they are read, and the budget comes back when they end."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import running_server

pytestmark = pytest.mark.integration
MiB = 1 << 20
POLL_S = 10.0


@contextmanager
def body_in_flight(port: int, declared: int) -> Iterator[socket.socket]:
    """A POST /scored_data that declares `declared` bytes, sends 1 KB of them and holds the connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        head = (
            "POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + b" " * 1024)
        yield sock
    finally:
        sock.close()


def answer_to_a_probe(c: httpx.Client) -> int:
    """An invalid body: 422 when the server reads it, 503 when its bytes do not fit; never stored either way."""
    return c.post("/scored_data", content=b"{}", headers={"Content-Type": "application/json"}).status_code


def until(c: httpx.Client, status: int) -> None:
    deadline = time.monotonic() + POLL_S
    while (got := answer_to_a_probe(c)) != status:
        assert time.monotonic() < deadline, f"still {got}, waiting for {status}"
        time.sleep(0.02)  # polling interval


def test_bodies_past_the_inflight_budget_wait_their_turn(tmp_path: Path) -> None:
    limits = ("--max-body-bytes", str(16 * MiB), "--max-decompressed-bytes", str(16 * MiB))
    budget = ("--max-inflight-bytes", str(48 * MiB))
    with running_server("memory://", tmp_path / "server.log", *limits, *budget) as server:
        with httpx.Client(base_url=server.url) as c:
            c.post("/register", json=registration(batch_size=8))
            c.get("/batch")
            env_id = c.post("/register-env", json=env(group_size=4)).json()["env_id"]
            assert answer_to_a_probe(c) == 422
            with body_in_flight(server.port, 16 * MiB), body_in_flight(server.port, 16 * MiB):
                with body_in_flight(server.port, 16 * MiB - 1):
                    until(c, 503)  # 48 MiB - 1 held: not even a 2-byte body fits
                    r = c.post("/scored_data", json=group(4, env_id=env_id))
                    assert r.status_code == 503 and r.json()["code"] == "busy" and r.headers["Retry-After"]
                until(c, 422)  # a body ended (its client went away): its bytes are back
                assert c.post("/scored_data", json=group(4, env_id=env_id)).json()["status"] == "received"
            assert c.get("/status").json()["queue_size"] == 1
