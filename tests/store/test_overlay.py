"""Every read of the store contract sees the writes of its own group commit (api/store/overlay.py): on
PostgreSQL most writes wait in the group's cache until the COMMIT, so a read that forgets to lay them over what
the database returns is wrong only there, only inside a group. Each read method of `Txn` and its parts (held,
ledger, tasks, open groups) has a case here: rows stored before, writes made inside the group (by the reading
function itself, or by other functions of the same group), then the read, whose answer must be the memory
store's (the reference twin, where nothing is pending) for the same steps. A method added to a contract without
a case, or without being named a write, fails `test_every_method_of_the_contract_has_a_case`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from api.store import Store, make_store
from api.store.base import HeldGroup, HeldTxn, ItemMeta, QueuedItem, Txn
from api.store.ledger_contract import DROPPED, LedgerStep, LedgerTxn
from api.store.postgres.txn import PostgresTxn
from api.store.rollouts import GroupRow, OpenGroupTxn, SlotRow, TurnRow
from api.store.tasks import FRONT, LEASED, TaskRow, TaskTxn
from tests.store.test_ledger_contract import ledger_row

pytestmark = pytest.mark.anyio

Ctx = dict[str, Any]
"""What a case's steps hand each other (the item ids they made), one per store it runs on."""
Step = Callable[[Txn, Ctx], Any]

CONTRACTS: dict[str, type] = {
    "txn": Txn,
    "held": HeldTxn,
    "ledger": LedgerTxn,
    "tasks": TaskTxn,
    "rollouts": OpenGroupTxn,
}
WRITES = {
    "txn": {
        "set_value",
        "delete_value",
        "append",
        "next_item_id",
        "put_env",
        "add_counts",
        "put_reply",
        "put_batch",
        "drop_batches_before",
        "clear",
    },
    "held": {"add"},
    "ledger": {"add", "decide", "requeue", "put_step", "committed", "prune", "keep_payloads", "prune_payloads"},
    "tasks": {"put_dataset", "add_tasks", "put_rows"},
    "rollouts": {"put", "delete", "add_slot", "add_turn", "drop_turns"},
}
"""Methods that write and read nothing back: each of their writes is read by some case."""
NOT_HERE = {("txn", "drop_lost"): "only a store that can lose payloads (SQLite's segment files) has it"}
MUTATING = {("txn", "pop"), ("held", "release")}
"""Reads that take what they read: read again after the COMMIT, they answer otherwise."""


def methods() -> set[tuple[str, str]]:
    """Every public method of the contracts."""
    return {
        (part, name)
        for part, cls in CONTRACTS.items()
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


@dataclass(frozen=True)
class Case:
    stored: tuple[Step, ...]
    """Steps committed before the group, each in its own transaction."""
    writes: tuple[Step, ...]
    """The group's writes."""
    read: Step


def caught(step: Step) -> Step:
    """A read whose refusal is its answer (a pop of what is not queued)."""

    def read(t: Txn, c: Ctx) -> Any:
        try:
            return step(t, c)
        except KeyError as exc:
            return ("refused", type(exc).__name__)

    return read


# --- steps the cases share ---
def queue(env: int, n: int, name: str = "items") -> Step:
    def step(t: Txn, c: Ctx) -> None:
        for _ in range(n):
            meta = ItemMeta(t.next_item_id(), 2, 20 + len(c.get(name, [])), 0)
            t.append(env, QueuedItem(meta, 1, f"payload-{meta.item_id}".encode()))
            c.setdefault(name, []).append(meta.item_id)
            t.ledger.add([ledger_row(meta.item_id, group_id=f"g{meta.item_id % 2}")])

    return step


def pop_kept(step_no: int, name: str = "items") -> Step:
    def step(t: Txn, c: Ctx) -> None:
        t.pop(0, c[name][:2], keep_for=step_no)
        t.put_batch(step_no, b"header", c[name][:2])

    return step


def decide_dropped(name: str = "items") -> Step:
    def step(t: Txn, c: Ctx) -> None:
        t.ledger.decide(c[name][:3], DROPPED, step=5, reason="stale", at=9.0)

    return step


def kept(name: str, payload: bytes) -> Step:
    """A payload retained for a group that was never queued (dropped at ingest)."""

    def step(t: Txn, c: Ctx) -> None:
        item_id = t.next_item_id()
        t.ledger.keep_payloads([(item_id, payload)])
        c.setdefault(name, []).append(item_id)

    return step


def step_row(step_no: int) -> Step:
    def step(t: Txn, c: Ctx) -> None:
        t.ledger.put_step(LedgerStep(step_no, float(step_no), 0.1, (1, 2), 8, 80, {"e": 2}, {"e": 8}, {0: 2}))

    return step


def held(env: int, n: int) -> Step:
    def step(t: Txn, c: Ctx) -> None:
        for _ in range(n):
            meta = ItemMeta(t.next_item_id(), 1, 10, 0)
            t.held.add(env, HeldGroup(meta, 50.0 + meta.item_id, f"held-{meta.item_id}".encode()))
            c.setdefault("held", []).append(meta.item_id)

    return step


def task_rows(first: int, n: int, state: str, ledgered: int | None = None, **fields: Any) -> Step:
    """Rows of dataset d; with `ledgered`, task i carried the group of ledger id `ledgered + i`."""

    def step(t: Txn, c: Ctx) -> None:
        ids = [None if ledgered is None else ledgered + i for i in range(first, first + n)]
        t.tasks.put_rows(
            [
                TaskRow("d", 0, i, state, seq=100 - i, ledger_id=ids[i - first], **fields)
                for i in range(first, first + n)
            ]
        )

    return step


def dataset(name: str = "d") -> Step:
    def step(t: Txn, c: Ctx) -> None:
        t.tasks.put_dataset(name, f"record of {name}")
        t.tasks.add_tasks(name, 0, [f"task {i} of {name}" * (i + 1) for i in range(4)])

    return step


def group(key: str, state: str = "open", deadline: float = 10.0, expires: float = 20.0, env: int = 0) -> Step:
    def step(t: Txn, c: Ctx) -> None:
        t.rollouts.put(GroupRow(key, env, state, deadline, expires, len(key), f"record {key}"))
        slot_row(key, 0)(t, c)

    return step


def slot_row(key: str, slot: int) -> Step:
    """An acknowledged rollout in slot `slot` of group `key`."""

    def step(t: Txn, c: Ctx) -> None:
        data = f"slot {slot} of {key}".encode()
        t.rollouts.add_slot(SlotRow(key, slot, f"p{slot}", f"digest {slot}", data, 3 + slot, 0.5, None), len(data))

    return step


def turn_row(key: str, slot: int, turn: int) -> Step:
    """An acknowledged turn `turn` of slot `slot` of group `key`."""

    def step(t: Txn, c: Ctx) -> None:
        data = f"turn {turn} of slot {slot} of {key}".encode()
        t.rollouts.add_turn(TurnRow(key, slot, turn, f"p{slot}", f"digest {turn}", data, len(data), turn + 1), 1)

    return step


def run(*steps: Step) -> tuple[Step, ...]:
    return steps


CASES: dict[tuple[str, str], Case] = {
    # --- Txn ---
    ("txn", "get_value"): Case(
        run(lambda t, c: t.set_value("a", "1")),
        run(lambda t, c: t.set_value("a", "2"), lambda t, c: t.set_value("b", "3")),
        lambda t, c: (t.get_value("a"), t.get_value("b")),
    ),
    ("txn", "head"): Case(
        run(queue(0, 2)), run(queue(0, 2)), lambda t, c: [(m.item_id in c["items"], m.tokens) for m in t.head(0)]
    ),
    ("txn", "pop"): Case(
        run(queue(0, 2)),
        run(queue(0, 2)),
        caught(
            lambda t, c: [
                (i.meta.tokens, i.payload == f"payload-{i.meta.item_id}".encode()) for i in t.pop(0, c["items"][1:])
            ]
        ),
    ),
    ("txn", "payloads_with"): Case(
        run(queue(0, 2)),
        run(queue(0, 2), lambda t, c: t.pop(0, c["items"][:1])),
        lambda t, c: sorted(t.payloads_with(b"payload-")),
    ),
    ("txn", "counts"): Case(run(queue(0, 1)), run(queue(0, 2), queue(1, 1)), lambda t, c: t.counts()),
    ("txn", "envs_since"): Case(
        run(lambda t, c: t.put_env(1, "one", 1, "r1")),
        run(lambda t, c: t.put_env(2, "two", 2, "r2")),
        lambda t, c: t.envs_since(0),
    ),
    ("txn", "count_named"): Case(
        run(lambda t, c: t.put_env(1, "one", 1, "r1")),
        run(lambda t, c: t.put_env(2, "one", 2, "r2")),
        lambda t, c: t.count_named("one"),
    ),
    ("txn", "get_counts"): Case(
        run(lambda t, c: t.add_counts("k", {"a": 1})),
        run(lambda t, c: t.add_counts("k", {"a": 2, "b": 1})),
        lambda t, c: t.get_counts("k"),
    ),
    ("txn", "get_reply"): Case(
        run(lambda t, c: t.put_reply("a", "1")),
        run(lambda t, c: t.put_reply("a", "2"), lambda t, c: t.put_reply("b", "3")),
        lambda t, c: (t.get_reply("a"), t.get_reply("b"), t.get_reply("c")),
    ),
    ("txn", "get_batch"): Case(run(queue(0, 2)), run(queue(0, 1), pop_kept(4)), lambda t, c: t.get_batch(4)),
    # --- held groups ---
    ("held", "groups"): Case(
        run(held(3, 1)), run(held(3, 2)), lambda t, c: [(h.held_at - h.meta.item_id, h.size) for h in t.held.groups(3)]
    ),
    ("held", "counts"): Case(run(held(3, 1)), run(held(3, 1), held(4, 1)), lambda t, c: t.held.counts()),
    ("held", "release"): Case(
        run(held(3, 1)),
        run(held(3, 2)),
        caught(lambda t, c: [h.payload == f"held-{h.meta.item_id}".encode() for h in t.held.release(3, c["held"][1:])]),
    ),
    # --- the ledger ---
    ("ledger", "groups"): Case(
        run(queue(0, 2)),
        run(queue(0, 2), decide_dropped()),
        lambda t, c: [(r.fate, r.step) for r in t.ledger.groups(c["items"])],
    ),
    ("ledger", "named"): Case(
        run(queue(0, 2)), run(queue(0, 3)), lambda t, c: [r.id in c["items"] for r in t.ledger.named("g1")]
    ),
    ("ledger", "scan"): Case(
        run(queue(0, 2)),
        run(queue(0, 2), decide_dropped()),
        lambda t, c: [(r.fate, r.tokens) for r in t.ledger.scan(0, 3)],
    ),
    ("ledger", "dropped"): Case(
        run(queue(0, 1)), run(queue(0, 3), decide_dropped()), lambda t, c: [r.tokens for r in t.ledger.dropped(0, 9, 2)]
    ),
    ("ledger", "steps"): Case(
        run(step_row(1), step_row(3)),
        run(step_row(2), lambda t, c: t.ledger.committed(1, 3, 7.0)),
        lambda t, c: t.ledger.steps(0, 9),
    ),
    ("ledger", "kept_payloads"): Case(
        run(kept("kept", b"a")),
        run(kept("kept", b"b"), queue(0, 1), lambda t, c: t.pop(0, c["items"], retain=True)),
        lambda t, c: sorted(t.ledger.kept_payloads(c["kept"] + c.get("items", [])).values()),
    ),
    ("ledger", "kept_oldest"): Case(
        run(queue(0, 3), lambda t, c: t.ledger.decide(c["items"][:1], DROPPED, step=2, kept=True)),
        run(queue(0, 2), lambda t, c: t.ledger.decide(c["items"][3:], DROPPED, step=1, kept=True)),
        lambda t, c: [(k.step, k.bytes) for k in t.ledger.kept_oldest(2)],
    ),
    # --- tasks ---
    ("tasks", "get_dataset"): Case(
        run(dataset("d")),
        run(lambda t, c: t.tasks.put_dataset("d", "changed"), dataset("e")),
        lambda t, c: (t.tasks.get_dataset("d"), t.tasks.get_dataset("e")),
    ),
    ("tasks", "dataset_names"): Case(run(dataset("d")), run(dataset("e")), lambda t, c: t.tasks.dataset_names()),
    ("tasks", "task_data"): Case(run(dataset("d")), run(dataset("e")), lambda t, c: t.tasks.task_data("e", [0, 2])),
    ("tasks", "task_sizes"): Case(run(dataset("d")), run(dataset("e")), lambda t, c: t.tasks.task_sizes("e", [1, 3])),
    ("tasks", "tasks_within"): Case(
        run(dataset("d")), run(dataset("e")), lambda t, c: t.tasks.tasks_within("e", [0, 1, 2], 40)
    ),
    ("tasks", "rows"): Case(
        run(task_rows(0, 3, FRONT)),
        run(task_rows(1, 3, LEASED, expires_at=5.0)),
        lambda t, c: t.tasks.rows("d", [(0, i) for i in range(5)]),
    ),
    ("tasks", "front"): Case(
        run(task_rows(0, 4, FRONT)), run(task_rows(2, 2, LEASED, expires_at=5.0)), lambda t, c: t.tasks.front("d", 3)
    ),
    ("tasks", "expired"): Case(
        run(task_rows(0, 4, LEASED, expires_at=5.0)),
        run(task_rows(0, 1, FRONT), task_rows(4, 1, LEASED, expires_at=1.0)),
        lambda t, c: t.tasks.expired("d", 6.0, 3),
    ),
    ("tasks", "reclaimable"): Case(
        run(task_rows(0, 4, LEASED, expires_at=5.0), task_rows(4, 3, FRONT)),
        run(task_rows(0, 1, FRONT), task_rows(4, 1, LEASED, expires_at=1.0)),
        lambda t, c: t.tasks.reclaimable("d", 6.0, 3, 2),
    ),
    ("tasks", "by_ledger"): Case(
        run(task_rows(0, 3, LEASED, ledgered=10)),
        run(task_rows(1, 3, LEASED, ledgered=20)),
        lambda t, c: sorted(t.tasks.by_ledger([10, 11, 21, 22, 23]), key=lambda r: r.index),
    ),
    ("tasks", "scan"): Case(
        run(task_rows(0, 4, FRONT)),
        run(task_rows(1, 1, LEASED), task_rows(5, 1, FRONT)),
        lambda t, c: t.tasks.scan("d", (0, 0), 3),
    ),
    # --- open groups ---
    ("rollouts", "get"): Case(
        run(group("a")), run(group("a", "sealing"), group("b")), lambda t, c: (t.rollouts.get("a"), t.rollouts.get("b"))
    ),
    ("rollouts", "due"): Case(
        run(group("a", deadline=1.0), group("b", deadline=2.0)),
        run(group("a", "sealed", deadline=1.0), group("c", deadline=1.5)),
        lambda t, c: t.rollouts.due(5.0, 2),
    ),
    ("rollouts", "lapsed"): Case(
        run(group("a", expires=1.0), group("b", expires=2.0, env=1)),
        run(group("a", "sealed", expires=1.0), group("c", expires=1.5)),
        lambda t, c: (t.rollouts.lapsed(5.0, 2), t.rollouts.lapsed(5.0, 2, [1])),
    ),
    ("rollouts", "lapsed_since"): Case(
        run(group("a", expires=1.0), group("b", expires=2.0)),
        run(group("b", "sealed", expires=2.0), group("c", expires=1.5)),
        lambda t, c: t.rollouts.lapsed_since((1.0, "a"), 5.0, 2),
    ),
    ("rollouts", "decided"): Case(
        run(group("a", "sealed", expires=1.0)),
        run(group("b", "expired", expires=1.0), lambda t, c: t.rollouts.delete(["a"])),
        lambda t, c: t.rollouts.decided(5.0, 3),
    ),
    ("rollouts", "scan"): Case(
        run(group("a"), group("b")),
        run(group("c"), lambda t, c: t.rollouts.delete(["a"])),
        lambda t, c: t.rollouts.scan("", 2),
    ),
    ("rollouts", "open_totals"): Case(
        run(group("a")), run(group("bb"), group("a", "sealed")), lambda t, c: t.rollouts.open_totals(0)
    ),
    ("rollouts", "slots"): Case(
        run(group("a")), run(slot_row("a", 1), slot_row("b", 0)), lambda t, c: t.rollouts.slots("a")
    ),
    ("rollouts", "slot"): Case(
        run(group("a")), run(slot_row("a", 1)), lambda t, c: [t.rollouts.slot("a", i) for i in range(3)]
    ),
    ("rollouts", "done"): Case(
        run(group("a")), run(slot_row("a", 2), slot_row("b", 0)), lambda t, c: t.rollouts.done("a")
    ),
    ("rollouts", "turns"): Case(
        run(group("a"), turn_row("a", 1, 0)),
        run(turn_row("a", 1, 1), turn_row("a", 2, 0), turn_row("b", 1, 0)),
        lambda t, c: t.rollouts.turns("a", 1),
    ),
    ("rollouts", "turn_keys"): Case(
        run(group("a"), group("b"), turn_row("a", 1, 0), turn_row("b", 1, 0)),
        run(turn_row("a", 2, 0), lambda t, c: t.rollouts.drop_turns("b"), turn_row("b", 3, 0)),
        lambda t, c: (t.rollouts.turn_keys("a"), t.rollouts.turn_keys("b")),
    ),
    ("rollouts", "turn"): Case(
        run(group("a"), turn_row("a", 1, 0)),
        run(turn_row("a", 1, 1), turn_row("b", 1, 0)),
        lambda t, c: [t.rollouts.turn("a", 1, i) for i in range(3)],
    ),
    ("rollouts", "turn_summary"): Case(
        run(group("a"), group("b"), turn_row("a", 1, 0)),
        run(turn_row("a", 1, 1), turn_row("b", 1, 0), lambda t, c: t.rollouts.drop_turns("b")),
        lambda t, c: ([t.rollouts.turn_summary("a", i) for i in range(3)], t.rollouts.turn_summary("b", 1)),
    ),
}


def test_every_method_of_the_contract_has_a_case() -> None:
    """A read without a case, or a method that is neither a read with a case nor a named write, fails here."""
    writes = {(part, name) for part, names in WRITES.items() for name in names}
    assert not writes & set(CASES), "a method is a write or a read, not both"
    assert methods() - set(NOT_HERE) == writes | set(CASES)


# --- running a case ---
JOIN_S = 60.0
"""A hang guard: how long the group's first function waits to be let go."""


async def committed(store: Store, steps: tuple[Step, ...], ctx: Ctx) -> None:
    for step in steps:
        await store.transact(bound(step, ctx))


def bound(step: Step, ctx: Ctx) -> Callable[[Txn], Any]:
    """A step as a transaction function."""
    return lambda t: step(t, ctx)


async def reference(case: Case, *, with_writes: bool = True) -> Any:
    """The read's answer on the memory store, each step in a transaction of its own."""
    store = make_store("memory://")
    try:
        ctx: Ctx = {}
        await committed(store, case.stored + (case.writes if with_writes else ()), ctx)
        return await store.transact(lambda t: case.read(t, ctx))
    finally:
        await store.close()


async def in_one_group(store: Store, fns: list[Callable[[Txn], Any]]) -> list[Any]:
    """Run `fns` as one group commit, in order: a first transaction holds the writer until all of them are
    queued behind it, so the writer takes them as one group. The memory store runs each at once (it has no
    group commit); PostgreSQL's functions are checked to have shared one transaction."""
    if store.url.startswith("memory"):
        return [await store.transact(fn) for fn in fns]
    started, go = threading.Event(), threading.Event()

    def hold(t: Txn) -> None:
        started.set()
        assert go.wait(JOIN_S), "the group's functions were never all queued"

    holding = asyncio.ensure_future(store.transact(hold))
    assert await asyncio.to_thread(started.wait, JOIN_S), "the writer never ran the first function"
    groups: list[object] = []

    def noted(fn: Callable[[Txn], Any]) -> Callable[[Txn], Any]:
        def call(t: Txn) -> Any:
            groups.append(_group_of(t))
            return fn(t)

        return call

    calls = [asyncio.ensure_future(store.transact(noted(fn))) for fn in fns]
    await asyncio.sleep(0)  # each call runs up to queueing its function
    go.set()
    await holding
    results = await asyncio.gather(*calls)
    assert len(set(map(id, groups))) == 1 or None in groups, "the functions ran in more than one group"
    return results


def _group_of(t: Txn) -> object:
    """The PostgreSQL transaction (group) a function runs in; None elsewhere."""
    return t._g if isinstance(t, PostgresTxn) else None  # noqa: SLF001


@pytest.mark.parametrize("how", ["one function", "functions of one group"])
@pytest.mark.parametrize("method", sorted(CASES), ids=lambda m: ".".join(m))
async def test_a_read_sees_the_writes_of_its_group(
    new_url: Callable[[], str], method: tuple[str, str], how: str
) -> None:
    case = CASES[method]
    expected = await reference(case)
    assert expected != await reference(case, with_writes=False), "the case's writes change nothing the read sees"
    store = make_store(new_url())
    try:
        ctx: Ctx = {}
        await committed(store, case.stored, ctx)
        if how == "one function":

            def all_at_once(t: Txn) -> Any:
                for step in case.writes:
                    step(t, ctx)
                return case.read(t, ctx)

            [got] = await in_one_group(store, [all_at_once])
        else:
            fns = [bound(step, ctx) for step in (*case.writes, case.read)]
            got = (await in_one_group(store, fns))[-1]
        assert got == expected
        assert await store.transact(lambda t: case.read(t, ctx)) == expected or method in MUTATING, "once committed"
    finally:
        await store.close()
