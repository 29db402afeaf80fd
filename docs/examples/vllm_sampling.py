"""Sampling from a model served by vLLM or SGLang (docs/training.md, "A real model"): `OpenAIPolicy` asks for token
ids and logprobs, so the trainer sees exactly the tokens sampled and their logprobs. The environment is
docs/examples/sums.py, beside this file. Serve the model first: `vllm serve Qwen/Qwen2.5-1.5B-Instruct --port 8001`."""

import asyncio
import os
from functools import partial

from sums import Sums, sum_task

from rollout_client import OpenAIPolicy, RolloutRunner, Tasks

ROLLBUF_URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")
INFERENCE_URL = os.environ.get("INFERENCE_URL", "http://127.0.0.1:8001")
MODEL = os.environ.get("MODEL", "Qwen/Qwen2.5-1.5B-Instruct")


async def main() -> None:
    # A factory, not an OpenAIPolicy: each worker process builds its own (a policy holds connections; it does not
    # pickle, and a runner with workers given one fails as it starts).
    policy = partial(OpenAIPolicy, INFERENCE_URL, MODEL, temperature=1.0)
    runner = RolloutRunner(
        ROLLBUF_URL, [(Sums(), Tasks(sum_task))], policy, max_in_flight=256, num_workers=2, max_staleness=1
    )
    stats = await runner.run(max_groups=int(os.environ.get("MAX_GROUPS", "0")) or None)  # None: until stopped
    print(f"{stats.accepted} groups accepted, {stats.failed_total} failed")


if __name__ == "__main__":  # workers start with spawn, which imports this file again
    asyncio.run(main())
