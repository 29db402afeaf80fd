"""Planning a batch with reuse (api/batches/reuse_plan.py) against the size of the replay pool, in process: the
claim is that it stays flat, because each env's candidates are read in its policy's order only as far as the
batch's shares allow.

4 envs (group sizes 8/16/4/8, weights 1/0.5/0.3/1), batches of 256 sequences, the fresh queues holding half a
batch (so every batch is filled with reuse, up to `max_reused_share` 0.5), pools of 10k and 100k groups per run,
each env's sorted once in its policy's order as a store's index would hand it over. The planning itself is timed:
reading the pool from a store is not part of it. `plan_batch` over the fresh windows alone (formation without
reuse) is timed beside it for reference.

    python -m bench.replay [--pools 10000 100000] [--reps 200]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

from api.batches.planner import BatchSpec, EnvWindow, plan_batch
from api.batches.reuse_plan import Candidate, ReusePlan, order_key, plan_with_reuse
from api.store.items import ItemMeta
from api.wire.replay import ReusePolicy

ENVS = [(8, 1.0), (16, 0.5), (4, 0.3), (8, 1.0)]  # group size, weight
BATCH = 256
STEP = 1000
POLICY = ReusePolicy(max_served=4, max_age=100, max_reused_share=0.5, order="advantage")


def scenario(pool_size: int, seed: int = 0) -> tuple[list[EnvWindow], dict[int, list[Candidate]]]:
    rng = random.Random(seed)
    ids = itertools.count(1)
    pools: dict[int, list[Candidate]] = {e: [] for e in range(len(ENVS))}
    for _ in range(pool_size):
        env = rng.randrange(len(ENVS))
        size = ENVS[env][0]
        spread = rng.choice([0.0, 0.5, 1.0])
        meta = ItemMeta(next(ids), size, size * 512, STEP - rng.randrange(0, 150))
        pools[env].append(Candidate(meta, rng.randint(1, 4), spread * rng.random(), spread))
    for pool in pools.values():
        pool.sort(key=lambda c: order_key(POLICY.order, c))
    windows = []
    for env, (size, weight) in enumerate(ENVS):
        fresh = [ItemMeta(next(ids), size, size * 512, STEP) for _ in range(BATCH // 2 // len(ENVS) // size)]
        windows.append(EnvWindow(env, f"env{env}", weight, 0.0, fresh))
    return windows, pools


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `fn` over `reps` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    spec = BatchSpec(BATCH)
    policies = dict.fromkeys(range(len(ENVS)), POLICY)
    medians = {}
    for size in args.pools:
        windows, pools = scenario(size)
        plan = plan_with_reuse(windows, spec, {}, pools, policies, 0.5, STEP)
        assert isinstance(plan, ReusePlan) and plan.plan.seqs == BATCH and plan.reused, "every batch reuses"
        medians[size] = timed(
            lambda w=windows, p=pools: plan_with_reuse(w, spec, {}, p, policies, 0.5, STEP), args.reps
        )
        fresh = timed(lambda w=windows: plan_batch(w, spec, {}), args.reps)
        reused = sum(1 for _ in plan.reused)
        print(
            f"pool {size:>7} groups: plan with reuse {medians[size]:.3f} ms (median of {args.reps}; "
            f"{reused} groups reused, {plan.plan.seqs} sequences), fresh windows alone {fresh:.3f} ms"
        )
    if len(medians) > 1:
        small, large = min(medians), max(medians)
        print(f"{large} / {small}: {medians[large] / medians[small]:.2f}x")


if __name__ == "__main__":
    main()
