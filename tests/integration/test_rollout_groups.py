"""Per-rollout groups across real processes (docs/rollouts.md): a server on SQLite, a producer that
opens a G=8 group, posts 3 rollouts and is killed -9, and two sibling producers that take its missing slots as
leases once it stops heartbeating. Every rollout the dead producer finished is kept, once; the group is sealed
complete and served by /batch as one group of 8. Then the same across two replicas on PostgreSQL, with holders
and a sibling killed -9."""

from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import pg
from tests.factories import env, registration
from tests.runs import process
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
    server = start_server(
        f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None, "--rollout-lease-s", "1"
    )
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=8)).status_code == 200
        c.get("/batch")
        assert c.post("/register-env", json=env(group_size=8)).status_code == 200

        def producer(n: int, *args: str) -> Any:
            argv = ("--server", server.url, "--producer", str(n), "--group", "g", *args)
            return stack.enter_context(process("tests.rollout_slot_process", tmp_path / f"producer-{n}.log", *argv))

        holder = producer(0, "--open", "8", "--slots", "0,1,2")
        wait_for(
            "the holder's 3 rollouts",
            lambda: (
                c.get("/rollouts/group", params={"group_id": "g"}).status_code == 200 and view(c)["done"] == [0, 1, 2]
            ),
        )
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


LEASE_S = 2.0
G = 8
HELD = {0: (0, 1, 2), 1: (0, 1, 2, 3, 4)}
"""What each holder posts of its groups before it is killed -9 (holder 0 through one replica, holder 1 the other)."""


def test_groups_survive_producers_killed_across_two_postgresql_replicas(tmp_path: Path) -> None:
    """Two replicas on one PostgreSQL database: two holders (one through each) open 3 groups each, post some of
    their rollouts and are killed -9; three siblings (through both) take the missing slots, one of them killed -9
    while it holds leases. Every group is sealed complete; every acknowledged rollout is served once, the dead
    holders' by the holders; no slot was leased to two producers at once."""
    with ExitStack() as stack:
        store = pg.url_of(stack.enter_context(pg.database()))
        servers = [
            start_server(store, tmp_path / f"server-{k}.log", None, "--rollout-lease-s", str(LEASE_S)) for k in (0, 1)
        ]
        for s in servers:
            stack.callback(s.kill)
        a, b = servers
        groups = {0: [f"a{i}" for i in range(3)], 1: [f"b{i}" for i in range(3)]}
        everyone = groups[0] + groups[1]
        leases = tmp_path / "leases.jsonl"
        c = stack.enter_context(httpx.Client(base_url=a.url, timeout=30))
        cb = stack.enter_context(httpx.Client(base_url=b.url, timeout=30))
        assert c.post("/register", json=registration(batch_size=G)).status_code == 200
        c.get("/batch")
        assert c.post("/register-env", json=env(group_size=G)).status_code == 200

        def producer(n: int, server: Any, *args: str) -> Any:
            argv = ("--server", server.url, "--producer", str(n), *args)
            return stack.enter_context(process("tests.rollout_slot_process", tmp_path / f"producer-{n}.log", *argv))

        def views(client: httpx.Client) -> dict[str, dict[str, Any]]:
            got = {g: client.get("/rollouts/group", params={"group_id": g}) for g in everyone}
            return {g: r.json() for g, r in got.items() if r.status_code == 200}

        holders = [
            producer(n, server, "--group", ",".join(groups[n]), "--open", str(G), "--slots", ",".join(map(str, slots)))
            for n, server, slots in ((0, a, HELD[0]), (1, b, HELD[1]))
        ]

        def posted() -> bool:
            seen = views(cb)
            return len(seen) == 6 and all(seen[g]["done"] == list(HELD[n]) for n in (0, 1) for g in groups[n])

        wait_for("the holders' rollouts", posted)
        for p in holders:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        sibling_args = ("--group", ",".join(everyone), "--leases", str(leases))
        siblings = [producer(n, server, *sibling_args) for n, server in ((2, b), (3, a), (4, b))]
        wait_for(
            "a lease held by sibling 4", lambda: any("producer-4" in v["leased"].values() for v in views(c).values())
        )
        siblings[2].send_signal(signal.SIGKILL)
        siblings[2].wait(timeout=30)
        wait_for("every group's seal", lambda: all(v["state"] == "sealed" for v in views(c).values()))
        for p in siblings[:2]:
            p.wait(timeout=60)
        for g, v in views(cb).items():
            assert (v["done"], v["left_out"]) == (list(range(G)), {}), g

        served: dict[str, list[tuple[int, int]]] = {}
        for step in range(6):
            batch = (c if step % 2 else cb).get("/batch").json()["batch"]
            assert batch is not None and len(batch) == 1, step
            served[batch[0]["group_id"]] = sorted((r[0] - 100, r[1] - 200) for r in batch[0]["tokens"])
        assert sorted(served) == sorted(everyone), "each group served once"
        for n in (0, 1):
            for g in groups[n]:
                slots = served[g]
                assert [s for s, _ in slots] == list(range(G)), f"{g}: every slot once"
                assert all(p == n for s, p in slots if s in HELD[n]), f"{g}: the dead holder's rollouts are kept"
                assert all(p in (2, 3, 4) for s, p in slots if s not in HELD[n])
        totals = cb.get("/rollouts").json()
        assert (totals["opened"], totals["sealed"], totals["open"], totals["slots"]) == (6, 6, 0, 6 * G)
        assert totals["redispatched"] >= 6 * G - 3 * len(HELD[0]) - 3 * len(HELD[1])

        by_slot: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for line in leases.read_text().splitlines():
            x = json.loads(line)
            by_slot.setdefault((x["group"], x["slot"]), []).append(x)
        for key, got in by_slot.items():
            got.sort(key=lambda x: x["expires_at"])
            for before, after in zip(got, got[1:], strict=False):
                assert after["expires_at"] - LEASE_S >= before["expires_at"] - 1e-6, f"{key} leased twice at once"
