"""An example producer, run apart from the trainer as a deployment runs one (docs/bring-your-environment.md, "The
four-process layout"): a `RolloutRunner` of multi-turn arithmetic episodes against an inference server (the
stand-in, `rollbuf standin-inference`), following the weights the trainer announces through rollbuf and
heartbeating.

With `--dataset NAME` its tasks are leased from rollbuf's dataset NAME (docs/tasks.md), which `--tasks N` (N
arithmetic questions) or `--tasks-file PATH` (JSONL, one task a line) registers first, a page at a time
(`rollout_client.register_dataset`: safe to run again, so every producer of a run may do it). It then exits 0 once
the dataset is done and its groups acknowledged: the run over it is finished, which the trainer's `/batch` says
too. Without a dataset it makes tasks of its own and runs until `--groups` groups are done, or until
SIGTERM/SIGINT (its leases handed back untried).

    rollbuf example-producer --server URL --inference URL [--dataset NAME [--tasks N | --tasks-file PATH]]
        [--on-new-weights continue|restart|drain] [--turns N] [--max-staleness N]
        [--env G:WEIGHT ...]  (several envs in one runner, each of G rollouts per group and that weight)
        [--name NAME] [--groups N] [--workers N]  (the env's name; stop after N groups; rollouts in N processes)
        (or: python -m demos.example_producer ...)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_client import LeasedTasks, RolloutClient, RolloutRunner, Session, Task, Tasks, register_dataset
from rollout_client.examples import Arithmetic, arithmetic_task
from rollout_client.policy import OpenAIPolicy
from rollout_client.runner.stats import RunnerStats


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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rollbuf example-producer",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--server", required=True, metavar="URL", help="rollbuf's URL")
    ap.add_argument("--inference", required=True, metavar="URL", help="the inference server's URL (the stand-in's)")
    ap.add_argument(
        "--model", default="fake", metavar="NAME", help="the model named in completion requests (default: %(default)s)"
    )
    ap.add_argument("--on-new-weights", default="continue", choices=["continue", "restart", "drain"])
    ap.add_argument("--group-size", type=int, default=2, metavar="N", help="rollouts a group (default: %(default)s)")
    ap.add_argument("--turns", type=int, default=1, metavar="N", help="completions an episode (default: %(default)s)")
    ap.add_argument(
        "--max-staleness", type=int, default=None, metavar="N", help="start no group this many weights behind"
    )
    ap.add_argument("--max-in-flight", type=int, default=8, metavar="N", help="rollouts at once (default: %(default)s)")
    ap.add_argument("--stats", type=Path, default=None, metavar="PATH", help="write the runner's stats here at exit")
    ap.add_argument("--dataset", default=None, metavar="NAME", help="lease tasks from this rollbuf dataset")
    tasks = ap.add_mutually_exclusive_group()
    tasks.add_argument(
        "--tasks", type=int, default=None, metavar="N", help="register --dataset first: N arithmetic questions"
    )
    tasks.add_argument(
        "--tasks-file", type=Path, default=None, metavar="PATH", help="register --dataset first: this JSONL file"
    )
    ap.add_argument("--name", default="turns", metavar="NAME", help="the (first) env's name")
    ap.add_argument("--groups", type=int, default=None, metavar="N", help="stop once this many groups are done")
    ap.add_argument(
        "--workers", type=int, default=0, metavar="N", help="run the rollouts in this many worker processes"
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="G:WEIGHT",
        help="an env of groups of G and this weight (repeatable; without it, one of --group-size)",
    )
    return ap


def envs_of(args: argparse.Namespace) -> list[Turns]:
    shapes = [tuple(float(x) for x in spec.split(":")) for spec in args.env] or [(args.group_size, 1.0)]
    envs = [
        Turns(name=f"{args.name}{i}" if i else args.name, group_size=int(g), weight=w, turns=args.turns, max_tokens=8)
        for i, (g, w) in enumerate(shapes)
    ]
    for env in envs:
        env.on_new_weights = args.on_new_weights
    return envs


def question(i: int) -> dict[str, Any]:
    """Task `i` of `--tasks N` as a dataset row: `LeasedTasks` makes it the `Task` `arithmetic_task(i)` is."""
    task = arithmetic_task(i)
    return {"id": task.id, "prompt": task.prompt, "answer": task.answer}


async def register(args: argparse.Namespace, env: str) -> None:
    """Register `--dataset` from `--tasks` or `--tasks-file`, if given (a registration made already answers as it
    did, and its pages stored already are skipped)."""
    if args.tasks is None and args.tasks_file is None:
        return
    rows = args.tasks_file if args.tasks_file is not None else (question(i) for i in range(args.tasks))
    async with RolloutClient(args.server) as client:
        view = await register_dataset(client, args.dataset, rows, env=env)
    logging.getLogger("example_producer").info("dataset %s: %d tasks, sealed", view.name, view.size)


Instrument = Callable[[RolloutRunner, argparse.Namespace], None]
"""Called with the runner before it runs (the crash matrix records what it was told: crash/producer.py)."""


def main(
    argv: list[str] | None = None, *, ap: argparse.ArgumentParser | None = None, instrument: Instrument | None = None
) -> None:
    """`ap`: the parser (`parser()`, or one that adds to it); `instrument`: called with the runner before it runs."""
    ap = ap or parser()
    args = ap.parse_args(argv)
    if (args.tasks is not None or args.tasks_file is not None) and args.dataset is None:
        ap.error("--tasks and --tasks-file register --dataset: name it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: the clients log what matters
    envs = envs_of(args)

    async def run() -> tuple[RunnerStats, bool]:
        """The runner's stats, and whether its dataset is done."""
        await register(args, envs[0].name)
        leased = LeasedTasks(args.dataset, args.server, batch=2, poll_s=0.1) if args.dataset else None
        sources = [(env, leased or Tasks(arithmetic_task)) for env in envs]
        runner = RolloutRunner(
            args.server,
            sources,
            functools.partial(OpenAIPolicy, args.inference, args.model),
            max_in_flight=args.max_in_flight,
            max_staleness=args.max_staleness,
            poll_interval=0.1,
            num_workers=args.workers,
        )
        if instrument is not None:
            instrument(runner, args)
        try:
            return await runner.run(max_groups=args.groups), leased is not None and leased.done
        finally:
            if leased is not None:
                await leased.aclose()

    stats, done = asyncio.run(run())
    if args.stats is not None:
        args.stats.write_text(json.dumps({"accepted": stats.accepted, "skipped": dict(stats.skipped)}))
    print(f"example-producer: {stats.accepted} groups accepted" + (f", dataset {args.dataset} is done" if done else ""))


if __name__ == "__main__":
    main()
