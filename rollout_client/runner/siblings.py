"""A runner's sibling slots (docs/rollouts.md, "Missing siblings"): the missing slots of other producers'
per-rollout groups, leased once their producer stopped heartbeating, each rolled out with the group's task and
posted, within the runner's free rollout slots (a group begun elsewhere is finished before new groups start)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from api.wire.rollouts import ENVS_MAX, SlotPrefix
from rollout_client.episodes import ReplayDiverged, RestoreFailed, resume_mode
from rollout_client.errors import failure_reason
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.per_rollout import Holds, Poster, task_from_wire
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.turns import prefix_of

if TYPE_CHECKING:
    from rollout_client.env import Environment, Task
    from rollout_client.group import Rollout
    from rollout_client.runner.execution import GroupExecutor

log = logging.getLogger("rollout_client.runner")


@dataclass
class SiblingSlots:
    """`run()` leases sibling slots while `may_take()` and rollout slots are free, until cancelled; each slot runs
    as its own entry in `in_flight` (`group_id#slot`), so the runner's bound, pause, staleness and shutdown apply
    to it as to its own rollouts.

    It asks only when the server says slots may be there: each producer heartbeat's reply says when a group of
    its envs is next due (`heard`: its holder lapses, or a sibling's lease of a slot ends). From then until a
    later reply moves it, it asks every `poll_s`, as it does when the server has said nothing (a server that
    does not say); before then it asks nothing. So an idle producer among idle ones costs its heartbeat alone, and
    a slot whose holder stopped is still taken within `poll_s` of its lapse once a heartbeat named the time."""

    groups: OpenGroups
    envs: Sequence[Environment]
    executor: GroupExecutor
    in_flight: InFlight
    stats: RunnerStats
    _: KW_ONLY
    poll_s: float
    may_take: Callable[[], bool]
    policy_step: Callable[[], int]
    """The weights' step a slot taken now is generated with."""
    rollout_ended: Callable[[str], None]
    changed: Callable[[], None]
    holds: Holds = field(default_factory=Holds)
    """The groups it works on, heartbeated while any of their slots runs here."""
    due: float | None = None
    """When (monotonic) slots may next be leased, as the last heartbeat's reply said; None: unknown, ask."""
    clock: Callable[[], float] = time.monotonic

    def heard(self, due_in: float | None) -> None:
        """A heartbeat's reply said slots may be leased in `due_in` s (None: it does not say)."""
        self.due = None if due_in is None else self.clock() + due_in

    def asking(self) -> bool:
        """Whether to ask for slots now: rollout slots free, taking allowed, and slots may be there."""
        return self.in_flight.free > 0 and self.may_take() and (self.due is None or self.clock() >= self.due)

    @property
    def names(self) -> list[str]:
        """The envs whose slots it takes: those of the runner's envs that post each rollout."""
        return sorted({e.name for e in self.envs if e.posts_each_rollout})

    @property
    def asked_for(self) -> list[str] | None:
        """The env names a request may name (at most ENVS_MAX), or None: any env's (those of others lapse)."""
        names = self.names
        return names if len(names) <= ENVS_MAX else None

    def env_of(self, name: str) -> int | None:
        """The index of the runner's env named `name` that posts each rollout."""
        return next((i for i, e in enumerate(self.envs) if e.posts_each_rollout and e.name == name), None)

    async def run(self) -> None:
        while True:
            if self.asking():
                free = self.in_flight.free
                try:
                    leases = await self.groups.lease(free, self.asked_for)
                except Exception as exc:  # the next poll tries again
                    log.warning("taking sibling slots failed: %s", exc)
                    leases = []
                for lease in leases:
                    wire = task_from_wire(lease.task)
                    i = None if wire is None else self.env_of(wire[0])
                    if wire is None or i is None:  # a task it cannot read (opened by another client): it lapses
                        self.groups.let_go(lease.group_id)
                        continue
                    self.holds.take(lease.group_id)
                    key = f"{lease.group_id}#{lease.slot}"
                    step = self.policy_step()
                    one = self._one(i, wire[1], lease.group_id, lease.slot, key, step, lease.prefix)
                    handle = asyncio.create_task(one, name=key)
                    self.in_flight.add(key, Group(handle, i, 1, step), dispatched=False)
            await asyncio.sleep(self.poll_s)

    async def _one(
        self, i: int, task: Task, group_id: str, slot: int, key: str, step: int, given: SlotPrefix | None = None
    ) -> None:
        """Roll out and post one slot, continuing from its acknowledged turns when its env resumes
        (docs/episodes.md); a failure lets the slot lapse, to be leased again."""
        try:
            rollout = await self._resumed(i, task, group_id, slot, given)
            self.rollout_ended(key)
            await Poster(self.groups, group_id, self.stats, step)(slot, rollout)
            self.stats.sibling_rollouts += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the run goes on
            self.stats.rollouts_failed[self.envs[i].name][failure_reason(exc)] += 1
            log.warning("slot %d of group %s (a sibling's) failed: %s: %s", slot, group_id, type(exc).__name__, exc)
        finally:
            if self.holds.give(group_id) and group_id not in self.in_flight.groups:  # not one of its own
                self.groups.let_go(group_id)
            self.in_flight.remove(key)
            self.changed()

    async def _resumed(self, i: int, task: Task, group_id: str, slot: int, given: SlotPrefix | None) -> Rollout:
        """The slot's rollout: continued from its prefix as its env declares (`resume_mode`), or from the prompt;
        a resume that cannot go on (the env's tools did not replay the same, `restore` failed) restarts."""
        env = self.envs[i]
        prefix = None
        if given is not None and given.turns and env.resumes != "restart":
            try:
                prefix = await prefix_of(self.groups, group_id, slot, given)
            except Exception as exc:  # the server's turns could not be read: from the prompt
                log.warning("turns of slot %d of group %s not read: %s", slot, group_id, exc)
        weights = self.executor.gate.weights
        mode = resume_mode(env.resumes, env.on_new_weights, prefix, weights)
        if mode != "restart" and prefix is not None:
            try:
                rollout = await self.executor.run_slot(i, task, group_id, slot, prefix=prefix, mode=mode)
            except (ReplayDiverged, RestoreFailed) as exc:
                log.warning("slot %d of group %s restarts from the prompt: %s", slot, group_id, exc)
            else:
                self.stats.slots_resumed += 1
                self.stats.tokens_resumed += rollout.resumed_tokens
                return rollout
        if given is not None and given.turns:
            self.stats.slots_restarted += 1
        return await self.executor.run_slot(i, task, group_id, slot)
