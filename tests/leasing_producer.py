"""A producer process whose tasks are leased from a rollbuf dataset (docs/tasks.md), for the tests that stop one
mid-run: a `RolloutRunner` over `LeasedTasks` with a scripted policy (no inference server), each rollout taking
about `--rollout-s` seconds, so that groups are in flight when the test sends SIGTERM or SIGSTOP, or when the
producer stops itself with `runner.stop()` (`--stop-after N`: once N groups are accepted).

    python -m tests.leasing_producer --server URL --dataset NAME --producer-id ID --stats PATH
        [--rollout-s S] [--max-in-flight N] [--stop-after N]

It runs until the dataset is done, a signal, or `--stop-after`; at exit it writes its runner's stats and the
leases its task source lost to `--stats` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from rollout_client import LeasedTasks, RolloutRunner, ScriptedPolicy, Session, Task
from rollout_client.examples import Arithmetic, arithmetic_script
from rollout_client.policy import stable_unit


@dataclass
class Slow(Arithmetic):
    """Arithmetic whose rollouts take `rollout_s` to twice that (fixed per task): groups of one producer end at
    different times, so that some are always in flight."""

    name: str = "slow"
    group_size: int = 2
    rollout_s: float = 0.5

    async def rollout(self, task: Task, session: Session) -> None:
        await asyncio.sleep(self.rollout_s * (1.0 + stable_unit(task.id)))
        await super().rollout(task, session)


async def stop_after(runner: RolloutRunner, accepted: int) -> None:
    """`runner.stop()` once `accepted` groups are accepted (polled: the runner has no event for it)."""
    while runner.stats.accepted < accepted:
        await asyncio.sleep(0.02)
    runner.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--producer-id", required=True)
    ap.add_argument("--stats", type=Path, required=True)
    ap.add_argument("--rollout-s", type=float, default=0.5)
    ap.add_argument("--max-in-flight", type=int, default=8)
    ap.add_argument("--stop-after", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def run() -> None:
        leased = LeasedTasks(args.dataset, args.server, producer_id=args.producer_id, batch=2, poll_s=0.1)
        runner = RolloutRunner(
            args.server,
            [(Slow(rollout_s=args.rollout_s), leased)],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=args.max_in_flight,
            poll_interval=0.1,
        )
        stopper = None if args.stop_after is None else asyncio.create_task(stop_after(runner, args.stop_after))
        try:
            stats = await runner.run()
        finally:
            if stopper is not None:
                stopper.cancel()
            await leased.aclose()
        failed = {env: dict(c) for env, c in stats.failed.items()}
        out = {"accepted": stats.accepted, "skipped": dict(stats.skipped), "failed": failed, "lost": leased.lost}
        args.stats.write_text(json.dumps(out))

    asyncio.run(run())


if __name__ == "__main__":
    main()
