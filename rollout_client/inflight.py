"""The groups a runner has in flight and the rollout slots they hold.

A group takes its G slots together when it starts (its rollouts run together) and gives them back once,
when its rollouts end, before its submit: the next group can start generating while this one is sent. A
group is cancelled at most once, and counted once under the reason it was cancelled for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from rollout_client.stats import RunnerStats


@dataclass(eq=False)
class Group:
    task: asyncio.Task[None]
    env: int
    size: int
    policy_step: int
    submitting: bool = False
    released: bool = False
    cancelled: bool = False
    deadline: asyncio.Timeout | None = None
    """Its `group_timeout`, while it runs (a pause stops it)."""
    remaining: float | None = None
    """Seconds its deadline had left when a pause stopped it."""


class InFlight:
    """`free` rollout slots out of `slots`; keeps `stats.in_flight` (rollouts running now), `max_in_flight` and
    `dispatched` current, and counts cancellations in `stats.skipped`."""

    def __init__(self, slots: int, stats: RunnerStats) -> None:
        self.free = slots
        self.stats = stats
        self.groups: dict[str, Group] = {}

    def __iter__(self) -> Iterator[Group]:
        """A snapshot: groups may end while the caller goes through it."""
        return iter(list(self.groups.values()))

    def pending(self) -> Iterator[tuple[int, int]]:
        """(env, sequences) of every group in flight: what the server has not seen yet."""
        return ((g.env, g.size) for g in self.groups.values())

    def add(self, group_id: str, group: Group) -> None:
        self.free -= group.size
        self.stats.dispatched += 1
        self.stats.in_flight += group.size
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
        self.groups[group_id] = group

    def release(self, group_id: str) -> bool:
        """Give back a group's slots, once: True if this call gave them back."""
        g = self.groups.get(group_id)
        if g is None or g.released:
            return False
        g.released = True
        self.free += g.size
        self.stats.in_flight -= g.size
        return True

    def remove(self, group_id: str) -> None:
        self.release(group_id)
        self.groups.pop(group_id, None)

    def cancel(self, g: Group, reason: str) -> None:
        if not g.cancelled:
            g.cancelled = True
            g.task.cancel()
            self.stats.skipped[reason] += 1

    async def wait(self, timeout: float | None) -> None:
        """Until every group now in flight has ended, or `timeout` s."""
        tasks = [g.task for g in self.groups.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
