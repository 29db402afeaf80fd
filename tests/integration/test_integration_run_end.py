"""A run over a finite dataset ends (docs/tasks.md, "The end of a dataset"): real processes, a `rollbuf serve`
server, a producer process (`RolloutRunner` over `LeasedTasks`, tests/leasing_producer.py, a scripted policy: no
inference server) and a trainer through `trainer_client` in this process.

100 tasks of groups of 2 towards batches of 16 leave 8 sequences short of a batch once 96 tasks are trained: they
are served as a last smaller batch once nothing else can arrive, so every task is trained exactly once, the dataset
is done, the trainer's iterator ends on its own and the producer's run returns (exit 0)."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client.policy import CharTokenizer
from tests.runs import process
from tests.servers import running_server
from trainer_client import TrainerClient

pytestmark = pytest.mark.integration

TASKS = 100
BATCH = 16
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
    """`TrainerClient.batches()` in a thread: counts each task's groups (by the question in their first sequence)
    and the size of each batch, and records whether the iterator ended on its own (not by `stop`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.groups: Counter[int] = Counter()
        self.sizes: list[int] = []
        self.ended = False
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Trainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=HANG_GUARD_S)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            with TrainerClient(self.url) as rb:
                rb.register(batch_size=BATCH, max_token_len=256)
                for batch in rb.batches(start_step=0, wait=2, stop=self.stop):
                    self.sizes.append(batch.n_seqs)
                    seqs = batch.sequences()
                    for g in range(batch.n_groups):
                        first = next(i for i, x in enumerate(batch.group_index) if x == g)
                        found = QUESTION.search(CharTokenizer.decode(seqs[first].tolist()))
                        assert found is not None
                        self.groups[int(found.group(1)) - 100] += 1
            self.ended = not self.stop.is_set()
        except BaseException as exc:  # reported by the test
            self.error = exc


def view(url: str) -> dict[str, Any]:
    [dataset] = httpx.get(url + "/tasks", timeout=30).json()
    return dataset  # type: ignore[no-any-return]


def test_a_finite_dataset_whose_groups_do_not_fill_a_last_batch_ends(tmp_path: Path) -> None:
    with ExitStack() as stack:
        server = stack.enter_context(running_server(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "server.log"))
        tasks = [{"id": f"t{i}", "prompt": question(i), "answer": str(100 + 8 * i)} for i in range(TASKS)]
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.post("/tasks/datasets", json={"name": "d", "tasks": tasks}).status_code == 200
        trainer = stack.enter_context(Trainer(server.url))
        args = (
            "--server",
            server.url,
            "--dataset",
            "d",
            "--producer-id",
            "P",
            "--stats",
            str(tmp_path / "P.json"),
            "--rollout-s",
            "0.02",
            "--max-in-flight",
            "16",
        )
        producer = stack.enter_context(process("tests.leasing_producer", tmp_path / "P.log", *args))

        def handed_in() -> bool:  # every task's group acknowledged (96 of them trained, 4 short of a batch)
            counts: dict[str, int] = view(server.url)["counts"]
            return sum(counts.get(s, 0) for s in ("submitted", "served", "trained")) == TASKS

        until(handed_in, "every task's group to be acknowledged")
        until(lambda: view(server.url)["done"], "the dataset to be done", 60.0)
        until(lambda: not trainer.alive(), "the trainer's iterator to end", 60.0)
        assert trainer.error is None, repr(trainer.error)
        assert trainer.ended, "the iterator ended on its own, not by stop"
        assert producer.wait(timeout=60.0) == 0, (tmp_path / "P.log").read_text()[-4000:]
        twice = {task: n for task, n in trainer.groups.items() if n != 1}
        assert not twice and len(trainer.groups) == TASKS, f"tasks not trained exactly once (task: groups): {twice}"
        assert trainer.sizes == [BATCH] * 12 + [8], trainer.sizes
        status = httpx.get(server.url + "/status", timeout=30).json()
        assert status["finished"] and status["tasks"][0]["done"], status
        assert status["tasks"][0]["counts"] == {"trained": TASKS}, status["tasks"]
        assert status["smaller_batches"] == 1 and status["queue_size"] == 0, status
