"""Per-rollout ingest cost (docs/rollouts.md): server CPU per rollout when a group of G arrives as one
POST /scored_data, when it arrives as an open and G posts (the last sealing it), and when each rollout arrives
as `--turns` pieces: turns (POST /rollouts/turn) and a final post after them with the last piece and its score.
Through the ASGI app in this process (CPU time of the process: the server's work plus httpx's, the same for all),
per store, the stores in turns in one run (PostgreSQL: a new database on the local server, `tests/pg.py`).

    python -m bench.rollouts [--groups 100] [--group-size 8] [--turns 4] [--stores memory sqlite postgres]
                             [--large 4096] [--long 1000]

With `--seal G` it also prints the CPU of the seal's own work on a group of G rollouts of 2,048 tokens (with
logprobs), in process, no HTTP: the sealed group's body assembled from its stored slots, and ingest's validation
of that body. With `--large G` it also posts the rollouts of one group of G and prints the CPU of a post at its
slots 1 to 50 against its slots 4,000 to 4,049 (`--late`: another slot than 4,000; G at least 50 more): what a post
costs as the group fills.

With `--long N` it also posts N + 50 turns of one slot and prints the CPU of its turns 1 to 50 against its turns
N to N + 49: what a turn post costs as its episode grows.

Figures are noisy on a shared machine: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from api.app import create_app
from api.config.settings import Settings
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import decode
from api.owners import ANYONE
from api.rollouts import txns
from api.run import state
from api.store.memory import MemoryTxn, State
from api.wire.records import MSGPACK
from api.wire.rollouts import OpenRequest, RolloutPost
from api.wire.schema import Registration
from tests import pg
from tests.factories import env, registration

TOKENS = 256


async def run(store: str, groups: int, size: int, turns: int) -> tuple[float, float, float, float]:
    """CPU seconds per rollout: whole groups, per-rollout groups, per-turn rollouts (`turns` pieces each: turns, and
    a final post with the last); and the mean seal latency (s) of per-rollout groups."""
    app = create_app(Settings(store=store, max_queue_groups=None))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=size))
            await c.get("/batch")
            await c.post("/register-env", json=env(group_size=size))
            row = list(range(1, TOKENS + 1))
            start = time.process_time()
            for g in range(groups):
                body = {
                    "tokens": [row] * size,
                    "masks": [row] * size,
                    "scores": [1.0] * size,
                    "env_id": 0,
                    "group_id": f"whole-{g}",
                }
                assert (await c.post("/scored_data", json=body)).status_code == 200
            whole = (time.process_time() - start) / (groups * size)
            start = time.process_time()
            seal = 0.0
            for g in range(groups):
                key = f"each-{g}"
                opened = {"group_id": key, "env_id": 0, "producer_id": "p", "group_size": size, "deadline_s": 600.0}
                assert (await c.post("/rollouts/open", json=opened)).status_code == 200
                for s in range(size):
                    post = {"group_id": key, "slot": s, "producer_id": "p", "tokens": row, "masks": row, "score": 1.0}
                    t0 = time.perf_counter()
                    reply = await c.post("/rollouts/post", json=post)
                    assert reply.status_code == 200, reply.text
                seal += time.perf_counter() - t0
                assert reply.json()["group"]["state"] == "sealed"
            each = (time.process_time() - start) / (groups * size)
            start = time.process_time()
            step = TOKENS // turns
            for g in range(groups):
                key = f"turns-{g}"
                opened = {"group_id": key, "env_id": 0, "producer_id": "p", "group_size": size, "deadline_s": 600.0}
                assert (await c.post("/rollouts/open", json=opened)).status_code == 200
                for s in range(size):
                    base = {"group_id": key, "slot": s, "producer_id": "p"}
                    for k in range(turns - 1):
                        part = row[k * step : (k + 1) * step]
                        body = {**base, "turn": k, "tokens": part, "masks": part}
                        assert (await c.post("/rollouts/turn", json=body)).status_code == 200
                    last = row[(turns - 1) * step :]
                    final = {**base, "tokens": last, "masks": last, "score": 1.0, "after_turns": True}
                    reply = await c.post("/rollouts/post", json=final)
                    assert reply.status_code == 200, reply.text
                assert reply.json()["group"]["state"] == "sealed"
            per_turn = (time.process_time() - start) / (groups * size)
            return whole, each, per_turn, seal / groups


async def large(store: str, size: int, at: tuple[int, int] = (1, 4000), n: int = 50) -> tuple[float, float]:
    """CPU seconds of a post at slots at[0].. and at[1].. (n of each) of one open group of `size`."""
    app = create_app(Settings(store=store, max_queue_groups=None))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=size))
            await c.get("/batch")
            await c.post("/register-env", json=env(group_size=size))
            row = list(range(1, TOKENS + 1))
            opened = {"group_id": "large", "env_id": 0, "producer_id": "p", "group_size": size, "deadline_s": 600.0}
            assert (await c.post("/rollouts/open", json=opened)).status_code == 200
            spent = {first: 0.0 for first in at}
            for s in range(at[1] + n):
                post = {"group_id": "large", "slot": s, "producer_id": "p", "tokens": row, "masks": row, "score": 1.0}
                t0 = time.process_time()
                assert (await c.post("/rollouts/post", json=post)).status_code == 200
                for first in at:
                    if first <= s < first + n:
                        spent[first] += time.process_time() - t0
            return spent[at[0]] / n, spent[at[1]] / n


async def long_episode(store: str, at: int, n: int = 50) -> tuple[float, float]:
    """CPU seconds of a turn post at turns 1.. and at.. (n of each) of one slot, 2 tokens a turn."""
    app = create_app(Settings(store=store, max_queue_groups=None, rollout_max_turns_per_slot=at + n + 1))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            longest = 2 * (at + n + 1)
            await c.post("/register", json=registration(batch_size=2, max_token_len=longest))
            await c.get("/batch")
            await c.post("/register-env", json=env(group_size=2, max_token_length=longest))
            opened = {"group_id": "long", "env_id": 0, "producer_id": "p", "group_size": 2, "deadline_s": 600.0}
            assert (await c.post("/rollouts/open", json=opened)).status_code == 200
            spent = {1: 0.0, at: 0.0}
            for k in range(at + n):
                body = {"group_id": "long", "slot": 0, "producer_id": "p", "turn": k, "tokens": [k, 1], "masks": [1, 1]}
                t0 = time.process_time()
                assert (await c.post("/rollouts/turn", json=body)).status_code == 200
                for first in spent:
                    if first <= k < first + n:
                        spent[first] += time.process_time() - t0
            return spent[1] / n, spent[at] / n


@contextmanager
def store_url(name: str, tmp: Path, tag: str) -> Iterator[str]:
    """A new store of this backend: memory, a SQLite file in `tmp`, or a new database on the local PostgreSQL."""
    if name == "memory":
        yield "memory://"
    elif name == "sqlite":
        yield f"sqlite:///{tmp / f'{tag}.db'}"
    else:
        with pg.database() as db:
            yield pg.url_of(db)


def seal_cost(size: int, tokens: int = 2048, rounds: int = 20) -> float:
    """CPU seconds of a sealed group's body (`group_body`) and ingest's validation of it (`decode`)."""
    settings, limits = Settings(store="memory://"), QueueLimits()
    txn = MemoryTxn(State())
    reg = Registration.model_validate(registration(batch_size=size, max_token_len=tokens))
    state.save_run(txn, reg, started=True)
    opened = OpenRequest(group_id="g", producer_id="p", group_size=size, deadline_s=600.0)
    txns.open_txn(txn, opened, 0.0, settings, ANYONE, limits=limits)
    row, logprobs = list(range(1, tokens + 1)), [-0.5] * tokens
    for s in range(size):
        post = {
            "group_id": "g",
            "slot": s,
            "producer_id": "p",
            "tokens": row,
            "masks": row,
            "inference_logprobs": logprobs,
            "score": 1.0,
        }
        txns.post_txn(txn, RolloutPost.model_validate(post), 0.0, settings, limits=limits)
    run = state.load(txn)
    start = time.process_time()
    for _ in range(rounds):
        body = txns.group_body(txn, "g")
        assert body is not None
        decode(body, MSGPACK, run, limits, many=False)
    return (time.process_time() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--stores", nargs="+", default=["memory", "sqlite", "postgres"])
    parser.add_argument("--turns", type=int, default=4, help="pieces of a rollout posted per turn (at least 2)")
    parser.add_argument("--long", type=int, default=0, help="the first of the late turns measured (0: none)")
    parser.add_argument("--large", type=int, default=0, help="G of the one large group (0: none)")
    parser.add_argument("--late", type=int, default=4000, help="the first of the late slots measured")
    parser.add_argument("--seal", type=int, nargs="*", default=[], help="G of the groups whose seal is measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.stores:
            with store_url(name, Path(tmp), "bench") as store:
                whole, each, per_turn, seal = asyncio.run(run(store, args.groups, args.group_size, args.turns))
            print(
                f"{name:8} CPU ms per rollout: whole group {whole * 1e3:.3f}, per rollout {each * 1e3:.3f} "
                f"({each / whole:.1f}x), per turn ({args.turns - 1} turns and a final post) {per_turn * 1e3:.3f} "
                f"({per_turn / whole:.1f}x); a small group's ingest (G={args.group_size}) "
                f"{whole * args.group_size * 1e3:.2f} ms; seal (the last post, ingest included) {seal * 1e3:.1f} ms"
            )
        for size in args.seal:
            cost = seal_cost(size)
            print(f"seal of G={size} (2,048 tokens a rollout): body and ingest validation {cost * 1e3:.2f} CPU ms")
        for name in args.stores if args.large else []:
            with store_url(name, Path(tmp), "large") as store:
                early, late = asyncio.run(large(store, args.large, (1, args.late)))
            print(
                f"{name:8} CPU ms per post in a group of {args.large}: slots 1-50 {early * 1e3:.3f}, "
                f"slots {args.late}-{args.late + 49} {late * 1e3:.3f} ({late / early:.2f}x)"
            )
        for name in args.stores if args.long else []:
            with store_url(name, Path(tmp), "long") as store:
                early, late = asyncio.run(long_episode(store, args.long))
            print(
                f"{name:8} CPU ms per turn post of one slot: turns 1-50 {early * 1e3:.3f}, "
                f"turns {args.long}-{args.long + 49} {late * 1e3:.3f} ({late / early:.2f}x)"
            )


if __name__ == "__main__":
    main()
