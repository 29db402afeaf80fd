"""The views with many envs: /status, /metrics and /dashboard/data times and sizes with 10,000 envs registered
(each with one group queued and a few batches formed), in process through the ASGI app on the memory store.

    python -m bench.many_envs [N_ENVS]
"""

from __future__ import annotations

import asyncio
import sys
import time

import httpx

from api.app import create_app
from api.config.settings import Settings


async def main(n: int) -> None:
    app = create_app(Settings(store="memory://"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await c.post(
                "/register",
                json={
                    "batch_size": 4,
                    "max_token_len": 4096,
                    "wandb_group": "g",
                    "wandb_project": "p",
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 1,
                    "starting_step": 0,
                    "num_steps": 1000,
                },
            )
            await c.get("/batch")
            for i in range(n):
                reply = await c.post(
                    "/register-env",
                    json={"max_token_length": 4096, "desired_name": f"e{i}", "weight": 1.0, "group_size": 4},
                )
                env_id = reply.json()["env_id"]
                if i % 10 == 0:
                    await c.post(
                        "/scored_data",
                        json={
                            "env_id": env_id,
                            "tokens": [[1] * 8] * 4,
                            "masks": [[1] * 8] * 4,
                            "scores": [0.0, 1.0, 0.0, 1.0],
                        },
                    )
            for _ in range(5):
                await c.get("/batch")
            await asyncio.sleep(1.1)  # the drop-bias monitor refreshes at most every second
            for path in ("/status", "/metrics", "/dashboard/data"):
                await c.get(path)  # warm
                times, cpu = [], []
                for _ in range(5):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    reply = await c.get(path)
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)  # this process's CPU: a loaded machine's wall is not
                print(
                    f"{n} envs: {path} median {sorted(times)[2] * 1000:.0f} ms "
                    f"({sorted(cpu)[2] * 1000:.0f} ms CPU), {len(reply.content) / 1e6:.2f} MB"
                )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000))
