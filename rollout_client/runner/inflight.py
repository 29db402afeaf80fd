"""The groups a runner has in flight and the rollout slots they hold.

Slots count rollouts, not groups. A group takes its G slots together when it starts (its rollouts start
together) and gives each back as that rollout ends: a long-tail rollout holds its own slot, not its
group's. Whatever it still holds when its rollouts are over goes back before its submit. A group run again
(a retry) takes back the slots its rollouts gave up, waiting for them like a new group. A group is
cancelled at most once, and counted once under the reason it was cancelled for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollout_client.runner.stats import RunnerStats

log = logging.getLogger("rollout_client.runner")


@dataclass(eq=False)
class Group:
    task: asyncio.Task[None]
    env: int
    size: int
    policy_step: int
    submitting: bool = False
    held: int = 0
    """Slots it holds now: its rollouts still running (or about to run)."""
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
        self._freed = asyncio.Event()

    def __iter__(self) -> Iterator[Group]:
        """A snapshot: groups may end while the caller goes through it."""
        return iter(list(self.groups.values()))

    def pending(self) -> Iterator[tuple[int, int]]:
        """(env, sequences) of every group in flight: what the server has not seen yet."""
        return ((g.env, g.size) for g in self.groups.values())

    def add(self, group_id: str, group: Group, *, dispatched: bool = True) -> None:
        """`dispatched=False`: work that is not a group of this runner's (a sibling's slot): not counted."""
        if dispatched:
            self.stats.dispatched += 1
        self.groups[group_id] = group
        self._take(group, group.size)

    def _take(self, g: Group, n: int) -> None:
        g.held += n
        self.free -= n
        self.stats.in_flight += n
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)

    def _give(self, g: Group, n: int) -> bool:
        n = min(n, g.held)
        if n <= 0:
            return False
        g.held -= n
        self.free += n
        self.stats.in_flight -= n
        self._freed.set()
        return True

    def ended(self, group_id: str) -> bool:
        """One rollout of the group ended: give back its slot. True if a slot was given back."""
        g = self.groups.get(group_id)
        return g is not None and self._give(g, 1)

    def release(self, group_id: str) -> bool:
        """Give back every slot the group still holds: True if this call gave any back."""
        g = self.groups.get(group_id)
        return g is not None and self._give(g, g.held)

    async def refill(self, group_id: str) -> None:
        """Take back the slots a group's rollouts gave up, for it to run again: waits until they are free."""
        g = self.groups.get(group_id)
        if g is None:
            return
        while self.free < g.size - g.held:  # all at once: groups holding part each, waiting, would deadlock
            self._freed.clear()
            await self._freed.wait()
        self._take(g, g.size - g.held)

    def remove(self, group_id: str) -> None:
        self.release(group_id)
        self.groups.pop(group_id, None)

    def cancel(self, g: Group, reason: str) -> None:
        if not g.cancelled:
            g.cancelled = True
            g.task.cancel()
            self.stats.skipped[reason] += 1

    def drop(self, g: Group, reason: str) -> None:
        """The group drops itself for `reason` (its own task, which must not cancel itself): counted once, as a
        cancellation would be."""
        if not g.cancelled:
            g.cancelled = True
            self.stats.skipped[reason] += 1

    def hold_deadlines(self, now: float) -> None:
        """A pause stops the groups' deadlines (a weight sync is not the groups' time); `now` is the loop's."""
        for g in self:
            if g.deadline is not None and (when := g.deadline.when()) is not None:
                g.remaining = max(0.0, when - now)
                g.deadline.reschedule(None)

    def release_deadlines(self, now: float) -> None:
        """After a pause: each held deadline runs again with the time it had left."""
        for g in self:
            if g.deadline is not None and g.remaining is not None:
                g.deadline.reschedule(now + g.remaining)
                g.remaining = None

    def cancel_holders(self, holders: set[asyncio.Task[Any]], reason: str) -> None:
        """Cancel the groups whose tasks are among `holders` (those still at a gate that would not close)."""
        for g in self:
            if g.task in holders:
                self.cancel(g, reason)

    async def stop(self, submits_by: float, abandon_by: float) -> None:
        """Shut down what is in flight: cancel groups still generating (their data is not needed), let
        submits in progress finish until `submits_by`, cancel what is left, and past `abandon_by` (loop time)
        abandon, logged, the groups that ignored their cancellation (user cleanup that hangs)."""
        loop = asyncio.get_running_loop()
        for g in self:
            if not g.submitting:
                self.cancel(g, "stopped")
        await self.wait(max(0.0, submits_by - loop.time()))
        for g in self:
            self.cancel(g, "unsent")
        await self.wait(max(0.0, abandon_by - loop.time()))
        for g in self:
            log.warning("group %s did not end within the shutdown timeout: abandoned", g.task.get_name())

    async def wait(self, timeout: float | None) -> None:
        """Until every group now in flight has ended, or `timeout` s."""
        tasks = [g.task for g in self.groups.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
