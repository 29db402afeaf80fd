"""What the runner asks of a task source about one task, for the sources that can say (a leasing source:
`rollout_client.leases.tasks`): whether its lease is still this producer's, whether its group may be sent, which
producer the group names, and that its lease was lost. A source without the hook answers as a plain one would."""

from __future__ import annotations

from typing import Any

from rollout_client.env import Task
from rollout_client.leases.tasks import lease_token


def holds(source: Any, task: Task) -> bool:
    """Whether `task`'s lease is still this producer's (always, for a source that does not lease)."""
    hook = getattr(source, "holds", None)
    return hook is None or bool(hook(task))


def sending(source: Any, task: Task) -> bool:
    """Whether `task`'s group may be sent: its lease is still this producer's (the source, told so, leaves the
    lease's fate to the server's reply from now on)."""
    hook = getattr(source, "sending", None)
    return holds(source, task) if hook is None else bool(hook(task))


def producer_of(source: Any, task: Task, runner: str) -> str:
    """The producer a group names: a leased task's, the producer its lease was taken for (the server binds the
    lease to it); any other, the runner's (`runner`)."""
    leased = getattr(source, "producer_id", None) if lease_token(task) is not None else None
    return leased if isinstance(leased, str) else runner


def lose(source: Any, task: Task) -> None:
    """The server refused `task`'s group under its lease: the source counts the lease lost."""
    hook = getattr(source, "lose", None)
    if hook is not None:
        hook(task)
