"""Batch formation cost against queue length, in-process (no HTTP): the claim is that it stays flat.

Scenarios: `mixed` (4 envs of fixed sizes 8/16/4/8, one with a minimum share: the window holds an exact fill),
`survivor` (one env of survivor groups, 64 sequences less those of rollouts crashing with probability 2%: exact
fills of 256 lie beyond the window, among the 64s), `no_fill` (every group 63 sequences: no exact fill at all;
what a call costs, whether it forms a batch or says why not); `survivor_trim` and `no_fill_trim`, the same queues
for a trainer registered with `no_exact_fill: "trim"` (every batch exactly 256, a group cut to fit)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from api.batches.outcomes import FormedBatch
from api.service import Service
from api.store import make_store
from api.store.base import ItemMeta, QueuedItem, Txn
from api.wire.records import encode_submission
from api.wire.schema import RegisterEnv, Registration
from bench import pg

ENVS = [  # name, group size, weight, min allocation
    ("math", 8, 1.0, None),
    ("code", 16, 0.5, 0.25),
    ("tool", 4, 0.3, None),
    ("chat", 8, 1.0, None),
]
SCENARIOS: dict[str, list[tuple[str, int, float, float | None]]] = {
    "mixed": ENVS,
    "survivor": [("surv", 64, 1.0, None)],
    "no_fill": [("odd", 63, 1.0, None)],
    "survivor_trim": [("surv", 64, 1.0, None)],  # the trainer registered no_exact_fill "trim"
    "no_fill_trim": [("odd", 63, 1.0, None)],
}
_rng = random.Random(0)


def _size(scenario: str, group_size: int) -> int:
    if scenario.startswith("survivor"):  # 64 rollouts, each crashing with probability 2%; groups under 48 not kept
        return max(48, group_size - sum(_rng.random() < 0.02 for _ in range(group_size)))
    return group_size


BATCH_SIZE = 256
PAYLOAD = b"\0" * 256  # payload bytes are moved, never parsed, while forming a batch


async def _setup(url: str, queued: int, scenario: str) -> Service:
    service = Service(make_store(url))
    reg = Registration(
        wandb_group="b",
        wandb_project="b",
        batch_size=BATCH_SIZE,
        max_token_len=4096,
        checkpoint_dir="c",
        save_checkpoint_interval=0,
        starting_step=0,
        num_steps=10**9,
        no_exact_fill="trim" if scenario.endswith("_trim") else "smaller",
    )
    await service.register_trainer(reg)
    await service.batches.next_batch()
    envs = SCENARIOS[scenario]
    for name, size, weight, share in envs:
        await service.register_env(
            RegisterEnv(
                max_token_length=4096, desired_name=name, weight=weight, group_size=size, min_batch_allocation=share
            )
        )

    await top_up(service, queued, scenario)
    if url.startswith("postgresql"):
        # A queue filled by 20 transactions a moment ago has no visibility map and no planner statistics yet;
        # in a run, where the queue grows over minutes, autovacuum has done this long before (7.7 against 4.2
        # ms at 100k queued, measured without it).
        with psycopg.connect(url, autocommit=True, options="-c search_path=rollbuf") as conn:
            conn.execute("VACUUM ANALYZE")
    return service


def _fill(txn: Txn, per_env: int, scenario: str) -> None:
    for _ in range(per_env):
        for env_id, (_, group_size, _, _) in enumerate(SCENARIOS[scenario]):
            seqs = _size(scenario, group_size)
            meta = ItemMeta(txn.next_item_id(), seqs, seqs * 512, 0)
            txn.append(env_id, QueuedItem(meta, 1, _record(seqs) if scenario.endswith("_trim") else PAYLOAD))


@functools.cache
def _record(seqs: int) -> bytes:
    """A stored group of `seqs` sequences: "trim" decodes the group it cuts (every other scenario moves bytes)."""
    rows = [[1] * 8] * seqs
    return encode_submission(rows, rows, [0.0] * seqs, env_id=0, policy_step=0)


async def top_up(service: Service, queued: int, scenario: str = "mixed") -> None:
    """Bring every env's queue to queued/len(envs) groups, so each measured batch sees the same queue length."""
    n_envs = len(SCENARIOS[scenario])
    counts = await service.store.transact(lambda t: t.counts())
    target = queued // n_envs
    missing = target - min((counts[e].groups if e in counts else 0) for e in range(n_envs))
    chunk = 5_000
    for start in range(0, max(0, missing), chunk):
        n = min(chunk, missing - start)
        await service.store.transact(lambda t, n=n: _fill(t, n, scenario))


async def _measure(url: str, queued: int, reps: int, scenario: str) -> dict[str, Any]:
    service = await _setup(url, queued, scenario)
    try:
        times = []
        formed = exact = 0
        for _ in range(reps):
            t0 = time.perf_counter()
            result = await service.batches.next_batch()
            times.append(time.perf_counter() - t0)
            if isinstance(result, FormedBatch):
                formed += 1
                exact += result.seqs == BATCH_SIZE
            if scenario == "mixed":
                assert isinstance(result, FormedBatch) and result.seqs == BATCH_SIZE
            await top_up(service, queued, scenario)
        return {
            "scenario": scenario,
            "queued_groups": queued,
            "formed": formed,
            "exact": exact,
            "reps": reps,
            "median_ms": round(statistics.median(times) * 1e3, 2),
            "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 2),
        }
    finally:
        await service.store.close()


def run(
    sizes: tuple[int, ...] = (100, 10_000, 100_000),
    reps: int = 20,
    scenarios: tuple[str, ...] = tuple(SCENARIOS),
    backends: tuple[str, ...] = ("memory", "sqlite", "postgresql"),
) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            if backend == "postgresql" and not pg.available():
                continue
            for scenario in scenarios:
                for queued in sizes:
                    with contextlib.ExitStack() as stack:
                        if backend == "postgresql":
                            url = stack.enter_context(pg.database())
                        else:
                            db = Path(tmp) / f"f{scenario}{queued}.db"
                            url = "memory://" if backend == "memory" else f"sqlite:///{db}"
                        result = asyncio.run(_measure(url, queued, reps, scenario))
                        out.append({"bench": "formation", "store": backend, **result})
    return out
