"""A runner's registrations: register each environment, and register it again whenever the server has lost
its registration (a trainer's /reset_data and /register, a memory store restarted) while a submit or a
status read finds it gone. Counted by a generation per env, not by the env id: a new run may hand out the
same id again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from api.wire.schema import EnvRegistered, EnvStatus, Info, ScoredData, ScoredListReply, ScoredReply
from rollout_client.client import RolloutClient
from rollout_client.env import Environment
from rollout_client.errors import Rejected, RolloutClientError, registration_lost
from rollout_client.group import needed

log = logging.getLogger("rollout_client.runner")

T = TypeVar("T")

WAIT_LOG_S = 30.0
"""While an env waits to register (no trainer, or none has asked for its first batch), a log line this often."""
REREGISTER_TRIES = 3
"""Submits of one group (or status reads) that find its env's registration gone (and register it again)
before giving up."""


async def register(client: RolloutClient, env: Environment, wait_timeout: float | None) -> EnvRegistered:
    """Register `env` through `client`, waiting for the trainer up to `wait_timeout` s (None: forever). An
    env that keeps groups of survivors (`min_group_size` below `group_size`) registers `variable_group_size`:
    the server queues such a group whole instead of combining it with other prompts' groups."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    logged: float | None = None

    def waiting(reason: str) -> None:  # a producer never waits silently: at once, then every WAIT_LOG_S
        nonlocal logged
        now = loop.time()
        if logged is None or now - logged >= WAIT_LOG_S:
            logged = now
            log.warning("env %s: waiting to register (%.0f s so far): %s", env.name, now - started, reason)

    return await client.register(
        env.name,
        env.group_size,
        weight=env.weight,
        min_batch_allocation=env.min_batch_allocation,
        wait_timeout=wait_timeout,
        variable_group_size=env.variable_group_size or needed(env) < env.group_size,
        on_wait=waiting,
        max_token_staleness=env.max_token_staleness,
        reuse=env.reuse,
    )


class Registrations:
    """Status reads and submits that survive a lost registration. `on_registered(reg, info)` is called after
    each re-registration (the runner stamps the new run's step, reads the new batch size)."""

    def __init__(
        self,
        envs: Sequence[Environment],
        clients: list[RolloutClient],
        wait_timeout: float | None,
        on_registered: Callable[[EnvRegistered, Info], None],
    ) -> None:
        self.envs = envs
        self.clients = clients
        self.wait_timeout = wait_timeout
        self.on_registered = on_registered
        self.reregistered = 0
        """Times an env registered again."""
        self._locks = [asyncio.Lock() for _ in envs]
        self._generations = [0] * len(envs)

    async def status(self, i: int) -> EnvStatus:
        """Env `i`'s /status-env, registering it again first if the server lost its registration."""
        return await self._again(i, lambda: self.clients[i].status())

    async def submit(self, i: int, group: ScoredData) -> ScoredReply:
        """Submit, registering the env again (and submitting again, same group id) if its registration is gone."""
        return await self._again(i, lambda: self.clients[i].submit(group))

    async def submit_list(self, i: int, groups: Sequence[ScoredData]) -> ScoredListReply:
        """`submit` for several groups of env `i` in one /scored_data_list (all stored, or none). A 429/503 is
        not retried but raised (`Unavailable`): the groups may fit alone where the whole list does not."""
        return await self._again(i, lambda: self.clients[i].submit_list(groups, retry_unavailable=False))

    async def trainer_step(self, timeout: float) -> int | None:
        """The trainer's step now, read within `timeout` s (best effort: None if no env is registered yet or
        the read fails)."""
        registered = [c for c in self.clients if c.env_id is not None]
        if not registered:
            return None
        try:
            return (await asyncio.wait_for(registered[0].status(), timeout)).current_step
        except (TimeoutError, RolloutClientError) as exc:
            log.info("reading the trainer's step at pause: %s", exc)
            return None

    async def _again(self, i: int, call: Callable[[], Awaitable[T]]) -> T:
        for _ in range(REREGISTER_TRIES):
            lost = self._generations[i]
            try:
                return await call()
            except Rejected as exc:
                if not registration_lost(exc):
                    raise
                await self.reregister(i, lost)
        return await call()

    async def reregister(self, i: int, lost: int) -> None:
        """Register env `i` again, unless another group or the monitor did since generation `lost`. Waits for
        the trainer like the first registration."""
        client = self.clients[i]
        async with self._locks[i]:
            if self._generations[i] != lost:
                return
            env = self.envs[i]
            log.warning("env %s: the server no longer knows env_id %s: registering again", env.name, client.env_id)
            reg = await register(client, env, self.wait_timeout)
            self.reregistered += 1
            self._generations[i] += 1
            self.on_registered(reg, await client.info())
