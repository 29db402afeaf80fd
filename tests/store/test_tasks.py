"""What every backend promises for the task tables (api/store/tasks.py), and the lease logic
(api/tasks/leases.py, fates.py) run through each of them: rows, the front, expiry, the ledger hooks, rollback, clear."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from api.store import Store
from api.store.base import DROPPED, QUEUED, SERVED, LedgerGroup, LedgerStep, Txn
from api.store.tasks import FRONT, LEASED, TaskRow
from api.tasks import fates as task_fates
from api.tasks import leases as tl
from api.tasks.records import Dataset

pytestmark = pytest.mark.anyio


def dataset(name: str = "math", **kw: object) -> Dataset:
    return Dataset(name=name, **kw)  # type: ignore[arg-type]


async def registered(store: Store, n: int = 10, **kw: object) -> None:
    def fn(txn: Txn) -> None:
        tl.register(txn, dataset(sealed=False, **kw))  # type: ignore[arg-type]
        tl.add_tasks(txn, "math", 0, [json.dumps({"q": i}) for i in range(n)], last=True)

    await store.transact(fn)


def ledger_row(id: int, group_id: str, fate: str = QUEUED, reason: str | None = None) -> LedgerGroup:
    return LedgerGroup(
        id=id,
        env_id=0,
        group_id=group_id,
        handler=None,
        acked_at=1.0,
        policy_step=0,
        seqs=4,
        tokens=40,
        bytes=100,
        score_mean=0.5,
        score_min=0.0,
        score_max=1.0,
        score_std=0.5,
        fate=fate,
        reason=reason,
    )


async def test_task_sizes_are_bytes_as_stored(store: Store) -> None:
    tasks = ['{"q":"a"}', '{"q":"\u00e9\u4e2d"}', "null"]
    await store.transact(lambda txn: (txn.tasks.put_dataset("s", "{}"), txn.tasks.add_tasks("s", 0, tasks)))
    sizes = await store.read(lambda txn: txn.tasks.task_sizes("s", [0, 1, 2, 7]))
    assert sizes == {i: len(t.encode()) for i, t in enumerate(tasks)}

    def within(max_bytes: int) -> Callable[[Txn], tuple[int, dict[int, str]]]:
        return lambda txn: txn.tasks.tasks_within("s", [1, 0, 7, 2], max_bytes)  # 13, 9, missing (4), 4 bytes

    got = [await store.read(within(b)) for b in (1, 22, 26, 30)]
    assert got == [
        (1, {1: tasks[1]}),
        (2, {1: tasks[1], 0: tasks[0]}),
        (3, {1: tasks[1], 0: tasks[0]}),
        (4, dict(enumerate(tasks))),
    ], got


async def test_rows_front_expiry_and_ledger_index(store: Store) -> None:
    def fn(txn: Txn) -> None:
        t = txn.tasks
        t.put_dataset("a", "{}")
        t.add_tasks("a", 0, ['{"x":0}', '{"x":1}'])
        assert t.task_data("a", [0, 1, 5]) == {0: '{"x":0}', 1: '{"x":1}'}
        rows = [
            TaskRow("a", 0, 0, LEASED, 1, "p", 5.0, updated_at=1.0),
            TaskRow("a", 0, 1, LEASED, 1, "p", 3.0, updated_at=1.0),
            TaskRow("a", 0, 2, FRONT, 2, seq=7),
            TaskRow("a", 0, 3, FRONT, 1, seq=4),
            TaskRow("a", 1, 0, "submitted", 1, ledger_id=42),
        ]
        t.put_rows(rows)
        assert [r.index for r in t.expired("a", 4.0, 10)] == [1]
        assert [r.index for r in t.expired("a", 9.0, 10)] == [1, 0]
        assert [r.index for r in t.front("a", 10)] == [3, 2]
        assert t.by_ledger([42, 43]) == [rows[4]]
        t.put_rows([TaskRow("a", 0, 3, LEASED, 2, "q", 9.0)])  # off the front
        assert [r.index for r in t.front("a", 10)] == [2]
        assert [(r.epoch, r.index) for r in t.scan("a", (0, 1), 10)] == [(0, 2), (0, 3), (1, 0)]
        assert t.rows("a", [(0, 0), (5, 5)]) == {(0, 0): rows[0]}
        assert t.dataset_names() == ["a"]

    await store.transact(fn)


async def test_a_failed_transaction_leaves_the_tasks_as_they_were(store: Store) -> None:
    await registered(store)

    def fails(txn: Txn) -> None:
        tl.lease(txn, "math", "p", 3, 1.0, 10.0, 100)
        raise RuntimeError("undone")

    with pytest.raises(RuntimeError):
        await store.transact(fails)
    leases = await store.transact(lambda txn: tl.lease(txn, "math", "p", 3, 1.0, 10.0, 100))
    assert [x.index for x in leases] == [0, 1, 2]
    assert json.loads(leases[0].data) == {"q": 0}


async def test_leases_expire_to_the_front_and_fates_follow_the_ledger(store: Store) -> None:
    await registered(store, n=4, max_retries=1)
    a = await store.transact(lambda txn: tl.lease(txn, "math", "p1", 2, 0.0, 10.0, 100))
    assert await store.transact(lambda txn: tl.heartbeat(txn, [a[0].token], 5.0, 10.0)) == {a[0].token: 15.0}
    b = await store.transact(lambda txn: tl.lease(txn, "math", "p2", 1, 12.0, 10.0, 100))
    assert [x.index for x in b] == [1], "the expired lease comes back first"
    assert await store.transact(lambda txn: tl.heartbeat(txn, [a[1].token], 12.0, 10.0)) == {a[1].token: None}

    def acked(txn: Txn) -> None:
        task_fates.on_acknowledged(txn, [ledger_row(7, a[0].token), ledger_row(8, b[0].token)])

    await store.transact(acked)
    await store.transact(lambda txn: task_fates.on_decided(txn, [7], SERVED, step=3, reason=None, now=13.0))
    await store.transact(lambda txn: task_fates.on_decided(txn, [8], DROPPED, step=3, reason="stale", now=13.0))
    served = await store.transact(lambda txn: txn.tasks.rows("math", [(0, 0)]))
    assert (served[0, 0].state, served[0, 0].step) == ("served", 3), "served until the trainer acknowledges step 3"
    again = await store.transact(lambda txn: tl.lease(txn, "math", "p3", 1, 14.0, 10.0, 100))
    assert [x.index for x in again] == [1], "a drop is retried (max_retries=1) before the cursor moves"
    await store.transact(
        lambda txn: task_fates.on_acknowledged(txn, [ledger_row(9, again[0].token, DROPPED, "filter")])
    )

    def acknowledged(txn: Txn) -> None:  # step 3 formed of group 7, then the trainer acknowledges steps 0 to 3
        txn.ledger.put_step(LedgerStep(3, 13.0, 0.0, (7,), 4, 40, {}, {}, {}))
        task_fates.on_trained(txn, 0, 4, 15.0)

    await store.transact(acknowledged)
    d = Dataset.of(str(await store.transact(lambda txn: txn.tasks.get_dataset("math"))))
    assert {k: v for k, v in d.counts.items() if v} == {"trained": 1, "dropped": 1, "expired": 1, "retried": 1}
    rows = await store.transact(lambda txn: txn.tasks.rows("math", [(0, 0), (0, 1)]))
    assert (rows[0, 0].state, rows[0, 0].step, rows[0, 0].ledger_id, rows[0, 0].updated_at) == ("trained", 3, 7, 15.0)
    assert (rows[0, 1].state, rows[0, 1].reason, rows[0, 1].retries) == ("dropped", "filter", 1)


async def test_epochs_wait_for_the_last_leases_and_clear_forgets(store: Store) -> None:
    await registered(store, n=2, epochs=2, order="shuffled", seed=3)
    first = await store.transact(lambda txn: tl.lease(txn, "math", "p", 5, 0.0, 10.0, 100))
    assert sorted(x.index for x in first) == [0, 1] and {x.epoch for x in first} == {0}
    assert await store.transact(lambda txn: tl.lease(txn, "math", "p", 5, 1.0, 10.0, 100)) == []
    rows = [ledger_row(i + 1, x.token) for i, x in enumerate(first)]
    await store.transact(lambda txn: task_fates.on_acknowledged(txn, rows))
    second = await store.transact(lambda txn: tl.lease(txn, "math", "p", 5, 2.0, 10.0, 100))
    assert sorted(x.index for x in second) == [0, 1] and {x.epoch for x in second} == {1}
    await store.transact(lambda txn: txn.clear())
    assert await store.transact(lambda txn: txn.tasks.dataset_names()) == []
