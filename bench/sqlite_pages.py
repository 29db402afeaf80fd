"""SQLite page size for new files, against write volume and the read path.

Write: groups of 8 x 256 tokens (a 16 KB payload) appended one per transaction, as ingest does; the bytes the
process writes per group (`wchar`: the WAL's frames and the checkpoints' copies back) and groups/s. Read: a
queue of 8 x 2048-token groups (128 KB each), batches of 1024 sequences popped and kept, then read back as the
binary `/batch` serves them; ms per batch. Run: `python -m bench.sqlite_pages [--pages 4096 16384 65536]`.
Figures are noisy on a shared machine: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from api.store import make_store
from api.store.base import ItemMeta, QueuedItem, Store, Txn

WRITES = 2000
READ_GROUPS = 512
BATCH_GROUPS = 128


def written() -> int:
    with open(f"/proc/{os.getpid()}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


async def append(store: Store, n: int, payload: bytes, seqs: int, tokens: int) -> None:
    for _ in range(n):

        def fn(t: Txn) -> None:
            t.append(0, QueuedItem(ItemMeta(t.next_item_id(), seqs, tokens, 0), 1, payload))

        await store.transact(fn)


async def batches(store: Store) -> float:
    """ms per batch: pop BATCH_GROUPS items kept for a step, then read the kept batch back."""
    times = []
    for step in range(READ_GROUPS // BATCH_GROUPS):

        def form(t: Txn, step: int = step) -> None:
            ids = [m.item_id for _, m in zip(range(BATCH_GROUPS), t.head(0), strict=False)]
            t.pop(0, ids, keep_for=step)
            t.put_batch(step, b"header", ids)

        start = time.perf_counter()
        await store.transact(form)
        kept = await store.transact(lambda t, step=step: t.get_batch(step))
        times.append(time.perf_counter() - start)
        assert kept is not None
    return 1000 * sorted(times)[len(times) // 2]


async def measure(path: Path, page_size: int) -> dict[str, object]:
    store = make_store(f"sqlite:///{path}?page_size={page_size}")
    try:
        before, start = written(), time.perf_counter()
        await append(store, WRITES, os.urandom(16 * 1024), 8, 2048)
        seconds = time.perf_counter() - start
        await store.close()  # the last checkpoint's writes count too
        per_group = (written() - before) / WRITES
        store = make_store(f"sqlite:///{path}?page_size={page_size}")
        await append(store, READ_GROUPS, os.urandom(128 * 1024), 8, 16384)
        batch_ms = await batches(store)
    finally:
        await store.close()
    return {
        "bench": "sqlite-pages",
        "page_size": page_size,
        "written_kb_per_group": round(per_group / 1024, 1),
        "groups_per_s": round(WRITES / seconds),
        "batch_ms": round(batch_ms, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[4096, 16384, 65536])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for page_size in args.pages:
            print(json.dumps(asyncio.run(measure(Path(tmp) / f"p{page_size}.db", page_size))), flush=True)


if __name__ == "__main__":
    main()
