"""A producer of multi-turn tool episodes for tests/integration/test_integration_episodes.py (`python -m
tests.episode_producer_process`): a `RolloutRunner` of the three walk envs (rollout_client/examples.py: resumed by
replay, by snapshot, restarted), G=4, each rollout posted turn by turn, with the scripted walk policy taking
`--gen-s` per generation (the model's time). It opens `--tasks` groups of each env, none with
`--tasks 0` (it then only takes sibling slots), and runs until killed. It appends one JSON line per event to
`--events`: `{"open": [group_id, env]}` once the server opened a group, `{"gen": tokens, "pid": pid}` per
generation (`pid`: the process that generated it, a worker's with `--workers`). `--envs` and `--turns` choose
other envs and episodes (bench/episodes.py); `--workers` runs the rollouts in that many worker processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any, TextIO

from rollout_client import RolloutRunner, ScriptedPolicy, Task, Timeouts
from rollout_client.examples import RestartWalk, SnapshotWalk, Walk, walk_script
from rollout_client.leases.open_groups import OpenGroups
from rollout_client.policy import Completion

TURNS = 8
ENVS: list[type[Walk]] = [Walk, SnapshotWalk, RestartWalk]
TASK = Task("walk-0", "go")


def envs(names: str | None = None, turns: int = TURNS) -> list[Walk]:
    """The walk envs (those named, comma-separated; default all three), `turns` steps each."""
    out = []
    for kind in ENVS:
        if names is None or kind.name in names.split(","):
            env = kind()
            env.turns = turns
            out.append(env)
    return out


class Timed(ScriptedPolicy):
    """The walk policy, `gen_s` per generation, each recorded in `path` (opened by the process that generates:
    the policy pickles, for worker processes)."""

    def __init__(self, gen_s: float, path: Path) -> None:
        super().__init__(walk_script)
        self.gen_s, self.path = gen_s, path
        self.out: TextIO | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "out": None}

    async def generate(self, prompt_ids: list[int], **kw: Any) -> Completion:
        await asyncio.sleep(self.gen_s)
        done = await super().generate(prompt_ids, **kw)
        if self.out is None:
            self.out = self.path.open("a")
        self.out.write(json.dumps({"gen": len(done.token_ids), "pid": os.getpid()}) + "\n")
        self.out.flush()
        return done


class Once:
    """`n` copies of the one task, then none until the run stops."""

    def __init__(self, n: int) -> None:
        self.left = n

    async def anext_task(self) -> Task | None:
        if self.left > 0:
            self.left -= 1
            return TASK
        await asyncio.Event().wait()
        return None

    def next_task(self) -> Task | None:
        raise AssertionError("anext_task is used")

    def report(self, task: Task, mean_score: float) -> None:
        pass


def record_opens(out: TextIO) -> None:
    """Write down each group the server opened (after its reply)."""
    opened = OpenGroups.open

    async def open_(self: OpenGroups, group_id: str, *a: Any, **kw: Any) -> Any:
        view = await opened(self, group_id, *a, **kw)
        task = kw.get("task") or {}
        out.write(json.dumps({"open": [group_id, task.get("env")]}) + "\n")
        out.flush()
        return view

    OpenGroups.open = open_  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--events", type=Path, required=True)
    ap.add_argument("--tasks", type=int, default=1)
    ap.add_argument("--gen-s", type=float, default=0.1)
    ap.add_argument("--envs", help="comma-separated env names (default: all three)")
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    out = args.events.open("a")
    record_opens(out)
    runner = RolloutRunner(
        args.server,
        [(env, Once(args.tasks)) for env in envs(args.envs, args.turns)],
        Timed(args.gen_s, args.events),
        max_in_flight=64,
        num_workers=args.workers,
        poll_interval=0.1,
        timeouts=Timeouts(group=120.0),
    )
    asyncio.run(runner.run())


if __name__ == "__main__":
    main()
