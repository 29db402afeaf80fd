"""What users meet at the edge, against a real `rollbuf serve` over TCP: groups stored as sent, bad values
refused naming the field, reused group ids refused across restarts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest
from isal import isal_zlib

from tests.factories import env, group, registration
from tests.servers import running_server, start_server

pytestmark = pytest.mark.integration
GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def started(c: httpx.Client, batch_size: int = 8, starting_step: int = 0) -> int:
    assert c.post("/register", json=registration(batch_size=batch_size, starting_step=starting_step)).status_code == 200
    assert c.get("/batch").json()["batch"] is None
    return int(c.post("/register-env", json=env(group_size=4)).json()["env_id"])


def test_masks_of_any_convention_come_back_as_sent(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        env_id = started(c)
        zero_one = group(4, length=6, env_id=env_id, seed=1)
        zero_one["masks"] = [[0, 0, 0, 1, 1, 1]] * 4
        odd = group(4, length=6, env_id=env_id, seed=2)
        odd["masks"] = [[-(2**31), 2**31 - 1, -1, 7, 0, -100]] * 4
        for body in (zero_one, odd):
            r = c.post("/scored_data", json=body)
            assert r.json() == {"status": "received"}, r.text
            assert c.get("/latest_example").json()["masks"] == body["masks"]
        batch = c.get("/batch").json()["batch"]
        assert [g["masks"] for g in batch] == [zero_one["masks"], odd["masks"]]


def test_bad_values_are_422_naming_the_field(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        env_id = started(c, starting_step=5)
        body = group(4, env_id=env_id)
        body["tokens"][2][3] = -1
        r = c.post("/scored_data", json=body)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "tokens", 2, 3] and ">= 0" in r.json()["detail"][0]["msg"]
        r = c.post("/scored_data", json=group(4, env_id=env_id, policy_step=6))
        assert r.status_code == 422
        [err] = r.json()["detail"]
        assert err["loc"] == ["body", "policy_step"] and "which is at step 5" in err["msg"]
        assert c.post("/scored_data", json=group(4, env_id=env_id, policy_step=5)).status_code == 200
        assert c.get("/status").json()["queue_size"] == 1


def test_a_reused_group_id_is_409_across_restarts(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'buffer.db'}"
    log = tmp_path / "server.log"
    first = group(4, env_id=0, seed=1, group_id="task-1")
    second = group(4, env_id=0, seed=2, group_id="task-1")
    with running_server(store, log) as server, httpx.Client(base_url=server.url) as c:
        started(c)
        assert c.post("/scored_data", json=first).json() == {"status": "received"}
    server = start_server(store, log)  # another process over the same store
    try:
        with httpx.Client(base_url=server.url) as c:
            assert c.post("/scored_data", json=first).json() == {"status": "received", "duplicate": True}
            r = c.post("/scored_data", json=second)
            assert r.status_code == 409 and "different content" in r.json()["detail"]
            assert c.get("/status").json()["queue_size"] == 1
    finally:
        server.kill()


def whitespace_bomb(inflated: int) -> bytes:
    """`[`, `inflated` spaces, `]`, gzipped in pieces (about 1000:1)."""
    comp = isal_zlib.compressobj(1, isal_zlib.DEFLATED, 16 + isal_zlib.MAX_WBITS)
    piece = b" " * (16 << 20)
    parts = [comp.compress(b"[")]
    parts += [comp.compress(piece) for _ in range(inflated // len(piece))]
    return b"".join([*parts, comp.compress(b"]"), comp.flush()])


def status_kb(pid: int, field: str) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


def test_a_gzip_bomb_stops_at_the_default_limit(tmp_path: Path) -> None:
    """1 GiB inside 1 MB: 413 once 256 MiB are inflated, and the server never holds much more than that."""
    bomb = whitespace_bomb(1 << 30)
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        started(c)
        before = status_kb(server.proc.pid, "VmRSS")
        r = c.post("/scored_data_list", content=bomb, headers={"Content-Encoding": "gzip"}, timeout=60)
        assert r.status_code == 413, r.text
        assert "decompresses to more than the limit of 268435456 bytes" in r.json()["detail"]
        grown_mb = (status_kb(server.proc.pid, "VmHWM") - before) / 1024
        assert grown_mb < 256 + 128, f"peak RSS grew by {grown_mb:.0f} MB"
        assert c.get("/status").status_code == 200


def test_bytes_after_the_gzip_data_are_400(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        env_id = started(c)
        body = gzip.compress(json.dumps(group(4, env_id=env_id)).encode())
        r = c.post("/scored_data", content=body + b"\n", headers=GZIP)
        assert r.status_code == 400 and "1 byte after the end of the gzip data" in r.json()["detail"]
        assert c.post("/scored_data", content=body, headers=GZIP).status_code == 200
        assert c.get("/status").json()["queue_size"] == 1
