"""The open groups' contract (`txn.rollouts`) on every backend: rows written and read back, the live ones found
by deadline and lapse and totalled per env, slots kept first-acknowledged, undone with their transaction and
forgotten by `clear`."""

from __future__ import annotations

import json
import math

import pytest

from api.store import Store
from api.store.base import Txn
from api.store.rollouts import GroupRow, SlotRow, TurnKey, TurnRow, TurnSummary, turn_counts, turn_shape

pytestmark = pytest.mark.anyio


def row(key: str, state: str = "open", deadline: float = 10.0, expires_at: float = 5.0, env: int = 0) -> GroupRow:
    return GroupRow(key, env, state, deadline, expires_at, 100, f'{{"key": "{key}"}}')


async def test_groups_are_found_by_deadline_lapse_and_env(store: Store) -> None:
    def fill(txn: Txn) -> None:
        txn.rollouts.put(row("a", deadline=3.0, expires_at=1.0))
        txn.rollouts.put(row("b", deadline=8.0, expires_at=2.0))
        txn.rollouts.put(row("c", state="sealing", deadline=20.0, expires_at=20.0))
        txn.rollouts.put(row("d", state="sealed", deadline=1.0, expires_at=1.0))
        txn.rollouts.put(row("e", env=1, deadline=30.0, expires_at=30.0))

    await store.transact(fill)
    assert await store.read(lambda txn: txn.rollouts.get("a")) == row("a", deadline=3.0, expires_at=1.0)
    assert await store.read(lambda txn: txn.rollouts.get("zz")) is None
    due = await store.read(lambda txn: txn.rollouts.due(5.0, 10))
    assert [g.key for g in due] == ["a", "c"], "past its deadline, or an interrupted seal"
    lapsed = await store.read(lambda txn: txn.rollouts.lapsed(2.0, 10))
    assert [g.key for g in lapsed] == ["a", "b"]
    assert [g.key for g in await store.read(lambda txn: txn.rollouts.lapsed(2.0, 1))] == ["a"]
    assert await store.read(lambda txn: txn.rollouts.open_totals(0)) == (3, 300)
    await store.transact(lambda txn: txn.rollouts.put(row("a", state="sealed")))
    assert await store.read(lambda txn: txn.rollouts.open_totals(0)) == (2, 200)
    first = await store.read(lambda txn: txn.rollouts.scan("", 3))
    assert [(g.key, g.state) for g in first] == [("a", "sealed"), ("b", "open"), ("c", "sealing")], "any state"
    assert [g.key for g in await store.read(lambda txn: txn.rollouts.scan("c", 3))] == ["d", "e"]


def slot_row(key: str, slot: int, producer: str = "p1", digest: str = "d", tokens: int = 3) -> SlotRow:
    return SlotRow(key, slot, producer, digest, b"\x81\xa1v\x01", tokens, None if slot == 0 else 1.0, slot or None)


async def test_slots_keep_the_first_move_their_group_and_follow_their_transaction(store: Store) -> None:
    """A slot is stored once (the first kept); storing it moves its group's counters, the record untouched."""

    def fill(txn: Txn) -> None:
        txn.rollouts.put(row("a"))
        txn.rollouts.add_slot(slot_row("a", 1, digest="d1"), 10)
        txn.rollouts.add_slot(slot_row("a", 0, digest="d0", tokens=5), 20)
        txn.rollouts.add_slot(slot_row("a", 1, "p2", "other", tokens=100), 1000)

    await store.transact(fill)
    slots = await store.read(lambda txn: txn.rollouts.slots("a"))
    assert [(s.slot, s.producer, s.digest) for s in slots] == [(0, "p1", "d0"), (1, "p1", "d1")]
    assert slots[1] == slot_row("a", 1, digest="d1"), "as stored: data, tokens, score, policy_step"
    assert slots[0].score is None and slots[0].policy_step is None
    assert await store.read(lambda txn: txn.rollouts.slot("a", 1)) == slots[1]
    assert await store.read(lambda txn: txn.rollouts.slot("a", 2)) is None
    assert await store.read(lambda txn: txn.rollouts.done("a")) == {0: "p1", 1: "p1"}
    got = await store.read(lambda txn: txn.rollouts.get("a"))
    assert got is not None and (got.done, got.tokens, got.bytes, got.record) == (2, 8, 130, row("a").record)

    def fails(txn: Txn) -> None:
        txn.rollouts.add_slot(slot_row("a", 2, digest="d2"), 7)
        txn.rollouts.put(row("a", state="sealed"))
        raise RuntimeError("undone")

    with pytest.raises(RuntimeError):
        await store.transact(fails)
    assert len(await store.read(lambda txn: txn.rollouts.slots("a"))) == 2
    assert (await store.read(lambda txn: txn.rollouts.get("a"))) == got
    await store.transact(lambda txn: txn.clear())
    assert await store.read(lambda txn: txn.rollouts.get("a")) is None
    assert await store.read(lambda txn: txn.rollouts.slots("a")) == []


async def test_lapsed_groups_can_be_asked_for_of_some_envs(store: Store) -> None:
    def fill(txn: Txn) -> None:
        txn.rollouts.put(row("a", env=0, expires_at=1.0))
        txn.rollouts.put(row("b", env=1, expires_at=2.0))
        txn.rollouts.put(row("c", env=2, expires_at=3.0))

    await store.transact(fill)
    assert [g.key for g in await store.read(lambda txn: txn.rollouts.lapsed(5.0, 10, [1, 2]))] == ["b", "c"]
    assert [g.key for g in await store.read(lambda txn: txn.rollouts.lapsed(5.0, 1, [2, 0]))] == ["a"]
    assert await store.read(lambda txn: txn.rollouts.lapsed(5.0, 10, [])) == []
    assert len(await store.read(lambda txn: txn.rollouts.lapsed(5.0, 10, None))) == 3


async def test_decided_groups_are_found_by_decision_time_and_deleted_with_their_slots(store: Store) -> None:
    """Retention's contract: decided groups (sealed, expired; their `expires_at` is when) at or before a time are
    found, at most `limit`, and deleted with their slots; live ones never, whatever their times."""

    def fill(txn: Txn) -> None:
        txn.rollouts.put(row("live", deadline=1.0, expires_at=1.0))
        txn.rollouts.put(row("sealing", state="sealing", deadline=1.0, expires_at=1.0))
        for i, key in enumerate(["s1", "s2", "s3"]):
            txn.rollouts.put(row(key, state="open", expires_at=50.0))
            txn.rollouts.add_slot(slot_row(key, 0), 0)
            txn.rollouts.put(row(key, state="sealed" if i != 1 else "expired", expires_at=10.0 + i))
        txn.rollouts.put(row("new", state="sealed", expires_at=100.0))

    await store.transact(fill)
    assert await store.read(lambda txn: txn.rollouts.decided(5.0, 10)) == []
    assert sorted(await store.read(lambda txn: txn.rollouts.decided(11.0, 10))) == ["s1", "s2"]
    assert len(await store.read(lambda txn: txn.rollouts.decided(50.0, 2))) == 2, "at most limit"
    assert sorted(await store.read(lambda txn: txn.rollouts.decided(50.0, 10))) == ["s1", "s2", "s3"]

    def fails(txn: Txn) -> None:
        txn.rollouts.delete(["s1", "s2"])
        raise RuntimeError("undone")

    with pytest.raises(RuntimeError):
        await store.transact(fails)
    assert sorted(await store.read(lambda txn: txn.rollouts.decided(50.0, 10))) == ["s1", "s2", "s3"]
    assert len(await store.read(lambda txn: txn.rollouts.slots("s1"))) == 1
    await store.transact(lambda txn: txn.rollouts.delete(["s1", "s2", "gone"]))
    assert await store.read(lambda txn: txn.rollouts.get("s1")) is None
    assert await store.read(lambda txn: txn.rollouts.slots("s2")) == []
    assert sorted(await store.read(lambda txn: txn.rollouts.decided(math.inf, 10))) == ["new", "s3"]
    assert len(await store.read(lambda txn: txn.rollouts.slots("s3"))) == 1
    assert await store.read(lambda txn: txn.rollouts.open_totals(0)) == (2, 200), "live groups untouched"


async def test_groups_lapsed_since_a_cursor_are_walked_once_by_lapse_then_key(store: Store) -> None:
    def fill(txn: Txn) -> None:
        for key, at in (("b", 1.0), ("a", 1.0), ("c", 2.0), ("d", 9.0)):
            txn.rollouts.put(row(key, expires_at=at))
        txn.rollouts.put(row("s", state="sealing", expires_at=1.0))

    await store.transact(fill)
    first = await store.read(lambda txn: txn.rollouts.lapsed_since((-math.inf, ""), 5.0, 2))
    assert [g.key for g in first] == ["a", "b"], "ties by key, open ones only"
    rest = await store.read(lambda txn: txn.rollouts.lapsed_since((1.0, "b"), 5.0, 10))
    assert [g.key for g in rest] == ["c"], "past the cursor, up to now"
    assert await store.read(lambda txn: txn.rollouts.lapsed_since((1.0, "a"), 1.0, 10)) == [row("b", expires_at=1.0)]
    assert await store.read(lambda txn: txn.rollouts.lapsed_since((2.0, "c"), 5.0, 10)) == []


def turn_row(key: str, slot: int, turn: int, producer: str = "p1", digest: str = "d") -> TurnRow:
    data = f'{{"tokens": [{turn}]}}'.encode()
    return TurnRow(key, slot, turn, producer, digest, data, len(data), 1)


def add(txn: Txn, turn: TurnRow) -> None:
    """Add a turn as the turn route does: its fields as its data says."""
    txn.rollouts.add_turn(turn, turn_counts(turn.data)[1])


async def test_turns_keep_the_first_are_read_by_slot_and_go_with_their_group(store: Store) -> None:
    """A slot's turns: stored once each (the first kept), read back in order by slot, listed without their data for
    the whole group, undone with their transaction, dropped by `drop_turns` and by `delete`, forgotten by `clear`.
    A turn written is read back in the same transaction (what a turn's post checks the next one against)."""

    def fill(txn: Txn) -> list[TurnRow]:
        txn.rollouts.put(row("a"))
        txn.rollouts.put(row("b"))
        add(txn, turn_row("a", 1, 0))
        add(txn, turn_row("a", 0, 1, digest="x"))
        add(txn, turn_row("a", 0, 0, "p2"))
        add(txn, turn_row("a", 0, 0, "p3", digest="other"))
        add(txn, turn_row("b", 0, 0))
        return txn.rollouts.turns("a", 0)

    seen = await store.transact(fill)
    assert seen == [turn_row("a", 0, 0, "p2"), turn_row("a", 0, 1, digest="x")], "its own writes, in order"
    assert await store.read(lambda txn: txn.rollouts.turns("a", 0)) == seen
    assert await store.read(lambda txn: txn.rollouts.turns("a", 2)) == []
    size = turn_row("a", 0, 0).bytes
    assert await store.read(lambda txn: txn.rollouts.turn_keys("a")) == [
        TurnKey(0, 0, "p2", size, 1),
        TurnKey(0, 1, "p1", size, 1),
        TurnKey(1, 0, "p1", size, 1),
    ]

    def fails(txn: Txn) -> None:
        add(txn, turn_row("a", 0, 2))
        txn.rollouts.drop_turns("b")
        raise RuntimeError("undone")

    with pytest.raises(RuntimeError):
        await store.transact(fails)
    assert len(await store.read(lambda txn: txn.rollouts.turn_keys("a"))) == 3
    assert len(await store.read(lambda txn: txn.rollouts.turns("b", 0))) == 1
    await store.transact(lambda txn: txn.rollouts.drop_turns("b"))
    assert await store.read(lambda txn: txn.rollouts.turn_keys("b")) == []
    assert len(await store.read(lambda txn: txn.rollouts.turn_keys("a"))) == 3, "another group's untouched"
    await store.transact(lambda txn: txn.rollouts.delete(["a"]))
    assert await store.read(lambda txn: txn.rollouts.turn_keys("a")) == []
    await store.transact(lambda txn: (txn.rollouts.put(row("c")), add(txn, turn_row("c", 0, 0))))
    await store.transact(lambda txn: txn.clear())
    assert await store.read(lambda txn: txn.rollouts.turns("c", 0)) == []


def turn_of(key: str, slot: int, turn: int, tokens: int, logprobs: bool = False) -> TurnRow:
    body = {"tokens": list(range(tokens)), "inference_logprobs": [0.0] * tokens if logprobs else None}
    data = json.dumps(body).encode()
    return TurnRow(key, slot, turn, "p1", f"d{turn}", data, len(data), tokens)


async def test_a_slots_turns_are_summed_as_they_are_added_and_its_group_counts_their_tokens(store: Store) -> None:
    """What a turn post reads instead of the slot's turns: the slot's summary (turns, tokens, bytes, the fields its
    turns with tokens send) and one turn by its number; the group's `turn_tokens` move with each new turn (a turn
    added again moves nothing), down by the slot's turns' tokens when the slot is acknowledged whole, to 0 when the
    group's turns are dropped; all of it undone with its transaction, and gone with the group."""
    a0, a1, a2 = turn_of("a", 0, 0, 3, logprobs=True), turn_of("a", 0, 1, 0), turn_of("a", 0, 2, 4, logprobs=True)
    b0 = turn_of("a", 1, 0, 5)

    def fill(txn: Txn) -> tuple[TurnSummary | None, int]:
        txn.rollouts.put(row("a"))
        for t in (a0, a1, a2, b0):
            add(txn, t)
        add(txn, a1)  # again: the first stands, counted once
        got = txn.rollouts.get("a")
        assert got is not None
        return txn.rollouts.turn_summary("a", 0), got.turn_tokens

    summed, turned = await store.transact(fill)
    shape = turn_shape(1, True, False)
    assert summed == TurnSummary(3, 7, a0.bytes + a1.bytes + a2.bytes, shape), "its own writes"
    assert turned == 12
    assert await store.read(lambda txn: txn.rollouts.turn_summary("a", 0)) == summed
    assert await store.read(lambda txn: txn.rollouts.turn_summary("a", 1)) == TurnSummary(1, 5, b0.bytes, 1)
    assert await store.read(lambda txn: txn.rollouts.turn_summary("a", 2)) is None
    assert await store.read(lambda txn: txn.rollouts.turn("a", 0, 2)) == a2
    assert await store.read(lambda txn: txn.rollouts.turn("a", 0, 3)) is None

    async def turn_tokens() -> int:
        got = await store.read(lambda txn: txn.rollouts.get("a"))
        assert got is not None
        return got.turn_tokens

    def fails(txn: Txn) -> None:
        add(txn, turn_of("a", 0, 3, 9))
        txn.rollouts.add_slot(slot_row("a", 1, tokens=6), 10)
        raise RuntimeError("undone")

    with pytest.raises(RuntimeError):
        await store.transact(fails)
    assert await store.read(lambda txn: txn.rollouts.turn_summary("a", 0)) == summed
    assert await turn_tokens() == 12
    await store.transact(lambda txn: txn.rollouts.add_slot(slot_row("a", 1, tokens=6), 10))
    got = await store.read(lambda txn: txn.rollouts.get("a"))
    assert got is not None and (got.turn_tokens, got.tokens, got.done) == (7, 6, 1), "slot 1's turns count whole"
    await store.transact(lambda txn: txn.rollouts.put(row("b")))
    await store.transact(lambda txn: add(txn, turn_of("b", 0, 0, 2)))
    await store.transact(lambda txn: txn.rollouts.drop_turns("a"))
    assert await turn_tokens() == 0
    assert await store.read(lambda txn: txn.rollouts.turn_summary("a", 0)) is None
    assert await store.read(lambda txn: txn.rollouts.turn_summary("b", 0)) == TurnSummary(
        1, 2, turn_of("b", 0, 0, 2).bytes, 1
    )
    await store.transact(lambda txn: txn.rollouts.delete(["b"]))
    assert await store.read(lambda txn: txn.rollouts.turn_summary("b", 0)) is None
