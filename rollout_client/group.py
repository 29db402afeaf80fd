"""One group: acquire G per-rollout resources all-or-nothing, run G rollouts of one task together, score
them and assemble the wire group. Runs the same in the runner's process and in a worker process."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Any

from api.schema import ScoredData
from rollout_client.env import Environment, Gate, Session, Task
from rollout_client.errors import PromptTooLong
from rollout_client.policy import Policy

PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A finished group (`group` set) or a skipped one (`skipped` names why)."""

    group: ScoredData | None
    skipped: str | None = None


async def acquire_all(cms: Sequence[AbstractAsyncContextManager[Any]]) -> tuple[list[Any], AsyncExitStack]:
    """Enter every context manager concurrently; all succeed or none is held.

    On a failure the others are cancelled, whatever was entered is exited, and the first real error (not a
    cancellation it caused) is raised. On success the returned stack exits them all.
    """
    entered: dict[int, Any] = {}
    stack = AsyncExitStack()

    async def enter(i: int, cm: AbstractAsyncContextManager[Any]) -> None:
        value = await cm.__aenter__()
        entered[i] = value  # no await between entering and recording: a cancellation cannot lose it
        stack.push_async_exit(cm)

    try:
        async with asyncio.TaskGroup() as tg:
            for i, cm in enumerate(cms):
                tg.create_task(enter(i, cm))
    except BaseException as exc:
        await stack.aclose()
        if isinstance(exc, BaseExceptionGroup):
            real = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
            if real:
                raise real[0] from None
        raise
    return [entered[i] for i in range(len(cms))], stack


def rollout_seed(group_key: str, index: int) -> int:
    """A per-rollout seed, stable across processes: rollouts of a group differ, reruns repeat."""
    return int.from_bytes(hashlib.blake2b(f"{group_key}/{index}".encode(), digest_size=4).digest(), "little")


async def run_group(
    env: Environment,
    task: Task,
    policy: Policy,
    *,
    gate: Gate | None = None,
    token_limit: int | None = None,
    group_key: str = "",
) -> GroupOutcome:
    """G rollouts of `task`, run together, each with its own session and resource; then scored."""
    gate = gate or Gate()
    resources, stack = await acquire_all([env.resource(task) for _ in range(env.group_size)])
    sessions = [
        Session(policy, gate=gate, token_limit=token_limit, max_tokens=env.max_tokens,
                seed=rollout_seed(group_key, i), resource=res)
        for i, res in enumerate(resources)
    ]  # fmt: skip
    elapsed = [0.0] * len(sessions)

    async def one(i: int, session: Session) -> None:
        t0 = time.perf_counter()
        await env.rollout(task, session)
        elapsed[i] = time.perf_counter() - t0

    too_long = False
    async with stack:
        try:
            async with asyncio.TaskGroup() as tg:
                for i, s in enumerate(sessions):
                    tg.create_task(one(i, s))
        except* PromptTooLong:
            too_long = True  # the same prompt for all G: one too long means the whole group is
        if too_long:
            return GroupOutcome(None, PROMPT_TOO_LONG)
        t0 = time.perf_counter()
        scores = [float(env.score(task, s)) for s in sessions]  # resources still held: a verifier may need them
        score_s = (time.perf_counter() - t0) / len(sessions)
    return GroupOutcome(build_group(task, sessions, scores, elapsed, score_s))


def build_group(
    task: Task, sessions: Sequence[Session], scores: Sequence[float], elapsed: Sequence[float], score_s: float
) -> ScoredData:
    """The wire group: tokens, masks (-100 where not generated), inference logprobs, scores, and per-rollout
    timings in `overrides` (`turns`: prompt/completion tokens, gate wait and generation seconds per turn)."""
    return ScoredData(
        tokens=[s.tokens for s in sessions],
        masks=[s.masks for s in sessions],
        scores=list(scores),
        inference_logprobs=[s.logprobs for s in sessions],
        overrides=[
            {"rollout_s": round(t, 6), "score_s": round(score_s, 6), "turns": s.turns}
            for s, t in zip(sessions, elapsed, strict=True)
        ],
        group_overrides={"task_id": task.id},
    )
