"""The PostgreSQL store's transaction functions without HTTP: the writer thread's CPU inside each function
(its reads with the group's pending rows laid over them, its writes into the group's cache, and the client side
of its round trips), which is where a change to how reads see pending writes shows. The event loop, the COMMIT
and the database's own CPU are left out: on a shared machine they only add noise to that figure.

    python -m bench.pg_reads [--n 3000] [--rounds 5] [--base DIR]

Per transaction, microseconds: an ingest (a reply looked up, an item appended with its ledger row, the reply
stored), alone and 32 at a time (one group commit); a batch's head and pop (the first 32 of a queue); a task
lease's reads (the reclaimable rows, rows written, read back). With `--base`, DIR (another checkout, e.g.
`git worktree add /tmp/base main`) runs the same in turns (which goes first alternates), each round on a fresh
database, and the medians and their ratio (this checkout / DIR) are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The checkout whose store is measured: this one, or (ROLLBUF_BENCH_ROOT) a base from before this file existed.
sys.path.insert(0, os.environ.get("ROLLBUF_BENCH_ROOT", str(Path(__file__).resolve().parent.parent)))

from api.store import make_store  # noqa: E402
from api.store.base import ItemMeta, QueuedItem, Txn  # noqa: E402
from api.store.ledger_contract import QUEUED, LedgerGroup  # noqa: E402
from api.store.tasks import FRONT, LEASED, TaskRow  # noqa: E402
from bench import pg  # noqa: E402

TASKS = 20_000


def _row(item_id: int, group_id: str) -> LedgerGroup:
    """An ingested group's ledger row."""
    return LedgerGroup(
        id=item_id,
        env_id=0,
        group_id=group_id,
        handler=None,
        acked_at=1.0,
        policy_step=0,
        seqs=8,
        tokens=800,
        bytes=2000,
        score_mean=0.5,
        score_min=0.0,
        score_max=1.0,
        score_std=0.5,
        fate=QUEUED,
    )


def _ingest(n: int) -> Callable[[Txn], None]:
    def fn(t: Txn) -> None:
        key = f"k{n}"
        t.get_reply(key)
        meta = ItemMeta(t.next_item_id(), 8, 800, 0)
        t.append(0, QueuedItem(meta, 1, b"x" * 2000))
        t.ledger.add([_row(meta.item_id, key)])
        t.put_reply(key, "ok")

    return fn


def _head_and_pop(t: Txn) -> None:
    ids = []
    for meta in t.head(0):
        ids.append(meta.item_id)
        if len(ids) == 32:
            break
    t.pop(0, ids)


def _lease(t: Txn) -> None:
    _, front = t.tasks.reclaimable("d", 0.0, 4, 4)
    t.tasks.put_rows([TaskRow("d", 0, r.index, LEASED, seq=r.seq, expires_at=1e12) for r in front])
    t.tasks.rows("d", [(0, r.index) for r in front])


async def _measure(url: str, n: int) -> dict[str, float]:
    spent = [0.0]

    def timed(fn: Callable[[Txn], Any]) -> Callable[[Txn], Any]:
        def call(t: Txn) -> Any:
            began = time.thread_time()
            try:
                return fn(t)
            finally:
                spent[0] += time.thread_time() - began

        return call

    out: dict[str, float] = {}
    store = make_store(url)
    try:
        await store.transact(lambda t: t.tasks.put_rows([TaskRow("d", 0, i, FRONT, seq=i) for i in range(TASKS)]))
        spent[0] = 0.0
        for k in range(n):
            await store.transact(timed(_ingest(k)))
        out["ingest x1"] = spent[0] / n
        spent[0] = 0.0
        for first in range(n, 2 * n, 32):
            await asyncio.gather(*(store.transact(timed(_ingest(first + k))) for k in range(32)))
        out["ingest x32"] = spent[0] / n
        spent[0] = 0.0
        reps = n // 64
        for _ in range(reps):
            await store.transact(timed(_head_and_pop))
        out["head+pop 32"] = spent[0] / reps
        spent[0] = 0.0
        leases = min(n // 4, TASKS // 4)
        for _ in range(leases):
            await store.transact(timed(_lease))
        out["task lease reads"] = spent[0] / leases
    finally:
        await store.close()
    return {k: round(v * 1e6, 1) for k, v in out.items()}


def _one(n: int) -> dict[str, float]:
    with pg.database() as url:
        return asyncio.run(_measure(url, n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="ingest transactions per round (default 3000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--base", type=Path, help="another checkout, run in turns with this one")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a round of this checkout, as JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.n)))
        return
    if not pg.available():
        sys.exit(f"no PostgreSQL at {pg.ADMIN_URL}")
    here = Path(__file__).resolve().parent.parent
    sides = {"this": here, **({"base": args.base.resolve()} if args.base else {})}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, root in list(sides.items())[:: 1 if r % 2 == 0 else -1]:  # which goes first alternates
            env = {**os.environ, "PYTHONPATH": str(root)}
            cmd = [sys.executable, str(root / "bench" / "pg_reads.py"), "--one", "--n", str(args.n)]
            if not (root / "bench" / "pg_reads.py").exists():  # a base from before this file: run this one there
                cmd[1] = str(here / "bench" / "pg_reads.py")
                env["ROLLBUF_BENCH_ROOT"] = str(root)
            line = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
            runs[side].append(json.loads(line.strip().splitlines()[-1]))
            print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    print("\nmedian us per transaction (writer thread CPU inside the function):")
    for what in runs["this"][0]:
        this = statistics.median(run[what] for run in runs["this"])
        row = f"  {what:18s} this {this:8.1f}"
        if "base" in runs:
            base = statistics.median(run[what] for run in runs["base"])
            row += f"   base {base:8.1f}   this/base {this / base:.2f}"
        print(row)


if __name__ == "__main__":
    main()
