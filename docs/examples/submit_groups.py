"""Register an environment, submit one scored group, read its status (docs/rollout-client.md, "RolloutClient")."""

import asyncio
import os

from api.wire.schema import ScoredData
from rollout_client import RolloutClient

ROLLBUF_URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")


async def main() -> None:
    async with RolloutClient(ROLLBUF_URL) as client:  # disconnects the env on exit
        await client.register("math", group_size=4, weight=1.0)  # waits while the trainer has not started
        group = ScoredData(
            tokens=[[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7]],  # prompt + completion, per rollout
            masks=[[-100, -100, 3, 4], [-100, -100, 3, 5], [-100, -100, 3, 6], [-100, -100, 3, 7]],  # -100: not trained
            scores=[1.0, 0.0, 0.0, 1.0],
        )
        reply = await client.submit(group)
        status = await client.status()  # GET /status-env
        print(reply.status, status.self_queue_size)  # "received 1": one group of this env queued


if __name__ == "__main__":
    asyncio.run(main())
