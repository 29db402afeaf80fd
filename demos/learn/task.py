"""The toy task: reverse a few digits. The reward is the fraction of positions right, so partial answers
are rewarded and the signal is dense; a random policy scores 1/12 per position (12 symbols)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rollout_client import Environment, Session, Task

PROMPT_END = ">"


def reverse_task(i: int, *, digits: int = 4, seed: int = 0) -> Task:
    """Task `i` of the run seeded `seed`: `digits` random digits, then `>`; the answer is them reversed."""
    rng = random.Random(f"{seed}/{i}")
    shown = "".join(rng.choice("0123456789") for _ in range(digits))
    return Task(id=f"reverse-{seed}-{i}", prompt=shown + PROMPT_END, answer=shown[::-1])


def fraction_right(answer: str, completion: str) -> float:
    return sum(a == b for a, b in zip(answer, completion, strict=False)) / len(answer)


@dataclass
class Reverse(Environment):
    """One turn: the digits and `>` (not trained on), then exactly `digits` sampled tokens (trained on)."""

    name: str = "reverse"
    group_size: int = 8
    weight: float = 1.0
    digits: int = 4

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        await session.generate(self.digits)

    def score(self, task: Task, session: Session) -> float:
        return fraction_right(str(task.answer), session.last_text)
