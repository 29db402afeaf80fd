"""api.batches.formation reads the run state it needs once per transaction and writes what changed once, at its
end (`state.Unit`): counted on the memory store's value reads and writes, per transaction, over batches formed
in both acknowledge modes, looked for further in the queue, waited for, and refused (no batch can be formed)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from api.batches import formation
from api.batches import service as batches_flow
from api.batches.outcomes import BatchWaiting, FormedBatch
from api.run import state
from api.service import Service
from api.store import make_store
from api.store.base import ItemMeta, QueuedItem, Txn
from api.store.memory import MemoryTxn
from api.wire.records import encode_submission
from api.wire.schema import RegisterEnv, Registration

FORMATION_KEYS = {
    k.name for k in (state.STEP, state.KEPT, state.CREDITS, state.BLOCKED, state.PASSED, state.QUIET, state.AWAITING)
} | {state.RUN_KEY, state.ENV_DIR_KEY}


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, str]]]:
    """("get" or "set", key): how often the store's values were read or written inside `batch_txn` (the rest of
    the /batch transaction, the producers' report read while waiting, is not formation's)."""
    calls: Counter[tuple[str, str]] = Counter()
    inside = [False]
    get, put = MemoryTxn.get_value, MemoryTxn.set_value

    def get_value(self: MemoryTxn, key: str) -> str | None:
        calls["get", key] += inside[0]
        return get(self, key)

    def set_value(self: MemoryTxn, key: str, value: str) -> None:
        calls["set", key] += inside[0]
        put(self, key, value)

    def batch_txn(*args: Any, **kwargs: Any) -> FormedBatch | BatchWaiting:
        inside[0] = True
        try:
            return formation.batch_txn(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(MemoryTxn, "get_value", get_value)
    monkeypatch.setattr(MemoryTxn, "set_value", set_value)
    monkeypatch.setattr(batches_flow, "batch_txn", batch_txn)
    yield calls


def _fill(txn: Txn, sizes: tuple[int, ...], n: int) -> None:
    for _ in range(n):
        for env_id, size in enumerate(sizes):
            rows = [[1] * 8] * size  # a stored group: "trim" cuts one
            record = encode_submission(rows, rows, [0.0] * size, env_id=env_id, policy_step=0)
            txn.append(env_id, QueuedItem(ItemMeta(txn.next_item_id(), size, size * 8, 0), 1, record))


async def _batches(
    sizes: tuple[int, ...], no_exact_fill: str, by_step: bool, calls: Counter[tuple[str, str]]
) -> list[str]:
    service = Service(make_store("memory://"))
    try:
        reg = Registration(
            wandb_group="g",
            wandb_project="p",
            batch_size=16,
            max_token_len=4096,
            checkpoint_dir="c",
            save_checkpoint_interval=0,
            starting_step=0,
            num_steps=1000,
            no_exact_fill=no_exact_fill,
        )  # type: ignore[arg-type]
        await service.register_trainer(reg)
        await service.batches.next_batch()
        for i, size in enumerate(sizes):
            share = 0.25 if i == 0 else None
            await service.register_env(
                RegisterEnv(
                    max_token_length=4096, desired_name=f"e{i}", weight=1.0, group_size=size, min_batch_allocation=share
                )
            )
        await service.store.transact(lambda t: _fill(t, sizes, 6))
        outcomes, step = [], 0
        for _ in range(8):
            calls.clear()
            got = await (service.batches.next_batch(step) if by_step else service.batches.next_batch())
            step += isinstance(got, FormedBatch)
            outcomes.append(type(got).__name__)
            for (op, key), n in calls.items():
                assert key not in FORMATION_KEYS or n == 1, f"{op} {key} {n} times in one transaction"
        return outcomes
    finally:
        await service.store.close()


@pytest.mark.parametrize("by_step", [True, False], ids=["commit-by-step", "next"])
@pytest.mark.parametrize(
    ("sizes", "no_exact_fill"), [((4, 8), "smaller"), ((6, 10), "smaller"), ((6,), "wait"), ((6,), "trim")]
)
def test_formation_reads_and_writes_each_run_state_key_at_most_once_per_transaction(
    counted: Counter[tuple[str, str]], sizes: tuple[int, ...], no_exact_fill: str, by_step: bool
) -> None:
    outcomes = asyncio.run(_batches(sizes, no_exact_fill, by_step, counted))
    assert "FormedBatch" in outcomes or no_exact_fill == "wait"
    assert outcomes[-1] == "BatchWaiting"  # the queue ran dry: what no batch formed reads and writes is counted too
