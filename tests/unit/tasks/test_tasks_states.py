"""A task's state machine (api/tasks/states.py) under any sequence of moves, each move asked of any row whatever
its state: a move is applied exactly where `MOVES` lets it leave from, and refused (`IllegalMove`) elsewhere,
leaving the row as it was. The invariants: every row is in a state of `STATES`, the tallies `counted` keeps are
the rows' states, a task is trained at most once and never leaves a final state, a served task is trained in
the step it was served in (a batch served again is the same step: serving it again is refused), retries stay
within the policy, and a task is held by a lease exactly while it is leased."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.store.tasks import TaskRow
from api.tasks import states

MOVE = st.sampled_from(sorted(states.MOVES))


@dataclass
class Task:
    """What a task went through: how often it was trained, the step it was served in."""

    row: TaskRow
    trained: int = 0
    served_in: int | None = None
    history: list[str] = field(default_factory=list)


def apply(task: Task, move: str, step: int, seq: int, reason: str, max_retries: int) -> TaskRow:
    row, now = task.row, float(len(task.history))
    if move == "lease":
        return states.lease(row, producer="p", until=now + 10, holder=None, nonce="0" * 24, now=now)
    if move == "expire":
        return states.expire(row, seq)
    if move == "hand_back":
        return states.hand_back(row, seq, now)
    if move == "submit":
        return states.submit(row, 100 + len(task.history), now)
    if move == "serve":
        return states.serve(row, step, now)
    if move == "acknowledge":
        return states.acknowledge(row, now)
    if move == "drop":
        return states.drop(row, reason, step, now, max_retries=max_retries, seq=seq)
    assert move == "fail"
    return states.fail(row, reason, now, max_retries=max_retries, seq=seq)


@settings(max_examples=400)
@given(n=st.integers(1, 3), max_retries=st.integers(0, 2), length=st.integers(0, 60), data=st.data())
def test_every_sequence_of_moves_keeps_the_invariants(
    n: int, max_retries: int, length: int, data: st.DataObject
) -> None:
    """Each move is drawn among those the row's state allows as often as among all (so long histories happen),
    and asked of the row either way."""
    tasks = [Task(TaskRow("d", 0, i, states.NEW)) for i in range(n)]
    counts: dict[str, int] = {}
    seq = 0
    for _ in range(length):
        task = tasks[data.draw(st.integers(0, n - 1))]
        before = task.row
        allowed = sorted(m for m in states.MOVES if states.may(m, before))
        move = data.draw(st.sampled_from(allowed) | MOVE if allowed else MOVE)
        step = data.draw(st.integers(0, 5))
        reason = data.draw(st.sampled_from(["stale", states.RUN_TAIL]))
        if not states.may(move, before):
            with pytest.raises(states.IllegalMove, match=f"cannot {move}"):
                apply(task, move, step, seq, reason, max_retries)
            continue
        after = task.row = apply(task, move, step, seq, reason, max_retries)
        task.history.append(move)
        counts = states.counted(counts, before.state, after.state)
        assert before.state not in states.FINAL, f"{move} left the final state {before.state}"
        assert after.state in states.STATES
        assert (after.dataset, after.epoch, after.index) == (before.dataset, before.epoch, before.index)
        assert (after.state == states.LEASED) == (after.expires_at is not None), "held exactly while leased"
        if after.state == states.WAITING:
            assert after.seq == seq, "back at the front, behind what waits there"
            seq += 1
        if move == "serve":
            task.served_in = step
        if after.state == states.TRAINED:
            task.trained += 1
            assert after.step == task.served_in == before.step, "trained in the step it was served in"
        if after.retries != before.retries:
            assert after.retries == before.retries + 1 <= max_retries and reason != states.RUN_TAIL
        if move == "lease":
            assert after.leases == before.leases + 1 and after.ledger_id == before.ledger_id
    for task in tasks:
        assert task.trained <= 1, "trained twice"
        assert task.row.state != states.TRAINED or task.history.count("serve") == 1
    stored = [t.row.state for t in tasks if t.row.state != states.NEW]
    assert {k: v for k, v in counts.items() if v} == {s: stored.count(s) for s in set(stored)}


def test_a_batch_served_again_leaves_its_tasks_served_in_its_step_until_acknowledged() -> None:
    """A trainer that crashed asks for batch 3 again: the batch is the same, so its tasks do not move (serving a
    served task is refused); the acknowledgement of step 3 then trains them in step 3."""
    row = states.submit(TaskRow("d", 0, 0, states.LEASED, leases=1, expires_at=5.0), 7, 1.0)
    served = states.serve(row, 3, 2.0)
    assert not states.may("serve", served)
    with pytest.raises(states.IllegalMove, match="d:0:0 is served: it cannot serve"):
        states.serve(served, 4, 3.0)
    trained = states.acknowledge(served, 4.0)
    assert (trained.state, trained.step, trained.ledger_id) == (states.TRAINED, 3, 7)
    assert not any(states.may(move, trained) for move in states.MOVES), "trained is final"


def test_retries_follow_the_policy_and_never_the_run_tail() -> None:
    row = TaskRow("d", 0, 0, states.SUBMITTED, leases=1, ledger_id=7)
    again = states.drop(row, "stale", 2, 1.0, max_retries=1, seq=5)
    assert (again.state, again.retries, again.reason, again.seq) == (states.WAITING, 1, "dropped: stale", 5)
    final = states.drop(row, states.RUN_TAIL, 2, 1.0, max_retries=1, seq=5)
    assert (final.state, final.reason, final.step) == (states.DROPPED, states.RUN_TAIL, 2)
    used = TaskRow("d", 0, 0, states.LEASED, leases=2, retries=1, expires_at=9.0)
    assert states.fail(used, "boom", 1.0, max_retries=1, seq=0).state == states.FAILED
    assert states.counted({"leased": 1}, states.LEASED, states.FAILED) == {"leased": 0, "failed": 1}
    assert states.counted({}, states.NEW, states.LEASED) == {"leased": 1}
