"""Tasks leased from rollbuf across real processes (issue 39, docs/tasks.md): a server on SQLite, the fake vLLM,
producer processes (`RolloutRunner` + `LeasedTasks`) of which some are killed -9 mid-run and replaced, and the
server itself killed -9 and restarted on its file, while this test trains (takes batches). Every task of every
epoch is trained exactly once: no lease of a dead producer is lost, no task's group is trained twice."""

from __future__ import annotations

import os
import random
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client.examples import arithmetic_task
from tests.factories import registration
from tests.fake_vllm import fake_vllm
from tests.integration.test_crossproc import process
from tests.servers import start_server

pytestmark = pytest.mark.integration

TASKS = 24
EPOCHS = 2


def tasks_view(url: str) -> dict[str, Any]:
    [view] = httpx.get(url + "/tasks", timeout=10).json()
    return view  # type: ignore[no-any-return]


def test_every_task_is_trained_once_per_epoch_across_producer_and_server_kills(tmp_path: Path) -> None:
    rng = random.Random(39)
    store = f"sqlite:///{tmp_path / 'rollbuf.db'}"
    extra = ("--task-lease-s", "2", "--ledger-max-groups", "100000")
    server = start_server(store, tmp_path / "server.log", None, *extra)
    url = server.url
    with ExitStack() as stack, httpx.Client(base_url=url, timeout=30) as c:
        stack.callback(lambda: server.kill(signal.SIGKILL))
        vllm = stack.enter_context(fake_vllm(tmp_path / "vllm.log"))
        assert c.post("/register", json=registration(batch_size=4)).status_code == 200
        c.get("/batch")
        tasks = [{"id": t.id, "prompt": t.prompt, "answer": t.answer} for t in map(arithmetic_task, range(TASKS))]
        spec = {"name": "arith", "tasks": tasks, "epochs": EPOCHS, "order": "shuffled", "seed": 3, "max_retries": 5}
        assert c.post("/tasks/datasets", json=spec).status_code == 200

        def producer(n: int) -> Any:
            args = ("--server", url, "--inference", vllm.url, "--dataset", "arith", "--max-in-flight", "4")
            return stack.enter_context(process("tests.producer_process", tmp_path / f"producer-{n}.log", *args))

        producers = [producer(n) for n in range(3)]
        started = len(producers)
        kills = 0
        server_killed = False
        deadline = time.monotonic() + 150
        while not tasks_done(c):
            assert time.monotonic() < deadline, f"not done: {tasks_view(url)}"
            try:
                c.get("/batch")  # train: take what is formed
            except httpx.TransportError:
                continue  # the server is restarting
            trained = tasks_view(url)["counts"].get("trained", 0)
            if kills < 3 and trained >= 6 * (kills + 1):
                victim = producers.pop(rng.randrange(len(producers)))
                os.killpg(victim.pid, signal.SIGKILL)
                victim.wait(timeout=30)
                producers.append(producer(started))
                started += 1
                kills += 1
            if not server_killed and trained >= 20:
                server.kill(signal.SIGKILL)
                server = start_server(store, tmp_path / "server.log", server.port, *extra)
                server_killed = True
        assert kills == 3 and server_killed
        rows = []
        after = (-1, -1)
        while after is not None:
            page = c.get("/tasks/rows", params={"dataset": "arith", "after_epoch": after[0], "after_index": after[1]})
            rows += page.json()["tasks"]
            after = page.json()["next"]
        assert sorted((r["epoch"], r["index"]) for r in rows) == [(e, i) for e in range(EPOCHS) for i in range(TASKS)]
        assert all(r["state"] == "trained" for r in rows), [r for r in rows if r["state"] != "trained"]
        for r in rows:  # every group ever sent for this (epoch, task), under any of its leases: one was trained
            served = []
            for lease in range(1, r["leases"] + 1):
                got = c.get(f"/ledger/groups/task:arith:{r['epoch']}:{r['index']}:{lease}")
                if got.status_code == 200:
                    served += [g for g in got.json()["groups"] if g["fate"] == "served"]
            assert len(served) == 1, (r, served)
        counts = tasks_view(url)["counts"]
        assert counts.get("late", 0) == 0 and counts["trained"] == TASKS * EPOCHS


def tasks_done(c: httpx.Client) -> bool:
    try:
        [view] = c.get("/tasks").json()
    except httpx.TransportError:
        return False
    return bool(view["done"])
