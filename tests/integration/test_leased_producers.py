"""Producers that stop or freeze while they hold task leases (docs/tasks.md, docs/rollout-client.md): real
processes, a `rollbuf serve` server, producer processes through `RolloutRunner` over `LeasedTasks`
(tests/leasing_producer.py, a scripted policy: no inference server) and a trainer in this process that reads
every batch as it forms and counts each task's groups by the question in their tokens.

- SIGTERM to one of two producers mid-run, and a producer that calls `runner.stop()`: the tasks of the groups it
  stopped go back to the dataset untried (never `failed`, no retry used, with `max_retries` 0), and the other (or a
  restarted) producer trains each task once.
- SIGSTOP of a producer past its short leases, while another producer takes their tasks, then SIGCONT: the frozen
  producer drops the groups of the leases it lost instead of sending them, counts them, and no task is trained
  twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client.policy import CharTokenizer
from tests.runs import process
from tests.servers import ServerProcess, running_server
from trainer_client.protocol import registration

pytestmark = pytest.mark.integration

TASKS = 24
HANG_GUARD_S = 120.0
"""Bounds on waits for processes and the run: hang guards for a loaded machine, never speed checks."""
QUESTION = re.compile(r"Q: (\d+) \+ (\d+) =")


def question(i: int) -> str:
    """Task i's question, distinct per task: the trainer finds the task of a group by it."""
    return f"Q: {100 + i} + {7 * i} ="


def until(cond: Callable[[], bool], what: str, guard_s: float = HANG_GUARD_S) -> None:
    """Poll `cond` (never a fixed sleep as a wait); fail after `guard_s`."""
    deadline = time.monotonic() + guard_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling interval, not a wait for something to happen


class Trainer:
    """Asks for the next batch over and over ("next" mode: asking acknowledges the one before), counting the
    groups of each task (by the question in their tokens) until `close()`, then reads what is left."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.groups: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Trainer:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            body = registration(batch_size=2, max_token_len=256, starting_step=0)
            assert http.post("/register", json=body).status_code == 200
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=HANG_GUARD_S)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while True:
                batch = http.get("/batch").json()["batch"]
                for group in batch or []:
                    found = QUESTION.search(CharTokenizer.decode(group["tokens"][0]))
                    assert found is not None
                    self.groups[int(found.group(1)) - 100] += 1
                if not batch:
                    if self._stop.is_set():
                        return
                    self._stop.wait(0.05)  # polling interval while nothing is queued


def register_dataset(url: str) -> None:
    tasks = [{"id": f"t{i}", "prompt": question(i), "answer": str(100 + 8 * i)} for i in range(TASKS)]
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/tasks/datasets", json={"name": "d", "tasks": tasks}).status_code == 200


def rows(url: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after: list[int] | None = [-1, -1]
    with httpx.Client(base_url=url, timeout=30) as http:
        while after is not None:
            params: dict[str, str | int] = {"dataset": "d", "after_epoch": after[0], "after_index": after[1]}
            page = http.get("/tasks/rows", params=params).json()
            out += page["tasks"]
            after = page["next"]
    return out


def view(url: str) -> dict[str, Any]:
    [dataset] = httpx.get(url + "/tasks", timeout=30).json()
    return dataset  # type: ignore[no-any-return]


def held_by(url: str, producer: str) -> list[dict[str, Any]]:
    return [r for r in rows(url) if r["state"] == "leased" and r["producer"] == producer]


def mid_run(url: str, producer: str, holding: int) -> Callable[[], bool]:
    """`producer` has sent groups already and holds `holding` leases or more now."""

    def check() -> bool:
        mine = [r for r in rows(url) if r["producer"] == producer]
        sent = [r for r in mine if r["state"] in ("submitted", "served", "trained")]
        return bool(sent) and sum(r["state"] == "leased" for r in mine) >= holding

    return check


@contextmanager
def producer(tmp: Path, server: ServerProcess, name: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    args = ("--server", server.url, "--dataset", "d", "--producer-id", name, "--stats", str(tmp / f"{name}.json"))
    with process("tests.leasing_producer", tmp / f"{name}.log", *args, *extra) as proc:
        yield proc


def ended(proc: subprocess.Popen[bytes], tmp: Path, name: str) -> dict[str, Any]:
    """The producer's stats, once it exited on its own (0)."""
    rc = proc.wait(timeout=HANG_GUARD_S)
    assert rc == 0, (tmp / f"{name}.log").read_text()[-4000:]
    return json.loads((tmp / f"{name}.json").read_text())  # type: ignore[no-any-return]


def failed(url: str) -> list[dict[str, Any]]:
    return [r for r in rows(url) if r["state"] == "failed"]


def trained_once(url: str, trainer: Trainer, producers: dict[str, subprocess.Popen[bytes]], tmp: Path) -> None:
    """The dataset is done and every producer left on its own; each task was trained exactly once: every task
    row trained (none failed or dropped, no retry used), and the trainer saw one group of each task, once the
    producers were gone (a group sent late would have come by then)."""
    until(lambda: view(url)["done"], "the dataset to be done")
    for name, proc in producers.items():
        ended(proc, tmp, name)
    trainer.close()
    states = Counter(r["state"] for r in rows(url))
    assert set(states) <= {"served", "trained"} and sum(states.values()) == TASKS, states
    assert all(r["retries"] == 0 for r in rows(url))
    twice = {task: n for task, n in trainer.groups.items() if n != 1}
    assert not twice and len(trainer.groups) == TASKS, f"tasks trained twice (task: groups): {twice}"


def test_sigterm_to_one_of_two_producers_hands_its_tasks_back_untried(tmp_path: Path) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(
            running_server(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "server.log", "--task-lease-s", "5")
        )
        trainer = stack.enter_context(Trainer(server.url))
        register_dataset(server.url)
        a = stack.enter_context(producer(tmp_path, server, "A", "--rollout-s", "0.6"))
        b = stack.enter_context(producer(tmp_path, server, "B", "--rollout-s", "0.6"))
        until(mid_run(server.url, "A", 2), "A to send groups and hold leases")
        os.killpg(a.pid, signal.SIGTERM)
        stats = ended(a, tmp_path, "A")
        assert stats["skipped"].get("stopped", 0) >= 1, stats  # it stopped groups in flight
        assert not failed(server.url), failed(server.url)
        trained_once(server.url, trainer, {"B": b}, tmp_path)


def test_runner_stop_hands_its_tasks_back_untried_and_a_restarted_producer_finishes(tmp_path: Path) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(
            running_server(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "server.log", "--task-lease-s", "5")
        )
        trainer = stack.enter_context(Trainer(server.url))
        register_dataset(server.url)
        with producer(tmp_path, server, "A", "--rollout-s", "0.5", "--stop-after", "3") as a:
            stats = ended(a, tmp_path, "A")
        assert stats["skipped"].get("stopped", 0) >= 1, stats  # it stopped groups in flight
        assert not failed(server.url), failed(server.url)
        with producer(tmp_path, server, "A2", "--rollout-s", "0.1") as again:
            trained_once(server.url, trainer, {"A2": again}, tmp_path)


def test_a_producer_frozen_past_its_leases_drops_their_groups(tmp_path: Path) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(
            running_server(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "server.log", "--task-lease-s", "2")
        )
        trainer = stack.enter_context(Trainer(server.url))
        register_dataset(server.url)
        a = stack.enter_context(producer(tmp_path, server, "A", "--rollout-s", "0.8"))
        b = stack.enter_context(producer(tmp_path, server, "B", "--rollout-s", "0.3"))
        until(mid_run(server.url, "A", 3), "A to send groups and hold leases")
        os.killpg(a.pid, signal.SIGSTOP)
        try:
            frozen = {(r["epoch"], r["index"]): r["leases"] for r in held_by(server.url, "A")}

            def taken() -> bool:  # every lease A held when frozen has lapsed and gone to B
                now = {(r["epoch"], r["index"]): r for r in rows(server.url)}
                return all(now[k]["leases"] > n and now[k]["producer"] == "B" for k, n in frozen.items())

            until(taken, "B to lease the tasks of A's lapsed leases")
        finally:
            os.killpg(a.pid, signal.SIGCONT)
        trained_once(server.url, trainer, {"A": a, "B": b}, tmp_path)
        stats = json.loads((tmp_path / "A.json").read_text())
        assert stats["lost"] >= 1 and stats["skipped"].get("lease_lost", 0) >= 1, stats
        assert view(server.url)["counts"].get("late", 0) == 0, view(server.url)["counts"]
