"""Per-rollout groups across real processes (issue 40, docs/rollouts.md): a server on SQLite, a producer that
opens a G=8 group, posts 3 rollouts and is killed -9, and two sibling producers that take its missing slots as
leases once it stops heartbeating. Every rollout the dead producer finished is kept, once; the group is sealed
complete and served by /batch as one group of 8."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.factories import env, registration
from tests.integration.test_crossproc import process
from tests.servers import start_server

pytestmark = pytest.mark.integration


def view(c: httpx.Client) -> dict[str, Any]:
    return c.get("/rollouts/group", params={"group_id": "g"}).json()  # type: ignore[no-any-return]


def wait_for(what: str, ok: Any, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not ok():
        assert time.monotonic() < deadline, f"waited too long for {what}"
        time.sleep(0.05)


def test_a_group_spread_over_producers_survives_one_killed_mid_group(tmp_path: Path) -> None:
    server = start_server(f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None,
                          "--rollout-lease-s", "1")  # fmt: skip
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=8)).status_code == 200
        c.get("/batch")
        assert c.post("/register-env", json=env(group_size=8)).status_code == 200

        def producer(n: int, *args: str) -> Any:
            argv = ("--server", server.url, "--producer", str(n), "--group", "g", *args)
            return stack.enter_context(process("tests.rollout_slot_process", tmp_path / f"producer-{n}.log", *argv))

        holder = producer(0, "--open", "8", "--slots", "0,1,2")
        wait_for("the holder's 3 rollouts", lambda: c.get("/rollouts/group", params={"group_id": "g"}).status_code
                 == 200 and view(c)["done"] == [0, 1, 2])  # fmt: skip
        siblings = [producer(n) for n in (1, 2)]
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        wait_for("the group's seal", lambda: view(c)["state"] == "sealed")
        sealed = view(c)
        assert sealed["done"] == list(range(8)) and sealed["left_out"] == {}
        assert sealed["redispatched"] >= 5
        for p in siblings:
            p.wait(timeout=60)
        batch = c.get("/batch").json()["batch"]
        assert batch is not None and len(batch) == 1
        rows = batch[0]["tokens"]
        assert sorted(r[0] - 100 for r in rows) == list(range(8)), "every slot once"
        by_slot = {r[0] - 100: r[1] - 200 for r in rows}
        assert [by_slot[s] for s in (0, 1, 2)] == [0, 0, 0], "the dead producer's finished rollouts are kept"
        assert {by_slot[s] for s in range(3, 8)} <= {1, 2}
        totals = c.get("/rollouts").json()
        assert (totals["opened"], totals["sealed"], totals["slots"], totals["open"]) == (1, 1, 8, 0)
