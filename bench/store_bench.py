"""Store micro-benchmark: the memory and SQLite backends side by side, without HTTP.

1. Ingest: N appends of realistic items (60 KB payload, 8 sequences, ~15k tokens), one item per
   transaction, from 1 producer and from many concurrent ones (what group commit is for).
2. Batch formation cost against queue depth: head() + pop() of the first 32 items of a queue of
   100 / 10k / 100k items. The cost should not grow with the depth.

Run: `.venv/bin/python bench/store_bench.py` (`--help` for sizes). Figures are noisy on a shared machine:
compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api.store import Store, make_store  # noqa: E402
from api.store.base import ItemMeta, QueuedItem, Txn  # noqa: E402

SEQS = 8
TOKENS = 15_000
TAKE = 32


def backends(tmp: Path, syncs: list[str]) -> list[tuple[str, Callable[[str], Store]]]:
    out: list[tuple[str, Callable[[str], Store]]] = [("memory", lambda _: make_store("memory://"))]
    for sync in syncs:
        out.append((f"sqlite {sync}", lambda tag, s=sync: make_store(f"sqlite:///{tmp / tag}.db?synchronous={s}")))
    return out


async def ingest(store: Store, n: int, producers: int, payloads: list[bytes]) -> float:
    """Seconds to append n items, one per transaction, from `producers` concurrent tasks."""
    counter = itertools.count()

    async def producer() -> None:
        while (i := next(counter)) < n:
            payload = payloads[i % len(payloads)]

            def fn(t: Txn, env: int = i % 4, payload: bytes = payload) -> None:
                t.append(env, QueuedItem(ItemMeta(t.next_item_id(), SEQS, TOKENS, 0), 1, payload))

            await store.transact(fn)

    start = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(producers)))
    return time.perf_counter() - start


async def fill(store: Store, depth: int, payload: bytes) -> None:
    def fn(t: Txn, k: int) -> None:
        for _ in range(k):
            t.append(0, QueuedItem(ItemMeta(t.next_item_id(), SEQS, TOKENS, 0), 1, payload))

    for start in range(0, depth, 5000):
        k = min(5000, depth - start)
        await store.transact(lambda t, k=k: fn(t, k))


async def take_first(store: Store, reps: int, payload: bytes) -> float:
    """Median seconds of one transaction taking the first TAKE items (head + pop + commit)."""

    def take(t: Txn) -> int:
        ids = [m.item_id for m in itertools.islice(t.head(0), TAKE)]
        return sum(len(it.payload) for it in t.pop(0, ids))

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        assert await store.transact(take) == TAKE * len(payload)
        times.append(time.perf_counter() - start)
        await fill(store, TAKE, payload)  # keep the depth (untimed)
    return statistics.median(times)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="appends per run (default 2000)")
    ap.add_argument("--payload-kb", type=int, default=60, help="payload size of an ingested item")
    ap.add_argument("--producers", default="1,32", help="concurrent producers, comma-separated")
    ap.add_argument("--depths", default="100,10000,100000", help="queue depths for head()+pop()")
    ap.add_argument("--depth-payload-kb", type=int, default=2, help="payload of the queued items in part 2")
    ap.add_argument("--sync", default="NORMAL,FULL", help="SQLite synchronous settings to compare")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    producers = [int(p) for p in args.producers.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    payloads = [os.urandom(args.payload_kb * 1024) for _ in range(8)]
    mb = args.n * args.payload_kb / 1024

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        kinds = backends(Path(tmp), args.sync.split(","))
        print(
            f"Ingest: {args.n} appends, 1 item per transaction, {args.payload_kb} KB payload, {SEQS} seqs, "
            f"{TOKENS} tokens"
        )
        print(f"{'backend':<16}{'producers':>10}{'appends/s':>12}{'MB/s':>9}{'vs memory':>11}")
        base: dict[int, float] = {}
        for name, make in kinds:
            for p in producers:
                store = make(f"ingest-{p}")
                try:
                    rate = args.n / await ingest(store, args.n, p, payloads)
                finally:
                    await store.close()
                base.setdefault(p, rate)
                print(f"{name:<16}{p:>10}{rate:>12,.0f}{rate * mb / args.n:>9,.0f}{rate / base[p]:>10.0%}")

        print(
            f"\nhead() + pop() of the first {TAKE} items, one transaction, median of {args.reps} (ms); "
            f"queued items carry {args.depth_payload_kb} KB payloads"
        )
        print(f"{'backend':<16}" + "".join(f"{f'depth {d:,}':>16}" for d in depths))
        small = os.urandom(args.depth_payload_kb * 1024)
        for name, make in kinds:
            cells = []
            for d in depths:
                store = make(f"depth-{d}")
                try:
                    await fill(store, d, small)
                    cells.append(await take_first(store, args.reps, small))
                finally:
                    await store.close()
            print(f"{name:<16}" + "".join(f"{c * 1000:>16.3f}" for c in cells))


if __name__ == "__main__":
    asyncio.run(main())
