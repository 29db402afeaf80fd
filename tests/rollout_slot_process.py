"""A producer of per-rollout groups for tests/integration/test_rollout_groups.py (`python -m
tests.rollout_slot_process`): with `--open G`, it opens each group of `--group` (a comma list) with G slots and
posts `--slots` of each (then keeps heartbeating, until killed); without, it takes sibling leases of the `math`
env and posts each leased slot until every group of `--group` is sealed, writing each lease it got to `--leases`
(one JSON line: group, slot, producer, expires_at) if given. Each rollout's tokens name its slot and producer, so
the test can tell whose was kept."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from rollout_client.leases.open_groups import OpenGroups


def tokens(slot: int, producer: int) -> list[int]:
    return [100 + slot, 200 + producer, 7]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--producer", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--open", type=int, default=0)
    parser.add_argument("--slots", default="")
    parser.add_argument("--leases", default="")
    args = parser.parse_args()
    groups = args.group.split(",")
    client = OpenGroups(args.server, producer_id=f"producer-{args.producer}")
    mine = tokens(0, args.producer)[1]
    if args.open:
        for group in groups:
            await client.open(group, args.open, env_id=0, deadline_s=600.0, task={"prompt": "2+2"})
            for slot in (int(s) for s in args.slots.split(",") if s):
                t = tokens(slot, args.producer)
                await client.post(group, slot, t, t, score=1.0)
        print("posted", flush=True)
        await asyncio.Event().wait()  # heartbeating until killed -9

    async def sealed(c: httpx.AsyncClient) -> bool:
        views = [(await c.get("/rollouts/group", params={"group_id": g})).json() for g in groups]
        return all(v.get("state") == "sealed" for v in views)

    async with httpx.AsyncClient(base_url=args.server, timeout=30) as c:
        while not await sealed(c):
            for lease in await client.lease(2, envs=["math"]):
                if args.leases:
                    with open(args.leases, "a") as out:
                        row = {
                            "group": lease.group_id,
                            "slot": lease.slot,
                            "producer": args.producer,
                            "expires_at": lease.expires_at,
                        }
                        out.write(json.dumps(row) + "\n")
                await asyncio.sleep(0.05)  # a rollout takes a while: siblings share the missing slots
                t = tokens(lease.slot, args.producer)
                assert t[1] == mine
                await client.post(lease.group_id, lease.slot, t, t, score=1.0)
            await asyncio.sleep(0.1)
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())
