"""The crash matrix's episodes producer (`python -m crash.episode_producer`): a `RolloutRunner` of the two trek envs
(crash/episodes.py: resumed by replay, resumed from snapshots), G=4, each rollout posted turn by turn as its turns
end, each generation of the scripted policy taking `--gen-s` (the model's time). It opens `--tasks` groups, of
each env in turn from `--first-env`, then takes sibling slots of either env (resuming them from their
acknowledged turns) with nothing of its own in flight, which it says by creating `--idle`, until stopped.

It appends to `--record` what the counter needs (crash/records.py), one JSON line each, flushed, with the time:
a header; `{"open": [group_id, env, task_id]}` before it asks the server to open a group (a line for a group
never opened is harmless); `{"turn": [group_id, slot, turn, digest]}` once the server acknowledged a turn (DIGEST:
of the turn's tokens); `{"ack": [group_id, slot, digest]}` once it acknowledged a rollout (DIGEST: of the whole
rollout's tokens, its turns' included); `{"gen": n}` per completion the policy generated (replayed ones are not
generated); `{"resumed": [group_id, slot, tokens]}` per slot continued from another producer's turns (TOKENS:
taken from them, not generated again); `{"restarted": [group_id, slot]}` per slot whose turns could not be
continued. The recording wraps the runner's calls: instrumentation for counting, not something a producer needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from api.wire.rollouts import PostReply, SlotPrefix, TurnReply
from crash.episodes import ENVS, task
from crash.records import Writer, digest
from rollout_client import RolloutRunner, ScriptedPolicy, Task, Timeouts
from rollout_client.examples import walk_script
from rollout_client.group import Rollout
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.policy import Completion
from rollout_client.runner.per_rollout import Poster, slot_content
from rollout_client.runner.siblings import SiblingSlots

SIDE = "episodes"
RECORD = "CRASH_EPISODES_RECORD"
"""Where worker processes (`--workers`) append their lines: the path, inherited from the producer."""

_writer: Writer | None = None
_status: contextvars.ContextVar[str] = contextvars.ContextVar("post_status", default="")
"""The status of the rollout post just made (set by the wrapped `OpenGroups.post`, read by `Poster`'s wrapper in
the same task)."""


def write(**fields: Any) -> None:
    """One line of the record; in a worker process (no header written there), opened on first use."""
    global _writer
    if _writer is None:
        _writer = Writer(Path(os.environ[RECORD]), SIDE, header=False)
    _writer.write(**fields)


class Timed(ScriptedPolicy):
    """The walk's scripted policy, `gen_s` per completion, each one written down."""

    def __init__(self, gen_s: float) -> None:
        super().__init__(walk_script)
        self.gen_s = gen_s

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        await asyncio.sleep(self.gen_s)  # the model's time: the fault finds episodes mid-turn
        done = await super().generate(prompt_ids, **kw)
        write(gen=len(done.token_ids))
        return done


class Finite:
    """`n` tasks of one env, then none; once every source of the producer is spent and the runner has nothing of
    its own in flight, `idle` exists (sibling slots are taken still)."""

    def __init__(self, env: str, n: int, offset: int, idle: Path, runner: list[RolloutRunner]) -> None:
        self.env, self.left, self.offset, self.idle, self.runner = env, n, offset, idle, runner
        self.all: list[Finite] = [self]

    async def anext_task(self) -> Task | None:
        if self.left > 0:
            self.left -= 1
            return task(self.offset + self.left)
        while any(s.left for s in self.all) or any(not k.count("#") for k in self.runner[0]._in_flight.groups):
            await asyncio.sleep(0.05)
        self.idle.touch()
        await asyncio.Event().wait()
        return None

    def next_task(self) -> Task | None:
        raise AssertionError("anext_task is used")

    def report(self, task: Task, mean_score: float) -> None:
        pass


def instrument() -> None:
    """Wrap what the runner calls so that each acknowledgement, resume and open is written down after the reply
    (an open: before the call)."""
    opened, turned, posted, called = OpenGroups.open, OpenGroups.turn, OpenGroups.post, Poster.__call__
    resumed = SiblingSlots._resumed

    async def open_(self: OpenGroups, group_id: str, *a: Any, **kw: Any) -> Any:
        wire = kw.get("task") or {}
        write(open=[group_id, wire.get("env"), wire.get("id")])
        return await opened(self, group_id, *a, **kw)

    async def turn(
        self: OpenGroups, group_id: str, slot: int, turn: int, tokens: Sequence[int], *a: Any, **kw: Any
    ) -> TurnReply:
        reply = await turned(self, group_id, slot, turn, tokens, *a, **kw)
        write(turn=[group_id, slot, turn, digest(tokens)])
        return reply

    async def post(self: OpenGroups, *a: Any, **kw: Any) -> PostReply:
        reply = await posted(self, *a, **kw)
        _status.set(reply.status)
        return reply

    async def call(self: Poster, slot: int, rollout: Rollout) -> None:
        _status.set("")
        await called(self, slot, rollout)
        if _status.get() in ("accepted", "duplicate"):  # a retry of what the server holds is acknowledged too
            write(ack=[self.group_id, slot, digest(slot_content(rollout).tokens)])

    async def resumed_(
        self: SiblingSlots, i: int, task: Task, group_id: str, slot: int, given: SlotPrefix | None
    ) -> Rollout:
        rollout = await resumed(self, i, task, group_id, slot, given)
        if rollout.resumed_tokens:
            write(resumed=[group_id, slot, rollout.resumed_tokens])
        elif given is not None and given.turns:
            write(restarted=[group_id, slot])
        return rollout

    OpenGroups.open = open_  # type: ignore[method-assign]
    OpenGroups.turn = turn  # type: ignore[method-assign]
    OpenGroups.post = post  # type: ignore[method-assign]
    Poster.__call__ = call  # type: ignore[method-assign]
    SiblingSlots._resumed = resumed_  # type: ignore[method-assign]


def main() -> None:
    global _writer
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True)
    ap.add_argument("--record", type=Path, required=True)
    ap.add_argument("--idle", type=Path, required=True)
    ap.add_argument("--tasks", type=int, default=2, help="groups it opens, of its envs in turn")
    ap.add_argument("--first-env", type=int, default=0, help="the env (0: trek, 1: trek_snapshot) it opens first")
    ap.add_argument("--offset", type=int, default=0, help="its tasks are trek-OFFSET, trek-OFFSET+1, ...")
    ap.add_argument("--gen-s", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=0, help="run the rollouts in this many worker processes")
    args = ap.parse_args()
    _writer = Writer(args.record, SIDE)
    os.environ[RECORD] = str(args.record)
    instrument()
    holder: list[RolloutRunner] = []
    names = list(ENVS)  # every env, so that it can continue any sibling slot; its own groups take them in turn
    counts = [sum((args.first_env + i) % len(names) == k for i in range(args.tasks)) for k in range(len(names))]
    sources = [Finite(name, counts[k], args.offset + 100 * k, args.idle, holder) for k, name in enumerate(names)]
    # The runner asks its envs' sources in turn (equal weights) and waits on the one it asks: a source with tasks
    # left comes first, so that none is asked after one that waits for good.
    sources.sort(key=lambda s: -s.left)
    for s in sources:
        s.all = sources
    runner = RolloutRunner(
        args.server,
        [(ENVS[s.env](), s) for s in sources],
        Timed(args.gen_s),
        max_in_flight=32,
        poll_interval=0.1,
        timeouts=Timeouts(group=120.0),
        num_workers=args.workers,
    )
    holder.append(runner)
    asyncio.run(runner.run())


if __name__ == "__main__":
    main()
