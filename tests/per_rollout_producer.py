"""A producer process for the per-rollout tests and bench (`python -m tests.per_rollout_producer`): a
`RolloutRunner` of one env that scores each rollout alone, G rollouts a group, each taking a while (its own
seeded delay), posting each rollout as it ends (or, with `--whole`, submitting whole groups), until killed or
SIGTERM. It hands out `--tasks` tasks, then waits (taking sibling slots) with nothing of its own in flight,
which it says by creating `--idle`.

It appends to `--events` what the checks need, one JSON line each, written after the fact, each with the time
(`"t"`, wall clock: the crash matrix reads them as a producer's record, crash/records.py):
`{"done": seed}` when a rollout ends (its seed names its group and slot), `{"ack": [group_id, slot, digest]}`
when the server acknowledged a posted rollout (`accepted`, or `duplicate`: a retry of one it holds),
`{"group": [group_id, [seeds]]}` when it stored a whole group."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from api.wire.rollouts import PostReply
from rollout_client import Environment, RolloutRunner, ScriptedPolicy, Session, Task, Timeouts
from rollout_client.examples import arithmetic_script, arithmetic_task
from rollout_client.group import rollout_seed
from rollout_client.leases.open_groups import OpenGroups

OUT: TextIO | None = None


EVENTS = "PER_ROLLOUT_PRODUCER_EVENTS"
"""Where worker processes (`--workers`) append their events: the path, inherited from the producer."""


def event(**kw: Any) -> None:
    global OUT
    if OUT is None:  # a worker process: main() did not run here (lines of one write each: appends interleave whole)
        OUT = open(os.environ[EVENTS], "a")  # open for the process's life
    OUT.write(json.dumps({"t": time.time(), **kw}) + "\n")
    OUT.flush()


def digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:16]


@dataclass
class Slow(Environment):
    """A rollout of `min_s`..`max_s` seconds (by its seed), scored alone."""

    name: str = "slow"
    group_size: int = 16
    max_tokens: int = 8
    scores_each_rollout: bool = True
    posts_each_rollout: bool = True
    min_s: float = 0.1
    max_s: float = 0.5

    async def rollout(self, task: Task, session: Session) -> None:
        assert session.seed is not None
        await asyncio.sleep(random.Random(session.seed).uniform(self.min_s, self.max_s))  # the episode's work
        await session.observe(task.prompt)
        await session.generate()
        event(done=session.seed)

    def score(self, task: Task, session: Session) -> float:
        return 1.0


class Finite:
    """`n` tasks, then none until the run stops; once the runner has nothing of its own in flight, `idle`."""

    def __init__(self, n: int, offset: int, idle: Path, runner: list[RolloutRunner]) -> None:
        self.left, self.offset, self.idle, self.runner = n, offset, idle, runner

    async def anext_task(self) -> Task | None:
        if self.left > 0:
            self.left -= 1
            return arithmetic_task(self.offset + self.left)
        while any(not k.count("#") for k in self.runner[0]._in_flight.groups):  # its own groups, not siblings'
            await asyncio.sleep(0.05)
        self.idle.touch()
        await asyncio.Event().wait()
        return None

    def next_task(self) -> Task | None:
        raise AssertionError("anext_task is used")

    def report(self, task: Task, mean_score: float) -> None:
        pass


def observe_acks(runner: RolloutRunner) -> None:
    """Record what the server acknowledged (after its reply: a kill in between records nothing)."""
    post = OpenGroups.post

    async def posted(
        self: OpenGroups, group_id: str, slot: int, tokens: Sequence[int], *a: Any, **kw: Any
    ) -> PostReply:
        reply = await post(self, group_id, slot, tokens, *a, **kw)
        if reply.status in ("accepted", "duplicate"):  # a retry of what the server acknowledged: it holds it
            event(ack=[group_id, slot, digest(tokens)])
        return reply

    OpenGroups.post = posted  # type: ignore[method-assign]
    submit = runner._registrations.submit

    async def submitted(i: int, group: Any) -> Any:
        reply = await submit(i, group)
        if not reply.duplicate:
            event(group=[group.group_id, [rollout_seed(group.group_id, k) for k in range(len(group.tokens))]])
        return reply

    runner._registrations.submit = submitted  # type: ignore[method-assign]


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--events", type=Path, required=True)
    ap.add_argument("--idle", type=Path, required=True)
    ap.add_argument("--tasks", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--min-s", type=float, default=0.1)
    ap.add_argument("--max-s", type=float, default=0.5)
    ap.add_argument("--whole", action="store_true", help="submit whole groups (no per-rollout posts)")
    ap.add_argument("--workers", type=int, default=0, help="run the rollouts in this many worker processes")
    args = ap.parse_args()
    OUT = args.events.open("a")
    os.environ[EVENTS] = str(args.events)
    env = Slow(group_size=args.group_size, posts_each_rollout=not args.whole, min_s=args.min_s, max_s=args.max_s)
    holder: list[RolloutRunner] = []
    runner = RolloutRunner(
        args.server,
        [(env, Finite(args.tasks, args.offset, args.idle, holder))],
        ScriptedPolicy(arithmetic_script),
        max_in_flight=args.group_size,
        poll_interval=0.1,
        timeouts=Timeouts(group=120.0),
        num_workers=args.workers,
    )
    holder.append(runner)
    observe_acks(runner)
    asyncio.run(runner.run())


if __name__ == "__main__":
    main()
