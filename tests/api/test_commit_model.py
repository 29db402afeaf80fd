"""The commit protocol under any sequence of a trainer's moves (hypothesis): groups arrive, the loader fetches
ahead, the trainer trains and checkpoints (then commits), and crashes anywhere, even between its checkpoint and
the commit, resuming from its checkpoint. Whatever the sequence, the groups trained into checkpoints are
exactly the groups acknowledged: none lost, none twice. In process, on the memory store."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.config.settings import Settings
from api.wire.records import decode_batch
from tests.factories import env, group, registration
from trainer_client.arrays import from_records

MOVES = ["produce", "produce", "fetch", "fetch", "train", "checkpoint", "checkpoint_then_crash", "crash"]


@dataclass
class Trainer:
    """What the trainer keeps: a checkpoint (durable), and what a crash loses."""

    checkpoint_step: int = 0
    checkpointed: list[str] = field(default_factory=list)
    trained_step: int = 0
    trained: list[str] = field(default_factory=list)
    loaded: deque[tuple[int, list[str]]] = field(default_factory=deque)
    fetch_step: int = 0

    def crash(self) -> None:
        self.trained, self.loaded = [], deque()
        self.trained_step = self.fetch_step = self.checkpoint_step


async def fetch(c: httpx.AsyncClient, t: Trainer) -> str:
    """ "got" a batch, "full" (the read-ahead bound) or "none" queued."""
    reply = await c.get("/batch", params={"step": t.fetch_step}, headers={"Accept": "application/msgpack"})
    if reply.status_code == 503:
        assert reply.json()["code"] == "read_ahead_full"
        return "full"
    assert reply.status_code == 200, reply.text
    if reply.headers["content-type"] != "application/msgpack":
        return "none"
    batch = from_records(decode_batch(reply.content), t.fetch_step)
    t.loaded.append((t.fetch_step, [g or "" for g in batch.group_ids]))
    t.fetch_step += 1
    return "got"


def train(t: Trainer) -> bool:
    if not t.loaded:
        return False
    step, ids = t.loaded.popleft()
    assert step == t.trained_step
    t.trained += ids
    t.trained_step += 1
    return True


async def checkpoint(c: httpx.AsyncClient, t: Trainer, *, commit: bool = True) -> None:
    t.checkpoint_step, t.checkpointed, t.trained = t.trained_step, t.checkpointed + t.trained, []
    if commit:
        assert (await c.post("/commit", json={"step": t.checkpoint_step})).status_code == 200


async def play(moves: list[str], read_ahead: int) -> None:
    app = create_app(Settings(store="memory://", max_read_ahead_batches=read_ahead))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=4, acknowledge="commit"))
            await c.get("/batch", params={"step": 0})
            await c.post("/register-env", json=env(group_size=2))
            acknowledged: list[str] = []
            t = Trainer()
            for move in moves:
                if move == "produce":
                    gid = f"g{len(acknowledged)}"
                    reply = await c.post("/scored_data", json=group(2, seed=len(acknowledged), group_id=gid))
                    assert reply.status_code == 200
                    acknowledged.append(gid)
                elif move == "fetch":
                    await fetch(c, t)
                elif move == "train":
                    train(t)
                elif move == "checkpoint":
                    await checkpoint(c, t)
                elif move == "checkpoint_then_crash":
                    await checkpoint(c, t, commit=False)
                    t.crash()
                else:
                    t.crash()
            if len(acknowledged) % 2:  # batches are two groups: make the last one whole
                await c.post("/scored_data", json=group(2, seed=10_000, group_id="last"))
                acknowledged.append("last")
            while True:  # the run goes on to the end
                if train(t):
                    continue
                got = await fetch(c, t)
                if got == "full":
                    await checkpoint(c, t)
                elif got == "none":
                    break
            await checkpoint(c, t)
    assert len(t.checkpointed) == len(set(t.checkpointed)), "a group trained twice"
    assert sorted(t.checkpointed) == sorted(acknowledged), "an acknowledged group was lost"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(MOVES), max_size=60), st.integers(1, 4))
def test_the_groups_trained_are_the_groups_acknowledged(moves: list[str], read_ahead: int) -> None:
    asyncio.run(play(moves, read_ahead))
