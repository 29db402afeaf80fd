"""A producer of one long episode posted turn by turn, for tests/integration/test_integration_turns.py (`python -m
tests.turn_producer_process`): with `--open`, it opens group `--group` (G=1) and posts the episode's turns one by
one, a pause between them, appending each acknowledged turn's number to `--record` (then keeps heartbeating, until
killed); without, it takes the slot's lease once the opener lapsed, continues the episode from the lease's prefix
(the turns the server acknowledged) and sends the rest with the final post `after_turns`, recording the prefix it
was handed. The episode is fixed (`episode`), so the test can compare the sealed rollout with it."""

from __future__ import annotations

import argparse
import asyncio
import json

from rollout_client.client import RolloutClient
from rollout_client.leases.open_groups import OpenGroups

TURNS = 8


def episode() -> list[list[int]]:
    """The episode's turns (each its tokens), then its tail (what the final post carries)."""
    return [[1000 + 10 * k + i for i in range(3)] for k in range(TURNS)] + [[5, 6]]


async def post_turns(rc: RolloutClient, group: str, producer: str, first: int, record: str, pause: float) -> None:
    for k, tokens in list(enumerate(episode()[:TURNS]))[first:]:
        await rc.post_turn(
            group,
            0,
            producer,
            k,
            tokens,
            tokens,
            inference_logprobs=[-0.1] * len(tokens),
            snapshot=json.dumps({"turn": k}).encode(),
        )
        with open(record, "a") as out:
            out.write(f"{k}\n")
        await asyncio.sleep(pause)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--producer", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--open", action="store_true")
    args = parser.parse_args()
    groups = OpenGroups(args.server, producer_id=args.producer)
    async with RolloutClient(args.server) as rc:
        if args.open:
            await groups.open(args.group, 1, env_id=0, deadline_s=600.0, task={"prompt": "a long task"})
            await post_turns(rc, args.group, args.producer, 0, args.record, pause=0.3)
            await asyncio.Event().wait()  # heartbeating until killed -9
        while not (leases := await groups.lease(1, envs=["math"])):
            await asyncio.sleep(0.1)
        [lease] = leases
        prefix = lease.prefix
        assert prefix is not None and prefix.complete
        with open(args.record + ".prefix", "w") as out:
            json.dump(prefix.model_dump(), out)
        await post_turns(rc, args.group, args.producer, prefix.turns, args.record, pause=0.0)
        tail = episode()[TURNS]
        await groups.post(args.group, 0, tail, tail, score=1.0, inference_logprobs=[-0.1] * len(tail), after_turns=True)
    await groups.aclose()


if __name__ == "__main__":
    asyncio.run(main())
