"""What the runner asks a task source about one task (rollout_client/runner/sources.py): a source without the hooks
answers as a plain source; one with them is asked."""

from __future__ import annotations

from typing import Any

from rollout_client import Task
from rollout_client.leases.tasks import LEASE_KEY
from rollout_client.runner.sources import holds, lose, producer_of, sending

LEASED = Task("t", "p", meta={LEASE_KEY: "task:d:0:1:2.abc"})


class Leasing:
    def __init__(self, held: bool) -> None:
        self.held = held
        self.lost: list[Task] = []
        self.producer_id = "leaser"

    def holds(self, task: Task) -> bool:
        return self.held

    def lose(self, task: Task) -> None:
        self.lost.append(task)


def test_a_plain_source_holds_sends_and_names_the_runner() -> None:
    plain: Any = object()
    assert holds(plain, LEASED) and sending(plain, LEASED)
    assert producer_of(plain, LEASED, "runner") == "runner"
    lose(plain, LEASED)  # nothing to tell


def test_a_leasing_source_is_asked() -> None:
    source = Leasing(held=False)
    assert not holds(source, LEASED) and not sending(source, LEASED), "sending follows holds without its own hook"
    lose(source, LEASED)
    assert source.lost == [LEASED]
    assert producer_of(source, Task("t", "p"), "runner") == "runner", "a task not leased names the runner"
    assert producer_of(source, LEASED, "runner") == "leaser", "a leased task names its lease's producer"
