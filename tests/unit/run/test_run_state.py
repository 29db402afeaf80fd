"""api.run.state: the run state a transaction reads. Envs are rows; a process that read them before reads only what
changed since (so a request costs the same with 10,000 envs as with 10), and a reset starts a new env list."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from api.run import state
from api.run.kept import Kept
from api.run.state import EnvRecord, RunState
from api.store.memory import MemoryTxn, State
from api.wire.schema import Registration
from tests.factories import registration


class CountingTxn(MemoryTxn):
    """The memory store's transaction, counting the env rows it hands out."""

    def __init__(self, s: State) -> None:
        super().__init__(s)
        self.env_rows = 0

    def envs_since(self, version: int) -> list[tuple[int, str]]:
        rows = super().envs_since(version)
        self.env_rows += len(rows)
        return rows


def env(env_id: int, name: str = "math") -> EnvRecord:
    return EnvRecord(env_id, name, f"{name}_{env_id}", 1.0, 4, 512, None)


def registered(s: State, n: int) -> RunState:
    txn = CountingTxn(s)
    state.save_run(txn, Registration.model_validate(registration()), started=True)
    run = state.load(txn)
    for i in range(n):
        state.save_env(txn, run, env(i))
        run = state.load(txn, run)
    return run


def test_an_unchanged_env_list_is_not_read_again() -> None:
    s = State()
    run = registered(s, 1000)
    txn = CountingTxn(s)
    again = state.load(txn, run)
    assert again == run and again.envs is run.envs and txn.env_rows == 0
    fresh = CountingTxn(s)
    assert state.load(fresh) == run and fresh.env_rows == 1000  # a process that knows nothing reads them all


def test_only_what_changed_is_read_and_applied_to_a_copy() -> None:
    s = State()
    run = registered(s, 100)
    writer = CountingTxn(s)
    state.save_env(writer, run, replace(run.envs[7], connected=False))
    state.save_env(writer, state.load(writer, run), env(100, "code"))
    reader = CountingTxn(s)
    later = state.load(reader, run)
    assert reader.env_rows == 2 and len(later.envs) == 101 and later.envs[100].desired_name == "code"
    assert not later.envs[7].connected
    assert len(run.envs) == 100 and run.envs[7].connected, "the known state's list was changed in place"


def test_a_reset_starts_a_new_env_list_even_at_the_same_version() -> None:
    s = State()
    first = registered(s, 3)
    txn = CountingTxn(s)
    txn.clear()
    second = registered(s, 3)  # the same number of changes, so the same version: another list all the same
    assert first.envs_at is not None and second.envs_at is not None
    assert first.envs_at.version == second.envs_at.version and first.envs_at != second.envs_at
    reader = CountingTxn(s)
    assert state.load(reader, first).envs == second.envs and reader.env_rows == 3


def test_names_count_registrations_without_reading_the_list() -> None:
    s = State()
    registered(s, 5)
    assert CountingTxn(s).count_named("math") == 5


class ValueCountingTxn(MemoryTxn):
    """The memory store's transaction, counting its value reads and writes by key."""

    def __init__(self, s: State) -> None:
        super().__init__(s)
        self.gets: dict[str, int] = {}
        self.sets: dict[str, int] = {}

    def get_value(self, key: str) -> str | None:
        self.gets[key] = self.gets.get(key, 0) + 1
        return super().get_value(key)

    def set_value(self, key: str, value: str) -> None:
        self.sets[key] = self.sets.get(key, 0) + 1
        super().set_value(key, value)


SAMPLES: list[tuple[state.Key[Any], Any]] = [
    (state.STEP, 7),
    (state.KEPT, Kept(3, {3: 100, 4: 2048})),
    (state.CREDITS, {0: 1.5, 3: -2.0, -1: 0.0}),
    (state.BLOCKED, "env 'math' has 0 sequences queued"),
    (state.BLOCKED, None),
    (state.PASSED, {0: (12, 4), 2: (40, 5)}),
    (state.QUIET, {1: (1765000000.25, False), 2: (1765000001.5, True)}),
    (state.AWAITING, (1765000000.5, 120, 9)),
]


@pytest.mark.parametrize(("key", "value"), SAMPLES, ids=[f"{k.name}-{i}" for i, (k, _) in enumerate(SAMPLES)])
def test_a_unit_stores_the_bytes_the_save_functions_store(key: state.Key[Any], value: Any) -> None:
    """The stored format does not depend on the path: a key written through a unit holds what `Key.save` (the
    `save_*` functions) writes, and reads back as the value."""
    direct, through = State(), State()
    key.save(MemoryTxn(direct), value)
    unit = state.Unit(MemoryTxn(through))
    unit.set(key, value)
    unit.commit()
    assert through.values == direct.values
    assert key.load(MemoryTxn(through)) == value == state.Unit(MemoryTxn(through)).get(key)


def test_a_unit_reads_each_key_once_and_writes_each_changed_key_once() -> None:
    s = State()
    state.save_credits(MemoryTxn(s), {0: 1.0})
    txn = ValueCountingTxn(s)
    unit = state.Unit(txn)
    for credits in ({0: 2.0}, {0: 3.0}):
        assert unit.get(state.CREDITS) != credits
        unit.set(state.CREDITS, credits)
    unit.set_blocked("waiting")
    unit.set_blocked(None)  # written as `save_blocked` leaves it: null, not absent
    unit.set(state.PASSED, {})  # never read: written
    assert txn.sets == {}  # nothing is written before the commit
    unit.commit()
    assert txn.gets == {state.CREDITS_KEY: 1, state.BLOCKED_KEY: 1}
    assert txn.sets == {state.CREDITS_KEY: 1, state.BLOCKED_KEY: 1, state.PASSED_KEY: 1}
    assert state.load_credits(txn) == {0: 3.0} and state.load_passed(txn) == {}
    assert s.values[state.BLOCKED_KEY] == "null"


def test_a_key_set_back_to_what_the_store_holds_is_not_written() -> None:
    s = State()
    state.save_step(MemoryTxn(s), 4)
    txn = ValueCountingTxn(s)
    unit = state.Unit(txn)
    unit.set(state.STEP, unit.get(state.STEP) + 1)
    unit.set(state.STEP, 4)
    unit.commit()
    assert txn.sets == {}
