"""One group: acquire G per-rollout resources all-or-nothing, run G rollouts of one task together, score
them and assemble the wire group. Runs the same in the runner's process and in a worker process."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from typing import Any

from api.schema import ScoredData
from rollout_client.env import Environment, Gate, Session, Task
from rollout_client.errors import EpisodeTruncated, PromptTooLong, RolloutTimeout
from rollout_client.policy import Policy

log = logging.getLogger("rollout_client.group")

PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A finished group (`group` set) or a skipped one (`skipped` names why)."""

    group: ScoredData | None
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds a group's rollouts, the same in the runner's process and in workers."""

    token_limit: int | None = None
    turn_timeout: float | None = None
    rollout_timeout: float | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"token_limit": self.token_limit, "turn_timeout": self.turn_timeout,
                "rollout_timeout": self.rollout_timeout}  # fmt: skip


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The first real error in a task group's failure (not a cancellation it caused), with the others
    attached to it as notes; None if there are only cancellations."""
    flat: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                walk(e)
        elif not isinstance(exc, asyncio.CancelledError):
            flat.append(exc)

    walk(group)
    if not flat:
        return None
    for other in flat[1:]:
        flat[0].add_note(f"also, in another rollout of the group: {type(other).__name__}: {other}")
    return flat[0]


async def release(stack: AsyncExitStack, error: BaseException) -> None:
    """Exit `stack` after `error`, which stays the error: whatever the exits raise is attached to it as notes
    (a sandbox that fails to close must not hide why the group failed)."""
    try:
        await stack.aclose()
    except BaseException as close_error:
        chain: list[BaseException] = []
        e: BaseException | None = close_error
        while e is not None and e is not error and e not in chain:
            chain.append(e)
            e = e.__context__
        for c in reversed(chain):
            error.add_note(f"while releasing resources after this error: {type(c).__name__}: {c}")
        log.warning("releasing resources after %s: %s: %s", type(error).__name__, type(close_error).__name__,
                    close_error)  # fmt: skip


async def acquire_all(cms: Sequence[AbstractAsyncContextManager[Any]]) -> tuple[list[Any], AsyncExitStack]:
    """Enter every context manager concurrently; all succeed or none is held.

    On a failure the others are cancelled, whatever was entered is exited, and the first real error (not a
    cancellation it caused) is raised, with any error from the exits attached as notes. On success the
    returned stack exits them all.
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
    except BaseExceptionGroup as group:
        real = first_error(group)
        await release(stack, real or group)
        if real is not None:
            raise real from None
        raise
    except BaseException as exc:
        await release(stack, exc)
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
    turn_timeout: float | None = None,
    rollout_timeout: float | None = None,
) -> GroupOutcome:
    """G rollouts of `task`, run together, each with its own session and resource; then scored.

    A rollout that raises fails the group: the first real error is raised (the others as notes), after the
    resources are released. `turn_timeout` bounds each generation request (TurnTimeout), `rollout_timeout`
    each rollout, time paused at the gate excluded (RolloutTimeout). An episode that reaches `token_limit`
    after its first turn ends there and is kept, marked truncated.
    """
    gate = gate or Gate()
    owner = asyncio.current_task()
    resources, stack = await acquire_all([env.resource(task) for _ in range(env.group_size)])
    try:
        sessions = [
            Session(policy, gate=gate, token_limit=token_limit, max_tokens=env.max_tokens,
                    seed=rollout_seed(group_key, i), resource=res, turn_timeout=turn_timeout, owner=owner)
            for i, res in enumerate(resources)
        ]  # fmt: skip
        elapsed = [0.0] * len(sessions)

        async def one(i: int, session: Session) -> None:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(rollout_timeout) as deadline:
                    session.deadline = deadline
                    await env.rollout(task, session)
            except EpisodeTruncated:
                pass  # kept as it is, marked truncated
            except TimeoutError:
                if deadline.expired():
                    raise RolloutTimeout(f"rollout took more than rollout_timeout={rollout_timeout} s") from None
                raise
            finally:
                session.deadline = None
                elapsed[i] = time.perf_counter() - t0

        try:
            async with asyncio.TaskGroup() as tg:
                for i, s in enumerate(sessions):
                    tg.create_task(one(i, s))
        except BaseExceptionGroup as group:
            real = first_error(group)
            if isinstance(real, PromptTooLong):  # the same prompt for all G: one too long means the whole group
                await stack.aclose()
                return GroupOutcome(None, PROMPT_TOO_LONG)
            if real is None:
                raise
            raise real from None
        t0 = time.perf_counter()
        scores = [float(env.score(task, s)) for s in sessions]  # resources still held: a verifier may need them
        score_s = (time.perf_counter() - t0) / len(sessions)
    except BaseException as exc:
        await release(stack, exc)
        raise
    await stack.aclose()
    return GroupOutcome(build_group(task, sessions, scores, elapsed, score_s))


def build_group(
    task: Task, sessions: Sequence[Session], scores: Sequence[float], elapsed: Sequence[float], score_s: float
) -> ScoredData:
    """The wire group: tokens, masks (-100 where not generated), inference logprobs, scores, and per-rollout
    record in `overrides`: `turns` (prompt/completion tokens, gate wait and generation seconds per turn),
    `num_turns`, `truncated`, `finish_reason`, `tools` (calls, failures, seconds per tool), timings."""
    return ScoredData(
        tokens=[s.tokens for s in sessions],
        masks=[s.masks for s in sessions],
        scores=list(scores),
        inference_logprobs=[s.logprobs for s in sessions],
        overrides=[
            {
                "rollout_s": round(t, 6),
                "score_s": round(score_s, 6),
                "turns": s.turns,
                "num_turns": len(s.turns),
                "truncated": s.truncated,
                "finish_reason": s.finish_reason,
                "tools": s.tools,
            }
            for s, t in zip(sessions, elapsed, strict=True)
        ],
        group_overrides={"task_id": task.id},
    )
