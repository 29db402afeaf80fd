"""What every backend promises (api/store/base.py), run against each of them."""

from __future__ import annotations

import asyncio
import gc
import itertools
import weakref
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.store import Store, make_store
from api.store.base import (
    HeldGroup,
    HeldMeta,
    ItemMeta,
    QueueCounts,
    QueuedItem,
    Txn,
)

pytestmark = pytest.mark.anyio


def item(txn: Txn, seqs: int = 4, tokens: int = 40, step: int = 0, payload: bytes | None = None) -> QueuedItem:
    meta = ItemMeta(txn.next_item_id(), seqs, tokens, step)
    return QueuedItem(meta, 1, payload if payload is not None else f"payload-{meta.item_id}".encode())


def size(ids: list[int]) -> int:
    """Payload bytes of the items `item` made with these ids."""
    return sum(len(f"payload-{i}") for i in ids)


async def fill(store: Store, env_id: int, n: int) -> list[int]:
    def fn(txn: Txn) -> list[int]:
        out = []
        for _ in range(n):
            it = item(txn)
            txn.append(env_id, it)
            out.append(it.meta.item_id)
        return out

    return await store.transact(fn)


async def test_fifo_per_env_and_counts(store: Store) -> None:
    a = await fill(store, 0, 5)
    b = await fill(store, 1, 3)
    heads = await store.transact(lambda t: ([m.item_id for m in t.head(0)], [m.item_id for m in t.head(1)]))
    assert heads == (a, b)
    counts = await store.transact(lambda t: t.counts())
    assert counts[0] == QueueCounts(5, 5, 20, 200, size(a)) and counts[1] == QueueCounts(3, 3, 12, 120, size(b))


async def test_a_transaction_is_freed_as_its_function_returns(store: Store) -> None:
    """No reference cycle between a transaction and its parts: each ingested group's transaction would
    otherwise be left to the cyclic garbage collector (SQLite: 22 objects per small group, 14 us of
    collections per group at 8 clients)."""
    seen: list[weakref.ref[Txn]] = []

    def fn(txn: Txn) -> None:
        seen.append(weakref.ref(txn))
        txn.append(0, item(txn))
        txn.counts()
        txn.held.counts()
        txn.put_reply("key", "{}")

    enabled = gc.isenabled()
    gc.disable()  # no collection may free it for us
    try:
        await store.transact(fn)
        assert seen[0]() is None, "the transaction outlived its function: a reference cycle holds it"
    finally:
        if enabled:
            gc.enable()


async def test_pop_returns_in_asked_order_and_removes_only_those(store: Store) -> None:
    ids = await fill(store, 0, 6)
    popped = await store.transact(lambda t: t.pop(0, [ids[3], ids[0], ids[4]]))
    assert [p.meta.item_id for p in popped] == [ids[3], ids[0], ids[4]]
    assert [p.payload for p in popped] == [f"payload-{i}".encode() for i in (ids[3], ids[0], ids[4])]
    rest = await store.transact(lambda t: [m.item_id for m in t.head(0)])
    assert rest == [ids[1], ids[2], ids[5]]
    assert (await store.transact(lambda t: t.counts()))[0] == QueueCounts(3, 3, 12, 120, size(rest))
    with pytest.raises(KeyError):
        await store.transact(lambda t: t.pop(0, [ids[0]]))


async def test_head_is_lazy(store: Store) -> None:
    await fill(store, 0, 3000)
    first = await store.transact(lambda t: [m.item_id for m in itertools.islice(t.head(0), 2)])
    assert len(first) == 2


async def test_failed_transaction_leaves_no_trace(store: Store) -> None:
    ids = await fill(store, 0, 3)

    def fn(txn: Txn) -> None:
        txn.append(0, item(txn))
        txn.append(7, item(txn))
        txn.pop(0, [ids[1]])
        txn.pop(0, [ids[2]], keep_for=3)
        txn.set_value("k", "v")
        txn.held.add(0, HeldGroup(ItemMeta(txn.next_item_id(), 2, 20, 0), 1.0, b"x"))
        txn.put_reply("key", "reply")
        txn.put_batch(3, b"batch", [ids[2]])
        txn.put_env(0, "math", 1, "{}")
        txn.add_counts("received", {"math_0": 2})
        txn.clear()
        txn.set_value("after-clear", "1")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await store.transact(fn)

    def snapshot(t: Txn) -> tuple[object, ...]:
        return (
            [m.item_id for m in t.head(0)],
            list(t.head(7)),
            t.counts(),
            t.get_value("k"),
            t.get_value("after-clear"),
            t.held.groups(0),
            t.held.counts(),
            t.get_reply("key"),
            t.get_batch(3),
            t.envs_since(-1),
            t.get_counts("received"),
        )

    counts = {0: QueueCounts(3, 3, 12, 120, size(ids))}
    assert await store.transact(snapshot) == (ids, [], counts, None, None, [], {}, None, None, [], {})


async def test_a_value_deleted_is_gone_and_a_failed_delete_leaves_it(store: Store) -> None:
    def write(t: Txn) -> None:
        for key in ("a", "b", "c"):
            t.set_value(key, key)
        t.delete_value("a")
        t.delete_value("never-set")

    await store.transact(write)
    assert await store.read(lambda t: [t.get_value(k) for k in ("a", "b", "c")]) == [None, "b", "c"]

    def deleted_then_refused(t: Txn) -> None:
        t.delete_value("b")
        assert t.get_value("b") is None
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError):
        await store.transact(deleted_then_refused)
    await store.transact(lambda t: (t.delete_value("c"), t.set_value("c", "again")))
    assert await store.read(lambda t: [t.get_value(k) for k in ("a", "b", "c")]) == [None, "b", "again"]


async def test_values_replies_batches_round_trip(store: Store) -> None:
    def write(t: Txn) -> None:
        t.set_value("k", "v1")
        t.set_value("k", "v2")
        t.put_reply("r", '{"status": "received"}')
        for step in range(5):
            t.put_batch(step, f"batch{step}".encode(), [])
        t.drop_batches_before(3)

    await store.transact(write)
    got = await store.transact(lambda t: (t.get_value("k"), t.get_reply("r"), [t.get_batch(s) for s in range(5)]))
    assert got == ("v2", '{"status": "received"}', [None, None, None, b"batch3", b"batch4"])


async def test_payloads_with_a_marker_are_found_wherever_they_are_kept(store: Store) -> None:
    """`payloads_with`: queued, held, kept for a batch and retained payloads holding the marker are found (large ones
    too: SQLite keeps those in segment files); those without it, and those popped for good, are not."""
    marker = b"\xc7\x38\x42"
    big = marker + bytes(20_000)

    def write(t: Txn) -> dict[str, int]:
        ids = {}
        for name, payload in [("queued", b"q" + marker), ("big", big), ("plain", b"nothing"), ("gone", marker + b"g")]:
            it = item(t, payload=payload)
            t.append(0, it)
            ids[name] = it.meta.item_id
        for name, payload in [("kept", marker + b"k"), ("retained", marker + b"r")]:
            it = item(t, payload=payload)
            t.append(1, it)
            ids[name] = it.meta.item_id
        t.held.add(2, HeldGroup(ItemMeta(t.next_item_id(), 1, 1, 0), 1.0, b"h" + marker))
        return ids

    ids = await store.transact(write)

    def move(t: Txn) -> None:
        t.pop(0, [ids["gone"]])
        t.pop(1, [ids["kept"]], keep_for=0)
        t.put_batch(0, b"", [ids["kept"]])
        t.pop(1, [ids["retained"]], retain=True)

    await store.transact(move)
    found = await store.read(lambda t: sorted(t.payloads_with(marker)))
    assert found == sorted([b"q" + marker, big, marker + b"k", marker + b"r", b"h" + marker])
    await store.transact(lambda t: t.drop_batches_before(1))
    assert marker + b"k" not in await store.transact(lambda t: list(t.payloads_with(marker)))


async def test_held_groups_are_rows_counted_apart_from_the_queue(store: Store) -> None:
    """The side buffer: held groups per env, oldest first, counted beside (never in) the queue counts; a
    release returns them with payloads, in the order asked, all or none."""
    queued = await fill(store, 3, 1)

    def hold(t: Txn) -> list[int]:
        ids = []
        for seqs, payload in [(2, b"aa"), (1, b"b"), (3, b"ccc")]:
            meta = ItemMeta(t.next_item_id(), seqs, 10 * seqs, 5)
            t.held.add(3, HeldGroup(meta, 100.0 + seqs, payload))
            ids.append(meta.item_id)
        t.held.add(4, HeldGroup(ItemMeta(t.next_item_id(), 1, 7, 6), 50.0, b"d"))
        return ids

    ids = await store.transact(hold)
    held = await store.transact(lambda t: t.held.groups(3))
    assert held == [
        HeldMeta(ItemMeta(ids[0], 2, 20, 5), 102.0, 2),
        HeldMeta(ItemMeta(ids[1], 1, 10, 5), 101.0, 1),
        HeldMeta(ItemMeta(ids[2], 3, 30, 5), 103.0, 3),
    ]
    counts, held_counts = await store.transact(lambda t: (t.counts(), t.held.counts()))
    assert counts == {3: QueueCounts(1, 1, 4, 40, size(queued))}
    assert held_counts == {3: QueueCounts(3, 3, 6, 60, 6), 4: QueueCounts(1, 1, 1, 7, 1)}

    def release_missing(t: Txn) -> None:
        with pytest.raises(KeyError):
            t.held.release(3, [ids[0], 999_999])

    await store.transact(release_missing)  # caught inside: nothing was released
    assert len(await store.transact(lambda t: t.held.groups(3))) == 3
    out = await store.transact(lambda t: t.held.release(3, [ids[2], ids[0]]))
    assert [(g.meta.item_id, g.payload, g.held_at) for g in out] == [(ids[2], b"ccc", 103.0), (ids[0], b"aa", 102.0)]
    assert [h.meta.item_id for h in await store.transact(lambda t: t.held.groups(3))] == [ids[1]]
    assert await store.transact(lambda t: t.held.counts()) == {
        3: QueueCounts(1, 1, 1, 10, 1),
        4: QueueCounts(1, 1, 1, 7, 1),
    }
    await store.transact(lambda t: t.held.release(3, [ids[1]]))
    assert await store.transact(lambda t: (t.held.groups(3), t.held.counts())) == ([], {4: QueueCounts(1, 1, 1, 7, 1)})
    await store.transact(lambda t: t.clear())
    assert await store.transact(lambda t: (t.held.groups(4), t.held.counts())) == ([], {})


async def test_envs_are_read_as_far_as_they_changed(store: Store) -> None:
    """`envs_since(v)`: the envs written after change v, by id, each as last written; names counted."""

    def register(t: Txn) -> None:
        t.put_env(0, "math", 1, '{"v": 1}')
        t.put_env(1, "code", 2, '{"v": 2}')
        t.put_env(2, "math", 3, '{"v": 3}')

    await store.transact(register)
    await store.transact(lambda t: t.put_env(0, "math", 4, '{"v": 4}'))  # env 0 changed (disconnected, say)
    got = await store.transact(lambda t: (t.envs_since(-1), t.envs_since(2), t.envs_since(4), t.count_named("math")))
    assert got == ([(0, '{"v": 4}'), (1, '{"v": 2}'), (2, '{"v": 3}')], [(0, '{"v": 4}'), (2, '{"v": 3}')], [], 2)
    assert await store.read(lambda t: (t.count_named("code"), t.count_named("none"))) == (1, 0)


async def test_counters_add_up_within_and_across_transactions(store: Store) -> None:
    def count(t: Txn) -> dict[str, int]:
        t.add_counts("received", {"a": 1, "b": 2})
        t.add_counts("received", {"a": 3})
        t.add_counts("dropped", {"stale:a": 1})
        return t.get_counts("received")  # this transaction's own additions are seen

    assert await store.transact(count) == {"a": 4, "b": 2}

    def failing(t: Txn) -> None:
        t.add_counts("received", {"a": 100})
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        await store.transact(failing)
    await store.transact(lambda t: t.add_counts("received", {"b": 1, "c": 5}))
    got = await store.read(lambda t: (t.get_counts("received"), t.get_counts("dropped"), t.get_counts("none")))
    assert got == ({"a": 4, "b": 3, "c": 5}, {"stale:a": 1}, {})


async def test_clear_keeps_ids_increasing(store: Store) -> None:
    before = await fill(store, 0, 3)
    await store.transact(lambda t: t.clear())
    assert await store.transact(lambda t: (list(t.head(0)), t.counts())) == ([], {})
    after = await fill(store, 0, 1)
    assert after[0] > max(before)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 8)),
        st.tuples(st.just("pop"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("fail"), st.integers(0, 2), st.integers(1, 8)),
    ),
    max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
async def test_matches_a_simple_model(store: Store, ops: list[tuple[str, int, int]]) -> None:
    """Appends, pops from the head and failed transactions, compared with plain lists."""
    await store.transact(lambda t: t.clear())
    model: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}
    for op, env, n in ops:
        if op == "append":

            def fn(t: Txn, env: int = env, n: int = n) -> int:
                it = item(t, seqs=n, tokens=n * 10)
                t.append(env, it)
                return it.meta.item_id

            model[env].append((await store.transact(fn), n))
        elif op == "pop":
            take = [i for i, _ in model[env][:n]]
            await store.transact(lambda t, env=env, take=take: t.pop(env, take))
            del model[env][:n]
        else:

            def failing(t: Txn, env: int = env, n: int = n) -> None:
                t.append(env, item(t, seqs=n))
                t.pop(env, [m.item_id for m in itertools.islice(t.head(env), 1)])
                raise ValueError("rolled back")

            with pytest.raises(ValueError):
                await store.transact(failing)
        for env_id, expected in model.items():
            head = await store.transact(lambda t, e=env_id: [(m.item_id, m.seqs) for m in t.head(e)])
            assert head == expected
        counts = await store.transact(lambda t: t.counts())
        for env_id, expected in model.items():
            c = counts.get(env_id, QueueCounts())
            assert (c.items, c.seqs, c.bytes) == (
                len(expected),
                sum(s for _, s in expected),
                size([i for i, _ in expected]),
            )


async def test_failed_pop_caught_inside_a_transaction_changes_nothing(store: Store) -> None:
    ids = await fill(store, 0, 3)

    def fn(t: Txn) -> list[int]:
        with pytest.raises(KeyError):
            t.pop(0, [ids[1], 10**9])
        return [m.item_id for m in t.head(0)]

    assert await store.transact(fn) == ids
    assert (await store.transact(lambda t: t.counts()))[0].items == 3


async def test_concurrent_transactions_fail_alone(store: Store) -> None:
    """Many transactions in flight at once (SQLite commits them together): each one that raises undoes only
    itself, every other one is applied and answered."""

    def ok(t: Txn, n: int) -> int:
        it = item(t, seqs=1 + n % 4)
        t.append(n % 3, it)
        t.set_value(f"v{n}", str(n))
        return it.meta.item_id

    def bad(t: Txn, n: int) -> int:
        t.append(n % 3, item(t))
        t.set_value(f"v{n}", "must not stay")
        raise ValueError(n)

    calls = [store.transact(lambda t, n=n: (bad if n % 5 == 0 else ok)(t, n)) for n in range(200)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    failed = [n for n, r in enumerate(results) if isinstance(r, ValueError)]
    assert failed == list(range(0, 200, 5))
    acked = sorted(r for r in results if isinstance(r, int))

    def read(t: Txn) -> tuple[list[int], list[str | None], int]:
        ids = sorted(m.item_id for env in range(3) for m in t.head(env))
        return ids, [t.get_value(f"v{n}") for n in range(200)], sum(c.items for c in t.counts().values())

    ids, values, counted = await store.transact(read)
    assert ids == acked and counted == len(acked) == 160
    assert values == [None if n % 5 == 0 else str(n) for n in range(200)]


async def test_kept_batch_refers_to_popped_payloads_until_acknowledged(store: Store) -> None:
    a = await fill(store, 0, 3)
    b = await fill(store, 1, 2)

    def form(t: Txn) -> list[bytes]:
        popped = [*t.pop(1, [b[1], b[0]], keep_for=7), *t.pop(0, [a[0]], keep_for=7)]
        t.put_batch(7, b"<header>", [it.meta.item_id for it in popped])
        return [it.payload for it in popped]

    payloads = await store.transact(form)
    assert payloads == [f"payload-{i}".encode() for i in (b[1], b[0], a[0])]
    expected = b"<header>" + b"".join(payloads)
    assert await store.transact(lambda t: t.get_batch(7)) == expected
    # Popped: gone from the queues and their counts, whether kept or not.
    assert await store.transact(lambda t: ([m.item_id for m in t.head(0)], [m.item_id for m in t.head(1)])) == (
        a[1:],
        [],
    )
    assert (await store.transact(lambda t: t.counts()))[0] == QueueCounts(2, 2, 8, 80, size(a[1:]))
    await store.transact(lambda t: t.drop_batches_before(7))
    assert await store.transact(lambda t: t.get_batch(7)) == expected, "only earlier batches are dropped"
    await store.transact(lambda t: t.drop_batches_before(8))
    assert await store.transact(lambda t: t.get_batch(7)) is None


async def test_a_batch_of_items_not_kept_is_refused(store: Store) -> None:
    ids = await fill(store, 0, 2)

    def form(t: Txn) -> None:
        t.pop(0, [ids[0]])  # not kept: its payload is gone
        t.put_batch(1, b"h", [ids[0]])

    with pytest.raises(KeyError):
        await store.transact(form)
    assert [m.item_id for m in await store.transact(lambda t: list(t.head(0)))] == ids, "nothing applied"


async def test_a_durable_store_reopened_keeps_everything(backend: str, new_url: Callable[[], str]) -> None:
    """Queues, values, kept batches and the id counter, across a close and a new store on the same URL."""
    if backend == "memory":
        pytest.skip("the memory store keeps nothing across processes, by design")
    url = new_url()

    def fill(t: Txn) -> list[int]:
        ids = []
        for env in (0, 1, 0):
            meta = ItemMeta(t.next_item_id(), 2, 20, 1)
            t.append(env, QueuedItem(meta, 1, b"p%d" % meta.item_id))
            ids.append(meta.item_id)
        t.set_value("step", "7")
        kept = ItemMeta(t.next_item_id(), 1, 10, 1)
        t.append(2, QueuedItem(kept, 1, b"-kept"))
        t.pop(2, [kept.item_id], keep_for=6)
        t.put_batch(6, b"batch", [kept.item_id])
        t.put_env(0, "math", 1, "{}")
        t.add_counts("received", {"math_0": 3})
        return ids

    store = make_store(url)
    ids = await store.transact(fill)
    await store.close()
    store = make_store(url)
    try:
        got = await store.transact(
            lambda t: (
                [m.item_id for m in t.head(0)],
                t.get_value("step"),
                t.get_batch(6),
                t.counts()[0].items,
                t.envs_since(-1),
                t.get_counts("received"),
                t.next_item_id(),
            )
        )
        assert got[:6] == ([ids[0], ids[2]], "7", b"batch-kept", 2, [(0, "{}")], {"math_0": 3})
        assert got[6] > max(ids)
    finally:
        await store.close()


async def test_read_sees_what_is_committed(store: Store) -> None:
    ids = await fill(store, 0, 3)
    await store.transact(lambda t: t.set_value("k", "v"))
    got = await store.read(lambda t: ([m.item_id for m in t.head(0)], t.get_value("k"), t.counts()[0].items))
    assert got == (ids, "v", 3)


async def test_announced_replies_read_as_any_other(store: Store) -> None:
    """Keys announced to `transact` (read ahead where reads cost a round trip) read exactly as unannounced
    ones: what an earlier function of the same commit group wrote, what one that raised did not, and nothing
    after `clear`."""
    await store.transact(lambda t: t.put_reply("stored", "old"))

    def put(t: Txn, n: int) -> str | None:
        seen = t.get_reply(f"k{n % 4}")
        t.put_reply(f"k{n % 4}", f"by {n}")
        if n % 3 == 0:
            raise ValueError(n)
        return seen

    calls = [store.transact(lambda t, n=n: put(t, n), replies=[f"k{n % 4}", "stored"]) for n in range(24)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    last: dict[int, str] = {}
    for n, got in enumerate(results):  # transactions apply in the order they were called
        if n % 3 == 0:
            assert isinstance(got, ValueError)
            continue
        assert got == last.get(n % 4), n
        last[n % 4] = f"by {n}"
    keys = ["stored", "k0", "k1", "k2", "k3", "absent"]
    got_all = await store.transact(lambda t: [t.get_reply(k) for k in keys], replies=keys)
    assert got_all == ["old", last[0], last[1], last[2], last[3], None]

    def clear_then_read(t: Txn) -> list[str | None]:
        before = t.get_reply("stored")
        t.clear()
        return [before, t.get_reply("stored"), t.get_reply("k1")]

    assert await store.transact(clear_then_read, replies=["stored", "k1"]) == ["old", None, None]


@given(
    keys=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), min_size=1, max_size=5, unique=True
    )
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
async def test_announced_replies_with_any_key(store: Store, keys: list[str]) -> None:
    """Keys travel as the client sent them (quotes, braces, backslashes, commas, NUL, any script)."""
    await store.transact(lambda t: t.clear())
    await store.transact(lambda t: [t.put_reply(k, f"reply {i}") for i, k in enumerate(keys[::2])])
    got = await store.transact(lambda t: [t.get_reply(k) for k in keys], replies=keys)
    assert got == [f"reply {i // 2}" if i % 2 == 0 else None for i in range(len(keys))]
