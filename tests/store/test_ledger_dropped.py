"""`txn.ledger.dropped` on every backend (the drop-bias monitor's read): dropped rows by step range, by step then
id, bounded, as the transaction sees them (its own writes and rollbacks included), and gone when pruned."""

from __future__ import annotations

import pytest

from api.store import Store
from api.store.base import DROPPED, SERVED, Txn
from tests.store.test_ledger_contract import ledger_row, queued_with_rows

pytestmark = pytest.mark.anyio


async def test_dropped_rows_by_step(store: Store) -> None:
    ids = await queued_with_rows(store, 6)

    def decide(txn: Txn) -> None:
        txn.ledger.decide([ids[0], ids[3]], DROPPED, step=5, reason="stale", at=1.0)
        txn.ledger.decide([ids[1]], DROPPED, step=2, reason="stale", at=1.0)
        txn.ledger.decide([ids[2]], SERVED, step=5, at=1.0)
        dropped_now = 10**6
        txn.ledger.add([ledger_row(dropped_now, fate=DROPPED)])  # dropped at ingest: no step, never listed
        assert [r.id for r in txn.ledger.dropped(0, 10, 10)] == [ids[1], ids[0], ids[3]]  # its own writes

    await store.transact(decide)
    assert [r.id for r in await store.read(lambda t: t.ledger.dropped(0, 10, 10))] == [ids[1], ids[0], ids[3]]
    assert [r.id for r in await store.read(lambda t: t.ledger.dropped(3, 5, 10))] == [ids[0], ids[3]]
    assert [r.id for r in await store.read(lambda t: t.ledger.dropped(0, 10, 2))] == [ids[1], ids[0]]
    assert await store.read(lambda t: t.ledger.dropped(6, 10, 10)) == []
    [row] = await store.read(lambda t: t.ledger.dropped(2, 2, 10))
    assert (row.fate, row.reason, row.step) == (DROPPED, "stale", 2)

    def rolled_back(txn: Txn) -> None:
        txn.ledger.decide([ids[4]], DROPPED, step=3, reason="stale")
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        await store.transact(rolled_back)
    assert [r.id for r in await store.read(lambda t: t.ledger.dropped(3, 3, 10))] == []

    await store.transact(lambda t: t.ledger.prune(ids[1] + 1, -1))  # ids[0], ids[1]: final, pruned
    assert [r.id for r in await store.read(lambda t: t.ledger.dropped(0, 10, 10))] == [ids[3]]
