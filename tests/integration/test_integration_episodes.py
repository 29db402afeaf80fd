"""Durable episodes across real processes (docs/episodes.md): a server on SQLite, two producer processes running
`RolloutRunner` with three multi-turn tool envs (G=4, 8 turns each: resumed by replaying deterministic tools, by
restoring snapshots, and one that can do neither), the first opening one group of each and killed -9
mid-episode, the second taking the killed one's slots. Every sealed rollout's token stream equals what an
uninterrupted run with the same seeds and the deterministic scripted policy generates (the resumed ones are
token-exact continuations), every turn is acknowledged once (none lost, none doubled), and the turns the killed
producer had acknowledged are not generated again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client import ScriptedPolicy
from rollout_client.examples import walk_script
from rollout_client.group import run_rollout
from tests.episode_producer_process import TASK, TURNS, envs
from tests.factories import registration
from tests.runs import exited, poll_until, process
from tests.servers import start_server

pytestmark = pytest.mark.integration

G = 4


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def expected(group_id: str, env_name: str) -> list[list[int]]:
    """The group's rollouts as an uninterrupted run generates them: same group id, slots, seeds and policy."""
    [env] = [e for e in envs() if e.name == env_name]

    async def run() -> list[list[int]]:
        policy = ScriptedPolicy(walk_script)
        return [(await run_rollout(env, TASK, policy, k, group_key=group_id)).tokens for k in range(G)]

    return asyncio.run(run())


def test_a_producer_killed_mid_episode_has_its_slots_resumed_token_exact_by_another(tmp_path: Path) -> None:
    server = start_server(
        f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None, "--rollout-lease-s", "1"
    )
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=G)).status_code == 200
        c.get("/batch")

        def producer(name: str, *args: str) -> Any:
            argv = ("--server", server.url, "--events", str(tmp_path / f"{name}.jsonl"), *args)
            return stack.enter_context(process("tests.episode_producer_process", tmp_path / f"{name}.log", *argv))

        first = producer("p1", "--tasks", "1", "--gen-s", "0.15")
        opened: dict[str, str] = {}

        def turns_in(gid: str) -> list[int]:
            view = c.get("/rollouts/group", params={"group_id": gid})
            return [v["n"] for v in view.json()["turns"].values()] if view.status_code == 200 else []

        def mid_episode() -> bool:
            opened.update({g: e for g, e in (x["open"] for x in events(tmp_path / "p1.jsonl") if "open" in x)})
            resumable = [g for g, e in opened.items() if e != "walk_restart"]
            return len(opened) == 3 and all(len(turns_in(g)) == G and min(turns_in(g)) >= 2 for g in resumable)

        poll_until(mid_episode, "p1 mid-episode: every slot of the resumable groups with 2 turns in")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        acked = {g: sum(turns_in(g)) for g in opened}
        assert all(n < G * (TURNS - 1) for n in acked.values()), "killed mid-episode"
        producer("p2", "--tasks", "0", "--gen-s", "0.0")

        sealed: list[list[int]] = []

        def all_sealed() -> bool:
            while (batch := c.get("/batch").json()["batch"]) is not None:
                sealed.extend(tokens for item in batch for tokens in item["tokens"])
            return len(sealed) == 3 * G

        poll_until(all_sealed, "the killed producer's groups sealed by the other")
        want = [tokens for gid, name in opened.items() for tokens in expected(gid, name)]
        assert Counter(map(tuple, sealed)) == Counter(map(tuple, want)), "every rollout token-exact"

        totals = c.get("/rollouts").json()
        assert totals["turns"] == 2 * G * (TURNS - 1), "each turn of the two resumable envs acknowledged once"
        assert totals["resumed"] >= 2 * G, "every slot of the resumable groups handed on with its turns"
        generated = sum("gen" in e for e in events(tmp_path / "p2.jsonl"))
        killed_turns = sum(n for g, n in acked.items() if opened[g] != "walk_restart")
        assert killed_turns and generated == 3 * G * TURNS - killed_turns, "acknowledged turns not generated again"


def test_a_worker_killed_mid_episode_has_its_slots_resumed_token_exact_by_its_runner(tmp_path: Path) -> None:
    """One producer with two worker processes; one worker killed -9 mid-episode. The runner starts a new worker
    and continues the dead one's slots from their acknowledged turns (replay, snapshot): every rollout
    token-exact, every turn acknowledged once, and the dead worker's acknowledged turns not generated again."""
    server = start_server(f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log", None)
    with ExitStack() as stack, httpx.Client(base_url=server.url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        assert c.post("/register", json=registration(batch_size=G)).status_code == 200
        c.get("/batch")
        log = tmp_path / "p1.jsonl"
        argv = ("--server", server.url, "--events", str(log), "--tasks", "1", "--gen-s", "0.15", "--workers", "2")
        argv += ("--envs", "walk,walk_snapshot")
        producer = stack.enter_context(process("tests.episode_producer_process", tmp_path / "p1.log", *argv))
        opened: dict[str, str] = {}

        def turns_in(gid: str) -> list[int]:
            view = c.get("/rollouts/group", params={"group_id": gid})
            return [v["n"] for v in view.json()["turns"].values()] if view.status_code == 200 else []

        def mid_episode() -> bool:
            opened.update({g: e for g, e in (x["open"] for x in events(log) if "open" in x)})
            return len(opened) == 2 and all(len(turns_in(g)) == G and min(turns_in(g)) >= 2 for g in opened)

        poll_until(mid_episode, "every slot with 2 turns in")
        by_pid = Counter(e["pid"] for e in events(log) if "gen" in e)
        assert producer.pid not in by_pid and len(by_pid) == 2, "the rollouts run in the two workers"
        victim = by_pid.most_common(1)[0][0]
        os.kill(victim, signal.SIGKILL)
        poll_until(lambda: exited(victim), "the worker gone")
        acked = sum(sum(turns_in(g)) for g in opened)
        assert acked < 2 * G * (TURNS - 1), "killed mid-episode"

        sealed: list[list[int]] = []

        def all_sealed() -> bool:
            while (batch := c.get("/batch").json()["batch"]) is not None:
                sealed.extend(tokens for item in batch for tokens in item["tokens"])
            return len(sealed) == 2 * G

        poll_until(all_sealed, "both groups sealed by the same runner")
        assert producer.poll() is None, "the runner lived on"
        want = [tokens for gid, name in opened.items() for tokens in expected(gid, name)]
        assert Counter(map(tuple, sealed)) == Counter(map(tuple, want)), "every rollout token-exact"
        totals = c.get("/rollouts").json()
        assert totals["turns"] == 2 * G * (TURNS - 1), "each turn acknowledged once: none lost, none doubled"
        generated = sum("gen" in e for e in events(log))
        assert generated < 2 * G * TURNS + by_pid[victim], "the dead worker's acknowledged turns not generated again"
