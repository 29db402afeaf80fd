"""The per-rollout transactions (api/rollouts/txns.py) over a memory store: what a post writes and reads."""

from __future__ import annotations

import pytest

from api.config.settings import Settings
from api.errors import InvalidData
from api.ingest.queue_limits import QueueLimits
from api.owners import ANYONE
from api.rollouts import rows as rr
from api.rollouts import txns as rs
from api.run import state
from api.store.memory import MemoryTxn, State
from api.store.rollouts import SlotRow
from api.wire.rollouts import OpenRequest, RolloutPost
from api.wire.schema import Registration
from tests.factories import registration

SETTINGS = Settings(store="memory://")
LIMITS = QueueLimits()


def post(txn: MemoryTxn, slot: int, n: int = 3) -> str:
    body = {"group_id": "g", "slot": slot, "producer_id": "p1", "tokens": [1] * n, "masks": [1] * n, "score": 1.0}
    reply, _ = rs.post_txn(txn, RolloutPost.model_validate(body), 0.0, SETTINGS, limits=LIMITS)
    return reply.status


def test_a_post_writes_its_slot_and_its_groups_counters_and_leaves_the_record() -> None:
    """The group's record is what the group is and what was leased or decided: a post leaves it as it was (it was
    rewritten with every post, which made a post cost what the group held), and moves the row's counters."""
    txn = MemoryTxn(State())
    reg = registration(batch_size=8, max_token_len=64, max_batch_tokens=100)  # the group's tokens are counted
    state.save_run(txn, Registration.model_validate(reg), started=True)
    rs.open_txn(
        txn,
        OpenRequest(group_id="g", producer_id="p1", group_size=4, deadline_s=60.0),
        0.0,
        SETTINGS,
        ANYONE,
        limits=LIMITS,
    )
    opened = txn.rollouts.get("g")
    assert opened is not None
    assert post(txn, 0, 5) == "accepted" and post(txn, 2, 7) == "accepted"
    row = txn.rollouts.get("g")
    assert row is not None and row.record == opened.record, "a post leaves the record as it was"
    assert (row.done, row.tokens) == (2, 12) and row.bytes > 0
    assert txn.rollouts.done("g") == {0: "p1", 2: "p1"}
    assert rs.totals_txn(txn)[rr.OPEN_DONE] == 2


def test_a_post_reads_no_other_slot() -> None:
    """A post compares itself with its own slot only: another slot whose stored rollout this release cannot read
    is no part of it (the group's tokens are its row's counter, not a sum over its slots)."""
    txn = MemoryTxn(State())
    reg = registration(batch_size=8, max_token_len=64, max_batch_tokens=100)
    state.save_run(txn, Registration.model_validate(reg), started=True)
    rs.open_txn(
        txn,
        OpenRequest(group_id="g", producer_id="p1", group_size=4, deadline_s=60.0),
        0.0,
        SETTINGS,
        ANYONE,
        limits=LIMITS,
    )
    txn.rollouts.add_slot(SlotRow("g", 0, "p1", "d", b"not a record", 90, 1.0, None), 12)
    assert post(txn, 1, 10) == "accepted"
    assert post(txn, 1, 10) == "duplicate"
    row = txn.rollouts.get("g")
    assert row is not None and (row.done, row.tokens) == (2, 100)
    body = {"group_id": "g", "slot": 2, "producer_id": "p1", "tokens": [1], "masks": [1], "score": 1.0}
    with pytest.raises(InvalidData, match="max_batch_tokens of 100"):  # counted without reading the slots
        rs.post_txn(txn, RolloutPost.model_validate(body), 0.0, SETTINGS, limits=LIMITS)
