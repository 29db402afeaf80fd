"""The environment interface: an async `rollout(task, session)` that drives the policy, and a `score`;
or, for step-wise work, `EpisodeEnvironment` with an `Episode` (start / step with a done signal / score).

Single-turn: `await session.observe(task.prompt); await session.generate()`. Multi-turn: alternate
`observe` (tool output, user turns: not trained on) and `generate` (trained on) until done. The session
records tokens, masks, logprobs and per-turn timings; the runner turns G sessions into one group.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.schema import MASK_IGNORE
from rollout_client.policy import Completion, Policy

PROMPT_LOGPROB = 1.0
"""Logprob recorded at positions the policy did not sample (prompt, tool output), as Atropos handlers do."""


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt to roll out G times. Must pickle: it is sent to worker processes."""

    id: str
    prompt: str
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


class Gate:
    """Lets generation requests through while open; `close()` returns once none is in flight.

    The runner closes it for a weight update: after `await close()`, no request is at the inference server
    and none can start until `open()`.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0

    @asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def close(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()


class Session:
    """One rollout's transcript. Each rollout gets its own session: no state leaks between rollouts."""

    def __init__(
        self,
        policy: Policy,
        *,
        gate: Gate | None = None,
        token_limit: int | None = None,
        max_tokens: int = 256,
        seed: int | None = None,
        resource: Any = None,
    ) -> None:
        self.policy = policy
        self.gate = gate or Gate()
        self.token_limit = token_limit
        self.max_tokens = max_tokens
        self.seed = seed
        self.resource = resource
        """What the environment's `resource(task)` context manager yielded for this rollout (a sandbox, ...)."""
        self.state: dict[str, Any] = {}
        """Anything the environment keeps for this rollout alone (an episode, a sandbox handle)."""
        self.tokens: list[int] = []
        self.masks: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[dict[str, float | int]] = []
        self.completions: list[Completion] = []

    async def observe(self, text: str) -> list[int]:
        """Append text the policy did not write (prompt, tool output): tokenised by the policy, not trained on."""
        ids = await self.policy.tokenize(text)
        self.observe_ids(ids)
        return ids

    def observe_ids(self, ids: list[int]) -> None:
        self.tokens.extend(ids)
        self.masks.extend([MASK_IGNORE] * len(ids))
        self.logprobs.extend([PROMPT_LOGPROB] * len(ids))

    async def generate(self, max_tokens: int | None = None) -> Completion:
        """Let the policy continue the transcript; its tokens are trained on. Waits while the runner is paused.

        Raises PromptTooLong when the transcript already fills the token budget.
        """
        queued = time.perf_counter()
        async with self.gate.generation():
            started = time.perf_counter()
            seed = None if self.seed is None else self.seed + len(self.turns)
            out = await self.policy.generate(
                list(self.tokens), max_tokens=max_tokens or self.max_tokens, token_limit=self.token_limit, seed=seed
            )
        self.turns.append({
            "prompt_tokens": len(self.tokens),
            "completion_tokens": len(out.token_ids),
            "wait_s": round(started - queued, 6),
            "generate_s": round(time.perf_counter() - started, 6),
        })  # fmt: skip
        self.tokens.extend(out.token_ids)
        self.masks.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.completions.append(out)
        return out

    @property
    def last_text(self) -> str:
        return self.completions[-1].text if self.completions else ""


class Environment(ABC):
    """Subclass and set the class attributes; instances must pickle (they are sent to worker processes)."""

    name: str = "env"
    group_size: int = 4
    """G: rollouts per task (one group)."""
    weight: float = 1.0
    """Share of batches relative to other environments."""
    max_tokens: int = 256
    """Default completion length per `generate` (clipped to the token budget)."""
    min_batch_allocation: float | None = None

    def resource(self, task: Task) -> AbstractAsyncContextManager[Any]:
        """Per-rollout resources (a sandbox, a browser): entered before the rollout, exited after. The G
        rollouts of a group acquire theirs all-or-nothing."""
        return nullcontext()

    @abstractmethod
    async def rollout(self, task: Task, session: Session) -> None:
        """Drive the policy through `session` until the episode is done."""

    @abstractmethod
    def score(self, task: Task, session: Session) -> float:
        """The rollout's reward. May be CPU-heavy: with worker processes it runs there, off the main loop."""


class Episode(Protocol):
    """One rollout's world, for environments that are easiest to write step by step."""

    def start(self) -> str:
        """The first observation (the prompt)."""
        ...

    def step(self, completion: str) -> tuple[str | None, bool]:
        """React to the policy's completion: the next observation (None for nothing to add) and whether
        the episode is done."""
        ...

    def score(self) -> float: ...


class EpisodeEnvironment(Environment):
    """An environment written as `episode(task) -> Episode`: a fresh episode per rollout (its state is that
    rollout's alone), stepped until done or `max_turns` completions."""

    max_turns: int = 8

    @abstractmethod
    def episode(self, task: Task) -> Episode: ...

    async def rollout(self, task: Task, session: Session) -> None:
        episode = session.state["episode"] = self.episode(task)
        await session.observe(episode.start())
        for _ in range(self.max_turns):
            out = await session.generate()
            observation, done = episode.step(out.text)
            if done:
                return
            if observation:
                await session.observe(observation)

    def score(self, task: Task, session: Session) -> float:
        episode: Episode = session.state["episode"]
        return episode.score()
