"""The key file as a real `rollbuf serve` watches it (docs/security.md, "Rotation"): a change is used without a
request having to notice it first, so the first request after it is judged by the new keys, and a file caught
half written is not used."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from tests.factories import env, group, registration
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.integration
SECRETS = {
    "env-1": "env-secret-0123456789",
    "trainer-1": "trainer-secret-0123456789",
    "admin-1": "admin-secret-0123456789",
    "env-2": "env-2-secret-0123456789",
}
ROLES = {"env-1": "env", "trainer-1": "trainer", "admin-1": "admin", "env-2": "env"}
GUARD_S = 20.0
"""Hang guard for the server to say it uses a new file (it does within a second; this is for a loaded machine)."""


def lines(*names: str) -> str:
    return "".join(f"{name} {ROLES[name]} {SECRETS[name]}\n" for name in names)


def in_use(*names: str) -> str:
    """The log line's words when the server starts using a file of these keys (names and roles, no secret)."""
    return "read again: keys " + ", ".join(f"{name} ({ROLES[name]})" for name in names) + "\n"


def headers(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def logged(server: ServerProcess, text: str) -> bool:
    """Whether the server has logged `text`, waited for up to GUARD_S. It sends no request meanwhile: nothing
    but the server's own watch of the file can make it read the file."""
    deadline = time.monotonic() + GUARD_S
    while text not in server.log.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling interval
    return True


def test_a_key_removed_from_the_file_is_refused_on_its_next_request(tmp_path: Path) -> None:
    """The trainer's key removed from the file: once the server has read it (no request sent meanwhile),
    `GET /reset_data` with that key is refused and the queue kept, and its long-poll that was waiting ends with 401
    at its next step, taking no batch. It used to be judged by the keys read before the change."""
    keyfile = tmp_path / "keys"
    keyfile.write_text(lines("env-1", "trainer-1", "admin-1"))
    with (
        running_server(
            "memory://", tmp_path / "server.log", "--api-keys-file", str(keyfile), "--log-level", "info"
        ) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        trainer, env_key, admin = headers("trainer-1"), headers("env-1"), headers("admin-1")
        assert c.post("/register", json=registration(batch_size=8), headers=trainer).status_code == 200
        c.get("/batch", headers=trainer)
        env_id = c.post("/register-env", json=env(group_size=4), headers=env_key).json()["env_id"]
        assert c.post("/scored_data", json=group(4, env_id=env_id), headers=env_key).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(c.get, "/batch", params={"wait": 60}, headers=trainer)
            deadline = time.monotonic() + GUARD_S
            while "rollbuf_waiting_long_polls 1.0" not in c.get("/metrics", headers=admin).text:
                assert time.monotonic() < deadline, "the long-poll never waited"
                time.sleep(0.05)  # polling interval
            new = tmp_path / "keys.new"
            new.write_text(lines("env-1", "admin-1"))
            new.rename(keyfile)
            read = logged(server, in_use("env-1", "admin-1"))
            reset = c.get("/reset_data", headers=trainer)  # the first request since the change
            assert reset.status_code == 401, f"a removed key's GET /reset_data answered {reset.status_code} ({read=})"
            assert read
            assert c.post("/scored_data", json=group(4, env_id=env_id, seed=1), headers=env_key).status_code == 200
            got = waiting.result(timeout=60)  # woken by a whole batch
        assert got.status_code == 401 and "revoked" in got.text, got.text
        assert c.get("/status", headers=admin).json()["queue_size"] == 2  # not reset, and the batch not taken


def test_a_key_added_to_the_file_is_accepted_on_its_first_request(tmp_path: Path) -> None:
    """A key added (the file edited in place): once the server has read it, the key's first request is let in."""
    keyfile = tmp_path / "keys"
    keyfile.write_text(lines("env-1", "trainer-1", "admin-1"))
    with (
        running_server(
            "memory://", tmp_path / "server.log", "--api-keys-file", str(keyfile), "--log-level", "info"
        ) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        keyfile.write_text(lines("env-1", "trainer-1", "admin-1", "env-2"))
        read = logged(server, in_use("env-1", "trainer-1", "admin-1", "env-2"))
        first = c.post("/register-env", json=env("new"), headers=headers("env-2"))
        assert first.status_code == 200, f"an added key's first request answered {first.status_code} ({read=})"
        assert read


SETTLE_S = 5.0
"""The server's `api_keys_file_settle` in the half-written file's test: longer than the writer's pause, with room
for a loaded machine to be late in writing the second half."""
PAUSE_S = 1.5
"""The writer's pause between the halves: longer than the second it once took a request to make the server read
the file, so a server that used what it read would use the half."""


def test_a_file_caught_half_written_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file written in place in two halves with a pause between: the first half parses, but without the
    trainer's key. Requests with the trainer's key are let in all along, and the new keys are used only once the
    file is whole."""
    keyfile = tmp_path / "keys"
    keyfile.write_text(lines("env-1", "trainer-1", "admin-1"))
    monkeypatch.setenv("ROLLBUF_API_KEYS_FILE_SETTLE", str(SETTLE_S))  # inherited by the server's process
    with (
        running_server(
            "memory://", tmp_path / "server.log", "--api-keys-file", str(keyfile), "--log-level", "info"
        ) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        sent, refused = 0, 0

        def trainer_asks() -> None:
            nonlocal sent, refused
            sent += 1
            refused += c.get("/status", headers=headers("trainer-1")).status_code != 200

        with keyfile.open("w") as f:
            f.write(lines("env-2", "admin-1"))
            f.flush()
            paused = time.monotonic()
            while time.monotonic() - paused < PAUSE_S:  # the writer's pause, requests sent all along
                trainer_asks()
                time.sleep(0.02)  # between two requests
            f.write(lines("trainer-1", "env-1"))
        whole = in_use("env-2", "admin-1", "trainer-1", "env-1")
        deadline = time.monotonic() + SETTLE_S + GUARD_S
        while whole not in server.log.read_text() and time.monotonic() < deadline:
            trainer_asks()
            time.sleep(0.02)  # between two requests
        assert refused == 0, f"{refused} of {sent} requests with a key the file kept were refused while it was written"
        assert whole in server.log.read_text(), "the whole file was not used"
        assert in_use("env-2", "admin-1") not in server.log.read_text()  # the half never was
        assert c.get("/status", headers=headers("env-2")).status_code == 200
