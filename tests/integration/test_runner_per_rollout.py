"""The runner's per-rollout groups across real processes (docs/rollouts.md): 4 producer processes
running `RolloutRunner` (tests/per_rollout_producer.py: G=16, each rollout posted as it ends), killed -9 at
random (a bounded, seeded schedule) and replaced, against a server on SQLite. The groups of a killed producer
are finished by the others through sibling leases. Every rollout the server acknowledged is served by /batch
exactly once (0 lost, 0 duplicated), and every group opened is sealed complete (or at its deadline, with its
reasons). On SQLite and on PostgreSQL. And a runner whose rollouts crash seals its survivors, counted."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Session, Task, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from tests import pg
from tests.factories import registration
from tests.per_rollout_producer import Slow
from tests.runs import process
from tests.servers import running_server, start_server

pytestmark = pytest.mark.integration

G = 16
PRODUCERS = 4
TASKS = 3
"""Groups each producer opens of its own (a killed one opens fewer; its replacement opens its own)."""
KILLS = 3
LIMIT_S = 120.0
"""A hang guard, not a speed check: in CI, beside the suite, the run settled in more than 30 s."""


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def acks_of(path: Path) -> int:
    return sum("ack" in e for e in events(path))


def wait_for(what: str, ok: Any, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not ok():
        assert time.monotonic() < deadline, f"waited too long for {what}"
        time.sleep(0.05)


def digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rollbuf.db'}"
    else:
        with pg.database() as name:
            yield pg.url_of(name)


def test_producers_killed_at_random_lose_no_acknowledged_rollout(tmp_path: Path, store: str) -> None:
    server = start_server(store, tmp_path / "server.log", None, "--rollout-lease-s", "1")
    rng = random.Random(40)
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=G)).status_code == 200
        c.get("/batch")
        live: dict[int, Any] = {}

        def start(n: int) -> None:
            argv = (
                "--server",
                server.url,
                "--events",
                str(tmp_path / f"events-{n}.jsonl"),
                "--idle",
                str(tmp_path / f"idle-{n}"),
                "--tasks",
                str(TASKS),
                "--offset",
                str(100 * n),
                "--min-s",
                "0.2",
                "--max-s",
                "0.8",
            )
            live[n] = stack.enter_context(process("tests.per_rollout_producer", tmp_path / f"producer-{n}.log", *argv))

        for n in range(PRODUCERS):
            start(n)
        for k in range(KILLS):  # each kill mid-group: once the victim has some acknowledged rollouts
            victim = rng.choice(sorted(n for n in live if not (tmp_path / f"idle-{n}").exists()))
            path = tmp_path / f"events-{victim}.jsonl"
            acks = acks_of(path) + rng.randint(3, G - 3)
            wait_for(f"{acks} acks of producer {victim}", lambda p=path, a=acks: acks_of(p) >= a)
            live.pop(victim).send_signal(signal.SIGKILL)
            start(PRODUCERS + k)

        def settled() -> bool:
            idle = all((tmp_path / f"idle-{n}").exists() for n in live)
            return idle and c.get("/rollouts").json().get("open", 1) == 0

        wait_for("every live producer idle and no group open", settled)
        for p in live.values():
            p.send_signal(signal.SIGTERM)
        for p in live.values():
            p.wait(timeout=30)

        totals = c.get("/rollouts").json()
        everything = [e for n in range(PRODUCERS + KILLS) for e in events(tmp_path / f"events-{n}.jsonl")]
        acked = [tuple(e["ack"]) for e in everything if "ack" in e]
        groups = sorted({a[0] for a in acked})
        views = {g: c.get("/rollouts/group", params={"group_id": g}).json() for g in groups}
        assert totals["opened"] == totals["sealed"] == len(groups), totals
        assert totals["redispatched"] > 0, "a killed producer's slots were leased to the others"
        for v in views.values():
            assert v["state"] == "sealed", v
            complete = v["done"] == list(range(G)) and v["left_out"] == {}
            assert complete or (len(v["done"]) >= v["min_group_size"] and v["left_out"]), v

        served: list[dict[str, Any]] = []
        step = c.get("/status").json()["current_step"]
        while batch := c.get("/batch", params={"step": step}).json()["batch"]:
            served.extend(batch)
            step += 1
        rows = Counter(digest(t) for grp in served for t in grp["tokens"])
        in_sealed = sum(len(v["done"]) - len(v["left_out"]) for v in views.values())
        assert sum(rows.values()) == in_sealed, "each sealed slot served once: none duplicated"
        assert len(served) == len(groups), "each group served once"
        lost = Counter(a[2] for a in acked) - rows
        assert not lost, f"acknowledged rollouts not served: {lost}"
        assert len({(a[0], a[1]) for a in acked}) == len(acked), "no slot acknowledged twice"


@dataclass
class TwoCrash(Arithmetic):
    """G=8 rollouts posted one by one; the 2nd and 5th started of each task crash: 6 survive, its min."""

    name: str = "two_crash"
    group_size: int = 8
    min_group_size: int | None = 6
    scores_each_rollout: bool = True
    posts_each_rollout: bool = True
    started: Counter[str] = field(default_factory=Counter)

    async def rollout(self, task: Task, session: Session) -> None:
        self.started[task.id] += 1
        if self.started[task.id] in (2, 5):
            raise RuntimeError("a crashed rollout")
        await super().rollout(task, session)


@pytest.mark.anyio
async def test_the_runner_seals_its_survivors_and_counts_them(tmp_path: Path) -> None:
    server = start_server(f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.post("/register", json=registration(batch_size=18)).status_code == 200
            c.get("/batch")
            env = TwoCrash()
            runner = RolloutRunner(
                server.url,
                [(env, Tasks(arithmetic_task))],
                ScriptedPolicy(arithmetic_script),
                max_in_flight=8,
                poll_interval=0.05,
            )
            stats = await runner.run(max_groups=3)
            assert (stats.accepted, stats.partial_groups, stats.failed_total) == (3, 3, 0)
            assert stats.rollouts_failed["two_crash"] == {"env_error": 6}
            assert (stats.rollouts_posted, stats.sibling_rollouts, stats.rollouts_redone) == (18, 0, 0)
            totals = c.get("/rollouts").json()
            assert (totals["sealed"], totals["sealed_partial"], totals["left_out"], totals["open"]) == (3, 3, 6, 0)
            served = []
            step = c.get("/status").json()["current_step"]
            while batch := c.get("/batch", params={"step": step}).json()["batch"]:
                served.extend(batch)
                step += 1
            assert sorted(len(g["tokens"]) for g in served) == [6, 6, 6]
    finally:
        server.kill()


class Nothing:
    """A task source with no task for now: the producer stays idle, its own groups none."""

    async def anext_task(self) -> Task | None:
        await asyncio.Event().wait()
        return None

    def next_task(self) -> Task | None:
        raise AssertionError("anext_task is used")

    def report(self, task: Task, mean_score: float) -> None:
        pass


def requests_by_route(url: str) -> Counter[str]:
    """Requests the server answered so far, by route (`rollbuf_request_duration_seconds_count`)."""
    out: Counter[str] = Counter()
    text = httpx.get(url + "/metrics").text
    for labels, n in re.findall(r"rollbuf_request_duration_seconds_count\{([^}]*)\} (\S+)", text):
        out[dict(re.findall(r'(\w+)="([^"]*)"', labels))["route"]] += int(float(n))
    return out


@pytest.mark.anyio
async def test_an_idle_per_rollout_producer_costs_its_heartbeat_and_no_sibling_poll(tmp_path: Path) -> None:
    """A producer of per-rollout groups with nothing to do, and no group open anywhere: over N heartbeats it asks
    for no sibling slot (each heartbeat's reply says none is due), instead of one lease per `poll_interval`."""
    with running_server("memory://", tmp_path / "server.log", "--producer-gone-after", "3") as server:  # beats: 0.5 s
        with httpx.Client(base_url=server.url) as c:
            assert c.post("/register", json=registration(batch_size=G)).status_code == 200
            c.get("/batch")
        env = Slow(group_size=G)
        runner = RolloutRunner(server.url, [(env, Nothing())], ScriptedPolicy(arithmetic_script), max_in_flight=G)
        run = asyncio.create_task(runner.run())
        try:
            deadline = time.monotonic() + LIMIT_S
            while (first := requests_by_route(server.url))["/producers/heartbeat"] < 2:  # the first reply taken in
                assert time.monotonic() < deadline, "no heartbeat"
                await asyncio.sleep(0.05)  # polling interval
            while (now := requests_by_route(server.url))["/producers/heartbeat"] < first["/producers/heartbeat"] + 4:
                assert time.monotonic() < deadline, "heartbeats stopped"
                await asyncio.sleep(0.05)  # polling interval
        finally:
            runner.stop()
            await asyncio.wait_for(run, LIMIT_S)
    assert now["/producers/heartbeat"] - first["/producers/heartbeat"] >= 4
    assert now["/rollouts/lease"] - first["/rollouts/lease"] == 0, (first, now)
