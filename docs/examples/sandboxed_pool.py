"""Each rollout holds a sandbox from a capped pool (docs/rollout-client-pools.md, "Pool capacity and admission")."""

import asyncio
import os
from contextlib import asynccontextmanager

import httpx

from rollout_client import Environment, ResourceExhausted, RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import arithmetic_script, arithmetic_task

ROLLBUF_URL = os.environ.get("ROLLBUF_URL", "http://127.0.0.1:8000")
SANDBOX_URL = os.environ.get("SANDBOX_URL", "http://127.0.0.1:9001/sandbox")


class Sandboxed(Environment):
    name = "sandboxed"
    group_size = 8
    max_tokens = 16
    max_resources = 8  # the sandbox server's capacity

    @asynccontextmanager
    async def _client(self):
        self.http = httpx.AsyncClient(base_url=SANDBOX_URL)
        try:
            yield
        finally:
            await self.http.aclose()

    def worker_setup(self):  # once per worker process
        return self._client()

    @asynccontextmanager
    async def _sandbox(self):
        r = await self.http.post("/acquire")
        if r.status_code == 429:
            raise ResourceExhausted("sandboxes exhausted", retry_after=0.5)
        sandbox = r.json()["id"]
        try:
            yield sandbox  # session.resource in the rollout
        finally:
            await self.http.post("/release", json={"id": sandbox})

    def resource(self, task):
        return self._sandbox()

    async def rollout(self, task, session):  # session.resource is this rollout's sandbox
        await session.observe(task.prompt)
        await session.generate()

    def score(self, task, session):
        return 1.0 if f"A: {task.answer}" in session.last_text else 0.0


async def main() -> None:
    runner = RolloutRunner(
        ROLLBUF_URL,
        [(Sandboxed(), Tasks(arithmetic_task))],
        ScriptedPolicy(arithmetic_script),
        max_in_flight=16,
        num_workers=2,
    )
    stats = await runner.run(max_groups=int(os.environ.get("MAX_GROUPS", "0")) or None)
    print(f"{stats.accepted} groups accepted, {stats.failed_total} failed")


if __name__ == "__main__":  # workers start with spawn, which imports this file again
    asyncio.run(main())
