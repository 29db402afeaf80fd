"""Producers as stored (api/producers/stored.py), on every backend: a heartbeat of a known producer writes its own
producer's value and nothing else, whatever the others hold; producers an earlier release kept as one value are
read, and moved to a value each by the first heartbeat."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from api.owners import ANONYMOUS, Actor, Identity
from api.producers.stored import LEGACY_PRODUCERS, ProducerSettings, heartbeat_txn, load_producers
from api.store import Store
from api.store.base import Txn
from api.wire.producers import Heartbeat

pytestmark = pytest.mark.anyio
SETTINGS = ProducerSettings(gone_after=30.0, max_producers=1024, max_producers_per_key=1024)


class Writes:
    """What a transaction function writes to named values: each key and the bytes of its new value."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn
        self.written: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.txn, name)

    def set_value(self, key: str, value: str) -> None:
        self.written[key] = len(value)
        self.txn.set_value(key, value)

    def delete_value(self, key: str) -> None:
        self.written[key] = 0
        self.txn.delete_value(key)


def beat(pid: str, **extra: Any) -> Heartbeat:
    return Heartbeat(producer_id=pid, host="h", waiting_for="w" * 900, **extra)


async def test_a_heartbeat_writes_its_own_producer_only(store: Store) -> None:
    """Each heartbeat rewrote every producer (one JSON value): 7.8 ms, then 129 ms with the table full."""
    for i in range(100):
        await store.transact(partial(heartbeat_txn, beat=beat(f"p-{i}"), now=1.0, settings=SETTINGS))

    def again(txn: Txn) -> dict[str, int]:
        writes = Writes(txn)
        heartbeat_txn(writes, beat("p-7", in_flight=3), 2.0, SETTINGS)  # type: ignore[arg-type]
        return writes.written

    written = await store.transact(again)
    assert len(written) == 1 and sum(written.values()) < 2000, written
    table = await store.read(load_producers)
    assert len(table) == 100 and (table["p-7"].in_flight, table["p-7"].last_seen) == (3, 2.0)


async def test_producers_kept_as_one_value_are_read_then_moved(store: Store) -> None:
    """A store written by an earlier release holds every producer under one value."""
    old = {f"old-{i}": beat(f"old-{i}").model_dump() | {"last_seen": 1.0, "first_seen": 0.5} for i in range(3)}
    await store.transact(lambda txn: txn.set_value(LEGACY_PRODUCERS, json.dumps(old)))
    assert sorted(await store.read(load_producers)) == ["old-0", "old-1", "old-2"]
    await store.transact(lambda txn: heartbeat_txn(txn, beat("new"), 2.0, SETTINGS))
    table = await store.read(load_producers)
    assert sorted(table) == ["new", "old-0", "old-1", "old-2"] and table["old-1"].first_seen == 0.5
    assert await store.read(lambda txn: txn.get_value(LEGACY_PRODUCERS)) is None


async def test_a_new_producer_of_a_full_key_forgets_that_keys_longest_gone(store: Store) -> None:
    bounded = ProducerSettings(gone_after=30.0, max_producers=10, max_producers_per_key=2)
    one = Actor(Identity("one", "env"), frozenset())
    two = Actor(Identity("two", "env"), frozenset())
    for pid, now, actor in (("a", 1.0, one), ("b", 2.0, one), ("c", 3.0, two)):
        await store.transact(partial(heartbeat_txn, beat=beat(pid), now=now, settings=bounded, actor=actor))
    await store.transact(lambda txn: heartbeat_txn(txn, beat("d"), 40.0, bounded, one))  # a and b are gone
    assert sorted(await store.read(load_producers)) == ["b", "c", "d"]
    await store.transact(lambda txn: heartbeat_txn(txn, beat("e"), 40.0, bounded, Actor(ANONYMOUS, frozenset())))
    assert sorted(await store.read(load_producers)) == ["b", "c", "d", "e"], "keyless producers: no key's bound"
