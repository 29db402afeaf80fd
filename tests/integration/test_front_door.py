"""The front door against real `rollbuf serve` processes: who may call what (every route x every kind of
caller), what a web page on the machine can no longer do, and what is refused before it is read (bodies
without a key, huge heads, idle connections past the descriptor limit)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from api.routes.table import ROUTES
from tests.factories import env, group, registration
from tests.servers import ServerProcess, running_server, start_server

pytestmark = pytest.mark.integration
KEYS = {
    "env": "env-secret-0123456789",
    "trainer": "trainer-secret-0123456789",
    "admin": "admin-secret-0123456789",
}
WRONG = "wrong-secret-0123456789"
MiB = 1 << 20


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[ServerProcess]:
    keyfile = tmp_path / "keys"
    keyfile.write_text("".join(f"{role}-1 {role} {secret}\n" for role, secret in KEYS.items()))
    with running_server(
        "memory://", tmp_path / "server.log", "--api-keys-file", str(keyfile), "--max-batch-wait", "0"
    ) as server:
        yield server


def test_an_empty_key_source_fails_closed(tmp_path: Path) -> None:
    """`ROLLBUF_API_KEYS=""` used to start a keyless server that called itself keyed: on a host other machines
    reach it is now an error at start; on loopback a warning, and every request needing a key is refused."""
    env = {**os.environ, "ROLLBUF_API_KEYS": ""}
    out = subprocess.run(
        [sys.executable, "-m", "api", "serve", "--host", "0.0.0.0", "--store", "memory://"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert out.returncode == 2 and "api_keys holds no key" in out.stderr, out.stderr
    log = tmp_path / "server.log"
    with running_server("memory://", log, "--api-keys", "# todo", "--log-level", "info") as server:
        reply = httpx.get(server.url + "/reset_data", headers={"Host": "evil.example"})
        assert reply.status_code == 401, reply.text
        assert httpx.get(server.url + "/status").status_code == 401
    text = log.read_text()
    assert "api_keys holds no key" in text and "keys in use: none" in text
    log.write_text("")
    with running_server(
        "memory://", log, "--api-keys", f"math env {KEYS['env']}#x", "--api-key", KEYS["admin"], "--log-level", "info"
    ) as server:
        assert httpx.get(server.url + "/status", headers=headers(KEYS["env"])).status_code == 401  # no cut at `#`
        assert httpx.get(server.url + "/status", headers=headers(KEYS["env"] + "#x")).status_code == 200
    text = log.read_text()
    assert "keys in use: admin (admin), math (env)" in text and KEYS["admin"] not in text


def test_a_key_file_replaced_or_lost_keeps_working_keys_and_says_so(keyed: ServerProcess, tmp_path: Path) -> None:
    """Replaced by a rename (as operators do), the file's new keys are used; deleted or broken, the last good
    keys stay, and the log, /readyz and a metric say so until it is fixed."""
    keyfile = tmp_path / "keys"

    def status_with(key: str) -> int:
        return httpx.get(keyed.url + "/status", headers=headers(key)).status_code

    def until(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while not check():  # the file is read again about every second, off the event loop
            assert time.monotonic() < deadline
            time.sleep(0.05)

    new = tmp_path / "keys.new"
    new.write_text(f"env-1 env {KEYS['env']}-rotated\nadmin-1 admin {KEYS['admin']}\n")
    new.rename(keyfile)
    until(lambda: status_with(KEYS["env"] + "-rotated") == 200)
    assert status_with(KEYS["env"]) == 401 and status_with(KEYS["trainer"]) == 401
    keyfile.unlink()
    until(lambda: "warnings" in httpx.get(keyed.url + "/readyz").json())
    assert "No such file" in httpx.get(keyed.url + "/readyz").json()["warnings"][0]
    assert status_with(KEYS["env"] + "-rotated") == 200  # the last good keys stay
    metrics = httpx.get(keyed.url + "/metrics", headers=headers(KEYS["admin"])).text
    assert "rollbuf_key_file_stale 1.0" in metrics
    assert "cannot be used" in keyed.log.read_text() and KEYS["admin"] not in keyed.log.read_text()
    keyfile.write_text(f"admin-1 admin {KEYS['admin']}\n")
    until(lambda: "warnings" not in httpx.get(keyed.url + "/readyz").json())
    assert status_with(KEYS["env"] + "-rotated") == 401


def test_a_revoked_trainers_waiting_long_poll_gets_no_batch(tmp_path: Path) -> None:
    """A trainer's long-poll that began before its key was removed from the file ends at its next step with 401,
    instead of taking the batch its key no longer admits."""
    keyfile = tmp_path / "keys"
    keyfile.write_text("".join(f"{role}-1 {role} {secret}\n" for role, secret in KEYS.items()))
    with running_server("memory://", tmp_path / "server.log", "--api-keys-file", str(keyfile)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            trainer, env_key = headers(KEYS["trainer"]), headers(KEYS["env"])
            c.post("/register", json=registration(batch_size=8), headers=trainer)
            c.get("/batch", headers=trainer)
            env_id = c.post("/register-env", json=env(group_size=4), headers=env_key).json()["env_id"]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(c.get, "/batch", params={"wait": 25}, headers=trainer)
                keyfile.write_text("".join(f"{role}-1 {role} {KEYS[role]}\n" for role in ("env", "admin")))
                deadline = time.monotonic() + 20
                while c.get("/status", headers=trainer).status_code != 401:  # the file read again
                    assert time.monotonic() < deadline
                    time.sleep(0.05)  # polling interval
                for seed in range(2):  # a whole batch: the waiting long-poll wakes to it
                    reply = c.post("/scored_data", json=group(4, env_id=env_id, seed=seed), headers=env_key)
                    assert reply.status_code == 200, reply.text
                got = waiting.result(timeout=30)
            assert got.status_code == 401 and "revoked" in got.text
            admin = headers(KEYS["admin"])
            assert c.get("/status", headers=admin).json()["queue_size"] == 2  # the batch was not taken


def test_every_route_admits_exactly_its_roles(keyed: ServerProcess) -> None:
    with httpx.Client(base_url=keyed.url) as c:
        callers: dict[str, str | None] = {"no key": None, "wrong key": WRONG, **KEYS}
        for (method, path), rule in sorted(ROUTES.items()):
            for caller, key in callers.items():
                r = c.request(method, path, headers=headers(key), content=b"{}" if method == "POST" else None)
                if rule == "public":
                    assert r.status_code not in (401, 403), (method, path, caller, r.text)
                elif key is None or key == WRONG:
                    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (method, path, caller)
                elif caller in rule:
                    assert r.status_code not in (401, 403), (method, path, caller, r.text)
                else:
                    assert r.status_code == 403 and caller in r.json()["message"], (method, path, caller, r.text)


def test_an_env_key_uses_only_its_own_envs(keyed: ServerProcess, tmp_path: Path) -> None:
    with httpx.Client(base_url=keyed.url) as c:
        trainer, env_key, admin = (headers(KEYS[r]) for r in ("trainer", "env", "admin"))
        assert c.post("/register", json=registration(batch_size=8), headers=trainer).status_code == 200
        c.get("/batch", headers=trainer)
        mine = c.post("/register-env", json=env("mine"), headers=env_key).json()["env_id"]
        theirs = c.post("/register-env", json=env("theirs"), headers=admin).json()["env_id"]
        assert c.post("/scored_data", json=group(4, env_id=mine), headers=env_key).status_code == 200
        r = c.post("/scored_data", json=group(4, env_id=theirs, seed=1), headers=env_key)  # as if it did not exist
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "env_id"]
        assert r.json()["message"].endswith(f"no environment with env_id {theirs} is registered")
        r = c.post("/disconnect-env", json={"env_id": theirs}, headers=env_key)
        assert r.json() == {"status": "failure", "error": f"no environment with env_id {theirs}"}
        assert c.post("/scored_data", json=group(4, env_id=theirs, seed=2), headers=admin).status_code == 200
        assert c.get("/status", headers=env_key).json()["queue_size"] == 2


def test_a_web_page_on_the_machine_cannot_reach_a_keyless_server(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        assert c.post("/register", json=registration(batch_size=8)).status_code == 200
        c.get("/batch")
        env_id = c.post("/register-env", json=env()).json()["env_id"]
        # <form> or fetch(..., {mode: "no-cors"}) from another site: no preflight, so refused by what it carries
        r = c.get("/reset_data", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "cross-site" in r.json()["message"]
        r = c.get("/reset_data", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
        assert r.status_code == 403  # <img src=".../reset_data">: no Origin, but the fetch metadata says it
        body = json.dumps(group(4, env_id=env_id))
        text = c.post("/scored_data", content=body, headers={"Content-Type": "text/plain"})
        assert text.status_code == 415
        # DNS rebinding: evil.example resolving to 127.0.0.1 reaches the port with its own Host
        assert c.get("/status", headers={"Host": "evil.example:8000"}).status_code == 421
        # Atropos's clients, and the dashboard's own page, are unaffected
        assert c.post("/scored_data", json=group(4, env_id=env_id)).status_code == 200
        same = c.get("/status", headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"})
        assert same.status_code == 200 and same.json()["queue_size"] == 1
        assert c.get("/dashboard", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200


def test_a_body_without_a_key_is_refused_before_it_is_read(keyed: ServerProcess) -> None:
    """300 MB with no key once took 16 s, 1.9 GB and stalled every other client: refused on its headers."""
    before = rss_kb(keyed.proc.pid)
    for path in ("/register", "/register-env", "/scored_data"):
        with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {300 * MiB}\r\n\r\n"
            sock.sendall(head.encode() + b"{" * 65536)
            with httpx.Client(base_url=keyed.url) as other:  # answered meanwhile
                assert other.get("/healthz").status_code == 200
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert rss_kb(keyed.proc.pid) - before < 50 * 1024


def test_a_huge_head_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    """One 100 MB header was read whole (the parser's cost growing with its square) and answered 200."""
    with running_server("memory://", tmp_path / "server.log") as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            sent = 0
            try:
                while sent < 100 * MiB:
                    sock.sendall(b"a" * MiB)
                    sent += MiB
            except (BrokenPipeError, ConnectionResetError):
                pass
            sock.settimeout(10)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 431") and b'"code":"headers_too_large"' in answer, answer[:300]
        assert sent < 100 * MiB, "the whole header was read"


def test_slow_heads_time_out(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log", "--header-timeout", "0.5") as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and then nothing
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 408")


def test_idle_connections_past_the_descriptor_limit_do_not_stop_a_client(tmp_path: Path) -> None:
    """1,100 idle connections once used up a 1,024-descriptor limit (systemd's default): innocent clients got
    connection resets. Past max_connections the longest idle one makes room."""
    server = start_server("memory://", tmp_path / "server.log", None, prefix=["prlimit", "--nofile=1024:1024"])
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        deadline = time.monotonic() + 30
        while True:  # the server accepts them one by one: a client among them gets its answer
            try:
                with httpx.Client(base_url=server.url, timeout=5) as c:
                    assert c.get("/healthz").status_code == 200
                    assert c.get("/status").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "a legitimate client was never served"
    finally:
        for sock in idle:
            sock.close()
        server.kill()


def test_uploads_cut_off_and_forged_names_cannot_flood_or_forge_the_log(tmp_path: Path) -> None:
    """Each upload cut off after one byte logged a 5 KB traceback (10 MB of log in 5.5 s); an env name with a
    newline wrote a forged line."""
    log = tmp_path / "server.log"
    with running_server("memory://", log, "--log-level", "info") as server:
        with httpx.Client(base_url=server.url) as c:
            assert c.post("/register", json=registration(batch_size=8)).status_code == 200
            c.get("/batch")
            forged = "math\n2026-01-01T00:00:00.000 WARNING [1] rollbuf: forged"
            env_id = c.post("/register-env", json=env(name=forged)).json()["env_id"]
            c.post("/scored_data", json=group(4, env_id=env_id, seed=1) | {"scores": [0.0] * 3})  # a refusal line
            for _ in range(50):
                with socket.create_connection(("127.0.0.1", server.port)) as sock:
                    head = "POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
                    sock.sendall(head.encode() + b"{")
            assert c.get("/healthz").status_code == 200
    lines = log.read_text().splitlines()
    assert not any("forged" in line and line.startswith("2026-01-01") for line in lines), lines
    assert not any("Traceback" in line for line in lines)
    assert 1 <= sum("client went away while sending its body" in line for line in lines) <= 2
