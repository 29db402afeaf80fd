"""An environment and the runner that produces from it (docs/rollout-client.md, "Writing an environment")."""

import asyncio
import os
from functools import partial

from rollout_client import Environment, OpenAIPolicy, RolloutRunner, Session, Task, Tasks

ROLLBUF_URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")
INFERENCE_URL = os.environ.get("INFERENCE_URL", "http://127.0.0.1:8001")  # OpenAI-compatible (vLLM)
MODEL = os.environ.get("MODEL", "my-model")


class Sums(Environment):
    name = "sums"
    group_size = 4  # G: rollouts per task
    weight = 1.0  # share of batches relative to other envs
    max_tokens = 32  # per generate(), clipped to the token budget

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)  # not trained on: masks -100
        await session.generate()  # trained on: masks = token ids, logprobs from the policy

    def score(self, task: Task, session: Session) -> float:
        return float(session.last_text.strip() == task.answer)


def sum_task(i: int) -> Task:  # the i-th task of an endless stream (Tasks also takes a list)
    a, b = i % 10, i // 10 % 10
    return Task(id=f"{a}+{b}", prompt=f"{a} + {b} =", answer=str(a + b))


async def main() -> None:
    runner = RolloutRunner(
        ROLLBUF_URL,
        [(Sums(), Tasks(sum_task))],
        partial(OpenAIPolicy, INFERENCE_URL, MODEL),  # a Policy, or a factory (workers need one)
        max_in_flight=16,  # rollouts running at once, over all envs
        num_workers=2,  # 0: everything on this event loop
        max_staleness=2,  # hold back / cancel what would arrive more than 2 steps stale
    )
    stats = await runner.run(max_groups=int(os.environ.get("MAX_GROUPS", "0")) or None)  # None: until stopped
    print(f"{stats.accepted} groups accepted, {stats.failed_total} failed")


if __name__ == "__main__":  # workers start with spawn, which imports this file again
    asyncio.run(main())
