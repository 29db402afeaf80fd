"""A long episode posted turn by turn across real processes (docs/rollouts.md, Turns): a server on SQLite, a
producer that opens a group and posts the episode's turns and is killed -9 mid-episode, and another producer that
takes the slot's lease once the first lapsed, continues from the turns the lease carries and finishes with a final
post `after_turns`. The sealed rollout is the uninterrupted episode: no acknowledged turn lost or doubled."""

from __future__ import annotations

import base64
import json
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import env, registration
from tests.runs import process
from tests.servers import start_server
from tests.turn_producer_process import TURNS, episode

pytestmark = pytest.mark.integration


def wait_for(what: str, ok: Any, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not ok():
        assert time.monotonic() < deadline, f"waited too long for {what}"
        time.sleep(0.05)


def test_a_producer_killed_mid_episode_is_continued_from_its_acknowledged_turns(tmp_path: Path) -> None:
    server = start_server(
        f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None, "--rollout-lease-s", "1"
    )
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=1)).status_code == 200
        c.get("/batch")
        assert c.post("/register-env", json=env(group_size=1)).status_code == 200
        record = tmp_path / "turns.txt"

        def producer(name: str, *args: str) -> Any:
            argv = ("--server", server.url, "--producer", name, "--group", "e", "--record", str(record), *args)
            return stack.enter_context(process("tests.turn_producer_process", tmp_path / f"{name}.log", *argv))

        def turns_in() -> int:
            reply = c.get("/rollouts/group", params={"group_id": "e"})
            return reply.json()["turns"].get("0", {}).get("n", 0) if reply.status_code == 200 else 0

        first = producer("p1", "--open")
        wait_for("3 turns acknowledged", lambda: turns_in() >= 3)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        acked_by_first = [int(line) for line in record.read_text().split()]
        held = turns_in()  # the server's count: a reply the producer never lived to write down is in it, not in
        assert 3 <= held < TURNS, "killed mid-episode"  # the record
        assert len(acked_by_first) <= held
        second = producer("p2")
        assert second.wait(timeout=60) == 0, (tmp_path / "p2.log").read_text()

        prefix = json.loads((tmp_path / "turns.txt.prefix").read_text())
        assert prefix["turns"] >= len(acked_by_first), "every turn acknowledged to the first producer was carried"
        assert [t["tokens"] for t in prefix["items"]] == episode()[: prefix["turns"]]
        assert {t["producer"] for t in prefix["items"]} == {"p1"}
        assert json.loads(base64.b64decode(prefix["snapshot"]["data"])) == {"turn": prefix["turns"] - 1}
        view = c.get("/rollouts/group", params={"group_id": "e"}).json()
        assert view["state"] == "sealed" and view["done"] == [0] and view["turns"] == {}
        batch = c.get("/batch").json()["batch"]
        assert batch is not None and batch[0]["tokens"] == [[t for turn in episode() for t in turn]]
        totals = c.get("/rollouts").json()
        assert (totals["turns"], totals["resumed"], totals["slots"]) == (TURNS, 1, 1), "no turn lost or doubled"
        assert totals["tokens_carried"] == 3 * prefix["turns"]
