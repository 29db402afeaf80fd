"""The lease/fate logic (api/tasks/leases.py, fates.py) against a simple model, as a hypothesis state machine over the
in-process task tables: leases, heartbeats, expiry, groups acknowledged and decided, steps acknowledged by the
trainer, failures, epochs. The invariants: a task is in at most one live lease, the tallies are the rows' states,
no (epoch, task) is trained twice, a served task is trained in the step it was served in, retries stay within the
policy, and a finished dataset has every (epoch, task) served or in a final state."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from api.store.base import DROPPED, QUEUED, SERVED, LedgerGroup, LedgerStep
from api.store.memory import MemoryTxn, State
from api.store.tasks import FRONT, LEASED
from api.tasks import fates as task_fates
from api.tasks import leases as tl
from api.tasks import states
from api.tasks import tokens as task_tokens
from api.tasks.order import ORDERS, POSITIONAL, WEIGHTED, task_at
from api.tasks.records import Dataset

DURATION = 10.0


def test_every_order_is_a_permutation_of_its_epoch() -> None:
    for size in (1, 2, 3, 5, 16, 17, 100, 1000):
        for order in POSITIONAL:
            for epoch in (0, 1):
                assert sorted(task_at(order, 7, epoch, p, size) for p in range(size)) == list(range(size))
    assert [task_at("shuffled", 7, 0, p, 100) for p in range(100)] != [
        task_at("shuffled", 7, 1, p, 100) for p in range(100)
    ]


@dataclass
class Model:
    state: str
    token: str | None = None
    ledger: int | None = None
    retries: int = 0
    trained: int = 0
    step: int | None = None
    """Served or trained: the step it was served in."""


class Leases(RuleBasedStateMachine):
    @initialize(
        size=st.integers(1, 5), epochs=st.integers(1, 3), retries=st.integers(0, 2), order=st.sampled_from(ORDERS)
    )
    def start(self, size: int, epochs: int, retries: int, order: str) -> None:
        self.txn = MemoryTxn(State())
        self.size, self.epochs, self.max_retries = size, epochs, retries
        levels = {"easy": 3.0, "hard": 1.0} if order == WEIGHTED else None
        tl.register(
            self.txn,
            Dataset(name="d", sealed=False, epochs=epochs, order=order, max_retries=retries, seed=1, levels=levels),
        )
        tasks = [f'{{"i":{i},"level":"{"hard" if i % 3 == 0 else "easy"}"}}' for i in range(size)]
        tl.add_tasks(self.txn, "d", 0, tasks[:2], last=False)  # in two pages: levels indexed across pages
        tl.add_tasks(self.txn, "d", min(2, size), tasks[2:], last=True)
        self.now = 0.0
        self.model: dict[tuple[int, int], Model] = {}
        self.expiry: dict[str, float] = {}
        self.tokens: list[str] = []
        self.ledger: dict[int, tuple[int, int]] = {}
        self.next_ledger = 1
        self.step = 0
        """The next step to form: each group served is a batch of its own."""
        self.mark = 0
        """Every step before it is acknowledged by the trainer."""

    def _key(self, token: str) -> tuple[int, int]:
        parsed = task_tokens.parse_token(token)
        assert parsed is not None
        return parsed.epoch, parsed.index

    def _ended(self, m: Model) -> None:
        if m.retries < self.max_retries:
            m.state, m.retries, m.token = FRONT, m.retries + 1, None
        else:
            m.state, m.token = "final", None

    @rule(producer=st.sampled_from(["a", "b"]), n=st.integers(1, 3), max_bytes=st.sampled_from([None, 1, 40]))
    def lease(self, producer: str, n: int, max_bytes: int | None) -> None:
        """`max_bytes`: 1 leaves one task a reply, 40 one or two (a task is about 20 bytes): the tasks left out
        stay where they were, so each (epoch, task) is still handed out once."""
        for m in self.model.values():  # what the call reclaims first
            if m.state == LEASED and m.token is not None and self.expiry[m.token] <= self.now:
                m.state, m.token = FRONT, None
        got = tl.lease(self.txn, "d", producer, n, self.now, DURATION, 4, max_bytes=max_bytes)
        if max_bytes is not None:
            assert len(got) <= 1 or sum(len(x.data) for x in got) <= max_bytes, got
        for x in got:
            key = (x.epoch, x.index)
            assert 0 <= x.index < self.size and 0 <= x.epoch < self.epochs
            assert json.loads(x.data)["i"] == x.index, "the task handed out is the one its index names"
            m = self.model.setdefault(key, Model(FRONT))
            assert m.state == FRONT, f"{key} leased while {m.state}"
            m.state, m.token = LEASED, x.token
            self.expiry[x.token] = x.expires_at
            self.tokens.append(x.token)

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        token = data.draw(st.sampled_from(self.tokens))
        m = self.model[self._key(token)]
        held = m.state == LEASED and m.token == token
        out = tl.heartbeat(self.txn, [token], self.now, DURATION)
        assert (out[token] is not None) == held
        if held:
            self.expiry[token] = self.now + DURATION

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), dropped=st.booleans())
    def group_acknowledged(self, data: st.DataObject, dropped: bool) -> None:
        token = data.draw(st.sampled_from(self.tokens))
        m = self.model[self._key(token)]
        lid, self.next_ledger = self.next_ledger, self.next_ledger + 1
        row = LedgerGroup(
            id=lid,
            env_id=0,
            group_id=token,
            handler=None,
            acked_at=self.now,
            policy_step=0,
            seqs=1,
            tokens=1,
            bytes=1,
            score_mean=0,
            score_min=0,
            score_max=0,
            score_std=0,
            fate=DROPPED if dropped else QUEUED,
        )
        task_fates.on_acknowledged(self.txn, [row])
        if m.state in (LEASED, FRONT):
            m.state, m.token, m.ledger = states.SUBMITTED, None, lid
            self.ledger[lid] = self._key(token)
            if dropped:
                self._ended(m)

    @precondition(lambda self: self.ledger)
    @rule(data=st.data(), served=st.booleans())
    def group_decided(self, data: st.DataObject, served: bool) -> None:
        lid = data.draw(st.sampled_from(sorted(self.ledger)))
        m = self.model[self.ledger.pop(lid)]
        step = self.step
        if served:  # a batch of this one group, as formation writes it: its ledger row, then the decision
            self.txn.ledger.put_step(LedgerStep(step, self.now, 0.0, (lid,), 1, 1, {}, {}, {}))
            self.step += 1
        task_fates.on_decided(self.txn, [lid], SERVED if served else DROPPED, step=step, reason="stale", now=self.now)
        if m.state == states.SUBMITTED and m.ledger == lid:
            if served:
                m.state, m.step = states.SERVED, step
            else:
                self._ended(m)

    @precondition(lambda self: self.step > self.mark)
    @rule(data=st.data())
    def steps_acknowledged(self, data: st.DataObject) -> None:
        """The trainer acknowledges every step before `before` (a commit, or asking for a later batch)."""
        before = data.draw(st.integers(self.mark + 1, self.step))
        task_fates.on_trained(self.txn, self.mark, before, self.now)
        for m in self.model.values():
            if m.state == states.SERVED and m.step is not None and m.step < before:
                m.state, m.trained = "final", m.trained + 1
        self.mark = before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), reason=st.sampled_from([None, "boom"]))
    def fail(self, data: st.DataObject, reason: str | None) -> None:
        token = data.draw(st.sampled_from(self.tokens))
        m = self.model[self._key(token)]
        held = m.state == LEASED and m.token == token
        assert tl.give_up(self.txn, token, reason, self.now) == held
        if held and reason is None:
            m.state, m.token = FRONT, None
        elif held:
            self._ended(m)

    @invariant()
    def tallies_match_the_model(self) -> None:
        if not hasattr(self, "txn"):
            return
        d = Dataset.of(str(self.txn.tasks.get_dataset("d")))
        live = [k for k, m in self.model.items() if m.state == LEASED]
        assert d.counts.get(LEASED, 0) == len(live)
        assert d.counts.get(FRONT, 0) == sum(m.state == FRONT for m in self.model.values())
        assert d.counts.get(states.SUBMITTED, 0) == sum(m.state == states.SUBMITTED for m in self.model.values())
        assert d.counts.get(states.SERVED, 0) == sum(m.state == states.SERVED for m in self.model.values())
        assert d.counts.get(states.TRAINED, 0) == sum(m.trained for m in self.model.values())
        rows = self.txn.tasks.rows("d", list(self.model))
        for key, m in self.model.items():
            if m.state == states.SERVED or m.trained:
                assert rows[key].step == m.step, f"{key} trained in another step than it was served in"
        assert sum(d.held.values()) == len(live)
        # One lease per task, except a task retried after its epoch's cursor moved on (its group dropped once the
        # next epoch began), leased beside its next epoch's lease: the documented edge (docs/tasks.md).
        fresh = [k for k in live if self.model[k].retries == 0]
        assert len({k[1] for k in fresh}) == len(fresh), "a task in two leases at once"
        assert all(m.trained <= 1 and m.retries <= self.max_retries for m in self.model.values())
        if d.done:
            assert len(self.model) == self.size * self.epochs
            assert all(m.state in ("final", states.SERVED) for m in self.model.values())


Leases.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestLeases = Leases.TestCase
