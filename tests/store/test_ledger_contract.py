"""What every backend promises of its ledger (`txn.ledger`, api/store/ledger_contract.py), run against each of
them: rows written and decided with their transaction, read back alike whether stored or still in a backend's
write-back cache, and the retained payloads; the memory store is the reference twin of the SQL ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.store import Store
from api.store.base import (
    DROPPED,
    HELD,
    QUEUED,
    SERVED,
    HeldGroup,
    ItemMeta,
    KeptPayload,
    LedgerGroup,
    LedgerStep,
    QueuedItem,
    Txn,
)
from api.store.memory import MemoryStore
from tests.store.test_contract import item

pytestmark = pytest.mark.anyio


def ledger_row(
    item_id: int, *, env_id: int = 0, group_id: str | None = None, fate: str = QUEUED, producer_id: str | None = None
) -> LedgerGroup:
    return LedgerGroup(
        id=item_id,
        env_id=env_id,
        group_id=group_id,
        handler="h",
        acked_at=100.0 + item_id,
        policy_step=3,
        seqs=4,
        tokens=40,
        bytes=len(f"payload-{item_id}"),
        score_mean=0.5,
        score_min=0.0,
        score_max=1.0,
        score_std=0.5,
        fate=fate,
        producer_id=producer_id,
    )


async def queued_with_rows(
    store: Store, n: int, group_ids: list[str | None] | None = None, producers: list[str | None] | None = None
) -> list[int]:
    """Queue n items on env 0 with their ledger rows, in one transaction (as ingest does)."""

    def fn(txn: Txn) -> list[int]:
        ids = []
        rows = []
        for k in range(n):
            it = item(txn)
            txn.append(0, it)
            ids.append(it.meta.item_id)
            gid, producer = None if group_ids is None else group_ids[k], None if producers is None else producers[k]
            rows.append(ledger_row(it.meta.item_id, group_id=gid, producer_id=producer))
        txn.ledger.add(rows)
        return ids

    return await store.transact(fn)


async def test_ledger_rows_are_written_and_decided_with_their_transaction(store: Store) -> None:
    ids = await queued_with_rows(store, 4, ["g0", "g\x00nul", None, "g0"])
    rows = await store.read(lambda t: t.ledger.groups([ids[2], ids[0], 10**9]))
    assert rows == [ledger_row(ids[2]), ledger_row(ids[0], group_id="g0")]

    def serve(txn: Txn) -> None:
        txn.pop(0, ids[:2], keep_for=7)
        txn.ledger.decide(ids[:2], SERVED, step=7, at=5.0)
        txn.ledger.decide([10**9], DROPPED, reason="nothing there")  # absent: skipped
        txn.ledger.put_step(LedgerStep(7, 5.0, 0.01, (ids[1], ids[0]), 8, 80, {"math": 2}, {"math": 8}, {0: 1, 4: 1}))
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        await store.transact(serve)
    assert [r.fate for r in await store.read(lambda t: t.ledger.groups(ids))] == [QUEUED] * 4
    assert await store.read(lambda t: t.ledger.steps(0, 100)) == []

    def serve_for_real(txn: Txn) -> None:
        txn.pop(0, ids[:2], keep_for=7)
        txn.ledger.decide(ids[:2], SERVED, step=7, at=5.0)
        txn.ledger.put_step(LedgerStep(7, 5.0, 0.01, (ids[1], ids[0]), 8, 80, {"math": 2}, {"math": 8}, {0: 1, 4: 1}))
        txn.pop(0, [ids[2]])
        txn.ledger.decide([ids[2]], DROPPED, step=7, reason="stale", at=6.0)

    await store.transact(serve_for_real)
    got = {r.id: r for r in await store.read(lambda t: t.ledger.groups(ids))}
    assert (got[ids[0]].fate, got[ids[0]].step, got[ids[0]].decided_at) == (SERVED, 7, 5.0)
    assert (got[ids[2]].fate, got[ids[2]].reason, got[ids[2]].step) == (DROPPED, "stale", 7)
    assert got[ids[3]].fate == QUEUED
    assert [r.id for r in await store.read(lambda t: t.ledger.named("g0"))] == [ids[0], ids[3]]
    assert [r.id for r in await store.read(lambda t: t.ledger.named("g\x00nul"))] == [ids[1]]
    assert await store.read(lambda t: t.ledger.named("nope")) == []
    (step,) = await store.read(lambda t: t.ledger.steps(7, 7))
    assert step == LedgerStep(7, 5.0, 0.01, (ids[1], ids[0]), 8, 80, {"math": 2}, {"math": 8}, {0: 1, 4: 1})
    await store.transact(lambda t: t.ledger.committed(0, 7, 9.0))
    assert (await store.read(lambda t: t.ledger.steps(7, 7)))[0].committed_at is None
    await store.transact(lambda t: t.ledger.committed(7, 8, 9.0))
    await store.transact(lambda t: t.ledger.committed(7, 8, 10.0))  # marked once
    assert (await store.read(lambda t: t.ledger.steps(0, 10)))[0].committed_at == 9.0


async def test_ledger_rows_keep_the_producer_that_made_each_group(store: Store) -> None:
    ids = await queued_with_rows(store, 3, producers=["host-1-a1b2c3", None, "h\u00e9te 2"])
    assert [r.producer_id for r in await store.read(lambda t: t.ledger.groups(ids))] == [
        "host-1-a1b2c3",
        None,
        "h\u00e9te 2",
    ]

    def serve(txn: Txn) -> None:
        txn.pop(0, ids[:2], keep_for=1)
        txn.ledger.decide(ids[:2], SERVED, step=1, at=5.0)

    await store.transact(serve)
    got = {r.id: r for r in await store.read(lambda t: t.ledger.scan(-1, 10))}
    assert got[ids[0]] == replace(ledger_row(ids[0], producer_id="host-1-a1b2c3"), fate=SERVED, step=1, decided_at=5.0)
    assert (got[ids[1]].producer_id, got[ids[2]].producer_id) == (None, "h\u00e9te 2")


async def test_ledger_rows_keep_the_resumed_slots_and_the_tokens_they_saved(store: Store) -> None:
    """`resumed` (a JSON list in the SQL stores' text column) and `tokens_saved` read back as written, through a
    decision and a requeue, and a row without them as null (the rows from before the column)."""
    ids = await queued_with_rows(store, 3)
    resumed = {ids[0]: ((0, 2, 17), 12_345_678_901), ids[1]: ((3,), 0)}

    def add(txn: Txn) -> None:
        txn.ledger.add(
            [replace(ledger_row(i), id=i + 1000, resumed=s, tokens_saved=n) for i, (s, n) in resumed.items()]
        )

    await store.transact(add)
    moved = [i + 1000 for i in resumed]
    got = await store.read(lambda t: t.ledger.groups([*moved, ids[2]]))
    assert [(r.resumed, r.tokens_saved) for r in got] == [*resumed.values(), (None, None)]
    await store.transact(lambda t: t.ledger.decide(moved[:1], DROPPED, step=1, reason="stale", at=5.0))
    await store.transact(lambda t: t.ledger.requeue(moved[1], 5000))
    got = {r.id: r for r in await store.read(lambda t: t.ledger.scan(-1, 100))}
    assert (got[moved[0]].fate, got[moved[0]].resumed, got[moved[0]].tokens_saved) == (
        DROPPED,
        (0, 2, 17),
        12_345_678_901,
    )
    assert (got[5000].resumed, got[5000].tokens_saved) == ((3,), 0)


async def test_ledger_scan_pages_by_id(store: Store) -> None:
    ids = await queued_with_rows(store, 7)
    more = await queued_with_rows(store, 3)  # another transaction: on PostgreSQL, maybe the same group
    seen: list[int] = []
    after = -1
    while page := await store.read(lambda t, after=after: t.ledger.scan(after, 3)):  # type: ignore[misc]
        assert len(page) <= 3
        seen += [r.id for r in page]
        after = page[-1].id
    assert seen == ids + more


async def test_a_released_groups_row_moves_to_its_queue_id(store: Store) -> None:
    def hold(txn: Txn) -> int:
        meta = ItemMeta(txn.next_item_id(), 2, 20, 0)
        txn.held.add(0, HeldGroup(meta, 1.0, b"held"))
        txn.ledger.add([ledger_row(meta.item_id, fate=HELD)])
        return meta.item_id

    held_id = await store.transact(hold)

    def release(txn: Txn) -> int:
        (g,) = txn.held.release(0, [held_id])
        new = ItemMeta(txn.next_item_id(), g.meta.seqs, g.meta.tokens, g.meta.policy_step)
        txn.append(0, QueuedItem(new, 1, g.payload))
        txn.ledger.requeue(held_id, new.item_id)
        return new.item_id

    new_id = await store.transact(release)
    assert await store.read(lambda t: t.ledger.groups([held_id])) == []
    (row,) = await store.read(lambda t: t.ledger.groups([new_id]))
    assert (row.id, row.fate, row.acked_at) == (new_id, QUEUED, 100.0 + held_id)


async def test_retained_payloads_outlive_their_queue_and_batch_until_pruned(store: Store) -> None:
    ids = await queued_with_rows(store, 4)

    def decide(txn: Txn) -> None:
        txn.pop(0, [ids[0]], keep_for=1)
        txn.put_batch(1, b"batch-1", [ids[0]])
        txn.ledger.decide([ids[0]], SERVED, step=1, at=1.0, kept=True)
        txn.pop(0, [ids[1]], retain=True)
        txn.ledger.decide([ids[1]], DROPPED, step=1, reason="stale", at=1.0, kept=True)
        txn.pop(0, [ids[2]])  # not retained
        txn.ledger.decide([ids[2]], SERVED, step=2, at=1.0)
        dropped = txn.next_item_id()
        txn.ledger.add([ledger_row(dropped)])
        txn.ledger.decide([dropped], DROPPED, step=3, reason="zero_variance", at=1.0, kept=True)
        txn.ledger.keep_payloads([(dropped, b"dropped-at-ingest")])

    await store.transact(decide)
    await store.transact(lambda t: t.drop_batches_before(2, retain=True))
    assert await store.read(lambda t: t.get_batch(1)) is None
    kept = await store.read(lambda t: t.ledger.kept_payloads([*ids[:3], ids[3] + 1]))
    assert kept == {
        ids[0]: f"payload-{ids[0]}".encode(),
        ids[1]: f"payload-{ids[1]}".encode(),
        ids[3] + 1: b"dropped-at-ingest",
    }
    oldest = await store.read(lambda t: t.ledger.kept_oldest(10))
    assert [(k.id, k.step) for k in oldest] == [(ids[0], 1), (ids[1], 1), (ids[3] + 1, 3)]
    assert oldest[0].bytes == len(f"payload-{ids[0]}")
    # the ledger's own pruning leaves rows whose payload is retained, and open fates
    assert await store.transact(lambda t: t.ledger.prune(10**9, 10**9)) == 1  # ids[2]: served, not kept
    await store.transact(lambda t: t.ledger.prune_payloads([ids[0], ids[3] + 1]))
    assert await store.read(lambda t: t.ledger.kept_payloads([ids[0], ids[1], ids[3] + 1])) == {
        ids[1]: f"payload-{ids[1]}".encode()
    }
    assert [k.id for k in await store.read(lambda t: t.ledger.kept_oldest(10))] == [ids[1]]
    assert await store.transact(lambda t: t.ledger.prune(10**9, 10**9)) == 2
    assert [r.id for r in await store.read(lambda t: t.ledger.scan(-1, 10))] == [ids[1], ids[3]]
    await store.transact(lambda t: t.clear())
    assert await store.read(lambda t: t.ledger.scan(-1, 10)) == []
    assert await store.read(lambda t: t.ledger.kept_payloads([ids[1]])) == {}


View = tuple[
    list[LedgerGroup], list[LedgerGroup], list[LedgerGroup], list[LedgerGroup], list[LedgerStep], list[KeptPayload]
]


def view(t: Txn) -> View:
    """Every read of the ledger, over all of it."""
    return (
        t.ledger.scan(-1, 1000),
        t.ledger.named("a"),
        t.ledger.named("b"),
        t.ledger.dropped(0, 100, 1000),
        t.ledger.steps(0, 100),
        t.ledger.kept_oldest(1000),
    )


async def test_a_transaction_reads_its_own_ledger_writes(store: Store) -> None:
    """Rows added, decided and moved by the transaction reading them, step rows and commit marks included, read
    as they will be stored (PostgreSQL holds them in its write-back cache until the COMMIT)."""
    stored = await queued_with_rows(store, 3, ["a", "b", None])

    def fn(txn: Txn) -> tuple[list[int], View, dict[int, bytes]]:
        fresh = [item(txn) for _ in range(3)]
        for it in fresh:
            txn.append(0, it)
        ids = [it.meta.item_id for it in fresh]
        txn.ledger.add([ledger_row(ids[0], group_id="a"), ledger_row(ids[1], group_id="b"), ledger_row(ids[2])])
        txn.pop(0, [stored[0], ids[0]], keep_for=4)
        txn.put_batch(4, b"header", [stored[0], ids[0]])
        txn.ledger.decide([stored[0], ids[0]], SERVED, step=4, at=2.0, kept=True)
        txn.pop(0, [stored[1], ids[1]], retain=True)
        txn.ledger.decide([stored[1], ids[1]], DROPPED, step=4, reason="stale", at=2.0, kept=True)
        txn.ledger.put_step(LedgerStep(4, 2.0, 0.1, (stored[0], ids[0]), 8, 80, {"m": 2}, {"m": 8}, {0: 2}))
        txn.ledger.committed(4, 5, 3.0)
        new = txn.next_item_id()
        txn.ledger.requeue(ids[2], new)
        txn.ledger.requeue(stored[2], new + 1)
        return ids, view(txn), txn.ledger.kept_payloads([stored[0], stored[1], ids[0], ids[1]])

    ids, inside, payloads = await store.transact(fn)
    assert inside == await store.read(view)
    assert payloads == await store.read(lambda t: t.ledger.kept_payloads([stored[0], stored[1], ids[0], ids[1]]))
    scan, named_a, named_b, dropped, steps, kept = inside
    assert [r.id for r in named_a] == [stored[0], ids[0]] and {r.fate for r in named_a} == {SERVED}
    assert [r.id for r in named_b] == [stored[1], ids[1]]
    assert [(r.id, r.reason) for r in dropped] == [(stored[1], "stale"), (ids[1], "stale")]
    assert [s.committed_at for s in steps] == [3.0]
    assert [k.id for k in kept] == sorted([stored[0], stored[1], ids[0], ids[1]])
    assert set(payloads) == {stored[0], stored[1], ids[0], ids[1]}
    assert [r.id for r in scan][-2:] == [ids[2] + 1, ids[2] + 2]


OPS = st.lists(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 4)),
            st.tuples(st.just("decide"), st.integers(0, 50), st.sampled_from([SERVED, DROPPED]), st.booleans()),
            st.tuples(st.just("step"), st.integers(0, 3)),
            st.tuples(st.just("committed"), st.integers(0, 6), st.integers(0, 3)),
            st.tuples(st.just("requeue"), st.integers(0, 50)),
            st.tuples(st.just("unkeep"), st.integers(0, 50)),
        ),
        min_size=1,
        max_size=5,
    ),
    max_size=6,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(txns=OPS, prune=st.tuples(st.integers(0, 20), st.integers(0, 8)))
async def test_every_backend_answers_as_the_memory_twin(
    store: Store, txns: list[list[tuple[object, ...]]], prune: tuple[int, int]
) -> None:
    """The same writes, in the same transactions, read back alike from this backend and the memory store (the
    reference twin), inside each transaction and after it; then one prune forgets the same rows."""
    twin = MemoryStore()
    await store.transact(lambda t: t.clear())
    base = await store.transact(lambda t: t.next_item_id())
    ids: list[int] = []
    step = [0]

    def apply(ops: list[tuple[object, ...]]) -> Callable[[Txn], View]:
        def fn(t: Txn) -> View:
            for op in ops:
                pick = ids[int(op[1]) % len(ids)] if len(op) > 1 and ids and op[0] != "add" else None  # type: ignore[arg-type]
                if op[0] == "add":
                    fresh = [base + 1 + len(ids) + k for k in range(int(op[1]))]  # type: ignore[call-overload]
                    t.ledger.add([ledger_row(i, group_id="ab"[i % 2] if i % 3 else None) for i in fresh])
                    ids.extend(fresh)
                elif op[0] == "decide" and pick is not None:
                    chosen = ids[ids.index(pick) :: 2]
                    t.ledger.decide(chosen, str(op[2]), step=step[0], reason="r", at=1.0, kept=bool(op[3]))
                elif op[0] == "step":
                    step[0] += 1 + int(op[1])  # type: ignore[call-overload]
                    t.ledger.put_step(LedgerStep(step[0], 1.0, 0.1, tuple(ids[-2:]), 2, 20, {"m": 1}, {"m": 2}, {}))
                elif op[0] == "committed":  # the contract's range: steps already put (formed before acknowledged)
                    first = min(int(op[1]), step[0] + 1)  # type: ignore[call-overload]
                    t.ledger.committed(first, min(first + int(op[2]), step[0] + 1), 2.0 + len(ids))  # type: ignore[call-overload]
                elif op[0] == "requeue" and pick is not None:
                    new = base + 1 + len(ids)
                    t.ledger.requeue(pick, new)
                    ids[ids.index(pick)] = new
                    ids.append(new)  # keeps fresh ids unique; the old id reads as absent
                elif op[0] == "unkeep" and pick is not None:
                    t.ledger.prune_payloads([pick])
            return view(t)

        return fn

    for ops in txns:
        snapshot = list(ids), step[0]
        inside = await twin.transact(apply(ops))
        ids[:], step[0] = snapshot
        assert await store.transact(apply(ops)) == inside
        assert await store.read(view) == inside
    below_id, below_step = base + 1 + prune[0], prune[1]
    assert await store.transact(lambda t: t.ledger.prune(below_id, below_step)) == await twin.transact(
        lambda t: t.ledger.prune(below_id, below_step)
    )
    assert await store.read(view) == await twin.read(view)
