"""Tasks leased from rollbuf across real processes (docs/tasks.md): the fake vLLM, producer processes
(`RolloutRunner` + `LeasedTasks`) and a trainer that reads ahead and commits at its checkpoints
(tests/resuming_trainer.py), on SQLite (one server) and on PostgreSQL (two replicas, the producers leasing from
both). Producers, the trainer and a server are killed -9 mid-run and started again. Every task of every epoch is
trained exactly once: in the trainer's checkpoint (each (epoch, task) in one trained step), in the task rows, and
in the ledger (of every group it served, one per task and epoch)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.tasks.tokens import parse_token
from rollout_client.examples import arithmetic_task
from tests import pg
from tests.resuming_trainer import REGISTRATION
from tests.runs import process
from tests.servers import ServerProcess, start_server
from tests.standin import running_standin
from trainer_client.protocol import registration

pytestmark = pytest.mark.integration

TASKS = 16
EPOCHS = 2
STEPS = TASKS * EPOCHS // 4
"""The trainer's batches hold 8 sequences: four groups of the producers' two."""
TRAIN_S = 0.25
"""A training step's time: the trainer's last steps outlast the test's look at the run (a GET that a loaded
server answers slowly), so its second kill comes before it is done. At 0.05 s a restarted trainer that read
ahead over groups made while it was down finished between two looks, once in a fresh-clone CI."""
EXTRA = ("--task-lease-s", "12", "--ledger-max-groups", "100000")
"""The lease outlasts a server's restart (several seconds under load): a producer cut off for longer than its
lease, whose task another producer leased meanwhile, throws its rollout away (its group is refused: docs/tasks.md),
which a replica killed beside a live one makes likely."""


def get(servers: list[ServerProcess], path: str, **params: Any) -> Any:
    """GET from the first server that answers (one may be restarting)."""
    for server in servers:
        try:
            reply = httpx.get(server.url + path, params=params, timeout=10)
        except httpx.TransportError:
            continue
        if reply.status_code == 200:
            return reply.json()
    return None


def trainer(url: str, commit_url: str, checkpoint: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tests.resuming_trainer",
        url,
        str(checkpoint),
        str(STEPS),
        "--commit-url",
        commit_url,
        "--train-s",
        str(TRAIN_S),
    ]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(servers: list[ServerProcess]) -> None:
    for server in servers:
        server.kill()


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_task_is_trained_once_per_epoch_across_producer_trainer_and_server_kills(
    backend: str, tmp_path: Path
) -> None:
    rng = random.Random(39)
    with ExitStack() as stack:
        if backend == "sqlite":
            stores = [f"sqlite:///{tmp_path / 'rollbuf.db'}"]
        else:
            stores = [pg.url_of(stack.enter_context(pg.database()))] * 2
        log = tmp_path / "server.log"
        servers = [start_server(store, log, None, *EXTRA) for store in stores]
        stack.callback(stop, servers)
        vllm = stack.enter_context(running_standin(tmp_path / "vllm.log"))
        with httpx.Client(base_url=servers[0].url, timeout=30) as c:
            assert c.post("/register", json=registration(starting_step=0, **REGISTRATION)).status_code == 200
            tasks = [{"id": t.id, "prompt": t.prompt, "answer": t.answer} for t in map(arithmetic_task, range(TASKS))]
            spec = {"name": "arith", "tasks": tasks, "epochs": EPOCHS, "order": "shuffled", "seed": 3, "max_retries": 5}
            assert c.post("/tasks/datasets", json=spec).status_code == 200

        def producer(n: int) -> Any:
            url = live[n % len(live)].url  # on PostgreSQL, both replicas hand out leases
            args = ("--server", url, "--inference", vllm.url, "--dataset", "arith", "--max-in-flight", "2")
            return stack.enter_context(process("demos.example_producer", tmp_path / f"producer-{n}.log", *args))

        checkpoint = tmp_path / "checkpoint.json"
        # The servers the trainer and new producers use: on PostgreSQL a killed replica stays down (its producers
        # are cut off for good: their leases expire and the other replica hands them out), so that no producer
        # rides out an outage longer than its lease (docs/tasks.md: its group would be trained beside the next's).
        live = list(servers)

        def train(k: int) -> subprocess.Popen[bytes]:
            urls = [s.url for s in live]
            return trainer(urls[k % len(urls)], urls[(k + 1) % len(urls)], checkpoint, tmp_path / "trainer.log")

        producers = [producer(n) for n in range(3)]
        started = len(producers)
        runs = 1
        proc = train(0)
        stack.callback(lambda: kill(proc))
        killed = {"producer": 0, "trainer": 0, "server": 0}
        deadline = time.monotonic() + 150
        while proc.poll() is None or proc.returncode != 0:
            assert time.monotonic() < deadline, f"not done: {get(live, '/tasks')}"
            if proc.poll() is not None:  # a trainer killed: resumed from its checkpoint
                assert proc.returncode == -signal.SIGKILL, (tmp_path / "trainer.log").read_text()[-4000:]
                proc = train(runs)
                runs += 1
            view = get(live, "/tasks")
            done = 0 if view is None else view[0]["counts"].get("trained", 0) + view[0]["counts"].get("served", 0)
            if killed["producer"] < 2 and done >= 6 * (killed["producer"] + 1):
                victim = producers.pop(rng.randrange(len(producers)))
                os.killpg(victim.pid, signal.SIGKILL)
                victim.wait(timeout=30)
                producers.append(producer(started))
                started += 1
                killed["producer"] += 1
            if killed["trainer"] < 2 and done >= 8 + 8 * killed["trainer"] and proc.poll() is None:
                kill(proc)  # mid-run: between its checkpoints, reading ahead
                killed["trainer"] += 1
                if killed["server"] == 0:
                    k = rng.randrange(len(servers))
                    servers[k].kill(signal.SIGKILL)
                    if len(servers) == 1:
                        live[k] = servers[k] = start_server(stores[k], log, servers[k].port, *EXTRA)
                    else:
                        live.remove(servers[k])
                    killed["server"] += 1
            time.sleep(0.05)  # polling interval while the run goes on, not a wait for something to happen
        assert killed == {"producer": 2, "trainer": 2, "server": 1}, killed

        saved = json.loads(checkpoint.read_text())
        assert [step for step, _ in saved["trained"]] == list(range(STEPS))
        tokens = [parse_token(gid) for _, ids in saved["trained"] for gid in ids]
        trained = [(t.epoch, t.index) for t in tokens if t is not None]
        assert sorted(trained) == [(e, i) for e in range(EPOCHS) for i in range(TASKS)], "a task twice, or none"
        rows = []
        after: list[int] | None = [-1, -1]
        while after is not None:
            page = get(live, "/tasks/rows", dataset="arith", after_epoch=after[0], after_index=after[1])
            rows += page["tasks"]
            after = page["next"]
        assert all(r["state"] == "trained" for r in rows), [r for r in rows if r["state"] != "trained"]
        served: dict[tuple[int, int], int] = {}  # every group the ledger served, under any lease of its task
        for step in range(STEPS):
            for g in get(live, f"/ledger/steps/{step}")["groups"]:
                if g["fate"] == "served" and (token := parse_token(g["group_id"] or "")) is not None:
                    served[token.epoch, token.index] = served.get((token.epoch, token.index), 0) + 1
        assert served == {(r["epoch"], r["index"]): 1 for r in rows}, "a task served twice, or not at all"
        [view] = get(live, "/tasks")
        assert view["counts"].get("late", 0) == 0 and view["counts"]["trained"] == TASKS * EPOCHS and view["done"]
