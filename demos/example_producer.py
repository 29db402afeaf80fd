"""A producer process, as a deployment runs one apart from the trainer: a `RolloutRunner` of multi-turn
arithmetic episodes against an inference server (the fake vLLM), following the weights the trainer announces
through rollbuf and heartbeating. It runs until SIGTERM/SIGINT (or SIGKILL: a producer that dies).

    python -m tests.producer_process --server URL --inference URL [--on-new-weights continue|restart|drain]
        [--dataset NAME]  (its tasks leased from rollbuf's dataset NAME, until it is done: docs/tasks.md)
        [--env G:WEIGHT ...]  (several envs in one runner, each of G rollouts per group and that weight)
        [--name NAME] [--groups N] [--workers N]  (the env's name; stop after N groups; rollouts in N processes)
        [--record PATH]  (what it was told, as the crash matrix reads it: crash/records.py)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.wire.schema import ScoredData, ScoredReply
from crash.records import Writer
from rollout_client import LeasedTasks, RolloutRunner, Session, Task, Tasks
from rollout_client.examples import Arithmetic, arithmetic_task
from rollout_client.policy import OpenAIPolicy


@dataclass
class Turns(Arithmetic):
    """`turns` turns per episode (each a completion): a multi-turn episode that a weight sync meets in flight."""

    name: str = "turns"
    turns: int = 1

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        for _ in range(self.turns - 1):
            await session.generate()
            await session.observe(" Again:")
        await session.generate()


def record(runner: RolloutRunner, writer: Writer) -> None:
    """Write each group as it is sent (`made`) and once the server acknowledged it (`ack`; a duplicate too: the
    server says it holds it), after its reply: a kill in between writes nothing."""
    submit = runner._submits.submit

    async def submitted(i: int, group: ScoredData) -> ScoredReply:
        writer.write(made=group.group_id)
        reply = await submit(i, group)
        writer.write(ack=group.group_id)
        return reply

    runner._submits.submit = submitted  # type: ignore[method-assign,assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--inference", required=True)
    ap.add_argument("--on-new-weights", default="continue", choices=["continue", "restart", "drain"])
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--max-in-flight", type=int, default=8)
    ap.add_argument("--stats", type=Path, default=None, help="write the runner's stats here at exit")
    ap.add_argument("--dataset", default=None, help="lease tasks from this rollbuf dataset")
    ap.add_argument("--name", default="turns", help="the (first) env's name")
    ap.add_argument("--groups", type=int, default=None, help="stop once this many groups are done")
    ap.add_argument("--workers", type=int, default=0, help="run the rollouts in this many worker processes")
    ap.add_argument("--record", type=Path, default=None, help="write what it was told here (crash/records.py)")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="G:WEIGHT",
        help="an env of groups of G and this weight (repeatable; without it, one of --group-size)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shapes = [tuple(float(x) for x in spec.split(":")) for spec in args.env] or [(args.group_size, 1.0)]
    envs = [
        Turns(name=f"{args.name}{i}" if i else args.name, group_size=int(g), weight=w, turns=args.turns, max_tokens=8)
        for i, (g, w) in enumerate(shapes)
    ]
    for env in envs:
        env.on_new_weights = args.on_new_weights
    leased = LeasedTasks(args.dataset, args.server, batch=2, poll_s=0.1) if args.dataset else None
    sources = [(env, leased or Tasks(arithmetic_task)) for env in envs]
    runner = RolloutRunner(
        args.server, sources, functools.partial(OpenAIPolicy, args.inference, "fake"),
        max_in_flight=args.max_in_flight, max_staleness=args.max_staleness, poll_interval=0.1,
        num_workers=args.workers,
    )  # fmt: skip
    if args.record is not None:
        record(runner, Writer(args.record, "tasks" if args.dataset else "groups"))

    async def run() -> Any:
        try:
            return await runner.run(max_groups=args.groups)
        finally:
            if leased is not None:
                await leased.aclose()

    stats = asyncio.run(run())
    if args.stats is not None:
        args.stats.write_text(json.dumps({"accepted": stats.accepted, "skipped": dict(stats.skipped)}))


if __name__ == "__main__":
    main()
